"""Model families (`model.family`) and where a Hugging Face checkpoint is read from.

`FAMILIES` maps every `pipeline.config.MODEL_FAMILIES` name to its levanter config class and its Hugging Face
names; `hf_metadata_folder` gives a local folder with the config and tokenizer files of a `model.hf_checkpoint` (a
local folder or an fsspec URL such as gs://) without copying its weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any

import fsspec
from levanter.models.gemma import GemmaConfig
from levanter.models.llama import LlamaConfig
from levanter.models.mistral import MistralConfig
from levanter.models.qwen import Qwen3Config, QwenConfig

from pipeline.store.urls import is_local, split_location

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family (`model.family`): its levanter config class and its Hugging Face names."""

    config_class: Any
    hf_config: str
    """The transformers config class name."""
    architecture: str
    """config.json `architectures` of an export."""


FAMILIES: dict[str, Family] = {
    "llama": Family(LlamaConfig, "LlamaConfig", "LlamaForCausalLM"),
    "qwen2": Family(QwenConfig, "Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": Family(Qwen3Config, "Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": Family(MistralConfig, "MistralConfig", "MistralForCausalLM"),
    "gemma": Family(GemmaConfig, "GemmaConfig", "GemmaForCausalLM"),
}
"""Every `pipeline.config.MODEL_FAMILIES` entry (Qwen2 and Qwen2.5 are both `qwen2`)."""


HF_CACHE_ENV = "RLPIPE_HF_CACHE"
"""Where the small files of remote `model.hf_checkpoint` folders are copied (default: `<tmp>/rlpipe-hf`), one
folder per URL."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
"""Files of a checkpoint folder that hold weights: never copied to local disk by `hf_metadata_folder`."""


def is_remote(ref: str) -> bool:
    """Whether `ref` is an fsspec URL of a remote file system (a gs:// folder, say; see `pipeline.store.urls`)."""
    return not is_local(ref)


def hf_metadata_folder(ref: str) -> str:
    """A local folder holding the config, tokenizer and generation-config files of the Hugging Face checkpoint `ref`
    (a local path, or any fsspec URL such as gs://), but not its weights.

    A local folder is returned as is. Of a remote one, every top-level file except weight files (`WEIGHT_SUFFIXES`)
    is copied once (into a temporary folder renamed into place when complete, so a half-copied folder is never
    used) under `$RLPIPE_HF_CACHE` and reused by later calls; the weights are read from the URL itself
    (`policy.model.build_model` streams them). Raises FileNotFoundError naming `ref` when it has no config.json.
    Credentials and endpoints are fsspec's defaults (for gs://, `STORAGE_EMULATOR_HOST` selects an emulator)."""
    if not is_remote(ref):
        return split_location(ref)[1]
    cache = os.environ.get(HF_CACHE_ENV) or os.path.join(tempfile.gettempdir(), "rlpipe-hf")
    dest = os.path.join(cache, hashlib.sha256(ref.rstrip("/").encode()).hexdigest()[:24])
    if os.path.exists(os.path.join(dest, "config.json")):
        return dest
    fs, base = fsspec.core.url_to_fs(ref)
    base = base.rstrip("/")
    try:
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)]
    except FileNotFoundError:
        names = []
    if "config.json" not in names:
        raise FileNotFoundError(f"model.hf_checkpoint={ref}: no config.json in that folder")
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache, prefix=".partial-")
    for name in names:
        if not name.endswith(WEIGHT_SUFFIXES) and fs.isfile(f"{base}/{name}"):
            fs.get_file(f"{base}/{name}", os.path.join(tmp, name))
    try:
        os.rename(tmp, dest)
    except OSError:  # another process finished the same copy first: use its folder
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("copied the config and tokenizer files of HF checkpoint %s to %s", ref, dest)
    return dest
