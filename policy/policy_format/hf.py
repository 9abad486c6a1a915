"""Hugging Face folders: `export_hf` writes a model as a folder transformers, vLLM and SGLang load, and
`policies/step-S/hf/` holds one of a committed policy for servers that load them.

`publish_hf_if_needed(store, config, step, tokenizer)` is a no-op unless `inference` is a `server` config with
`export_hf: true`. Otherwise it writes `policies/step-S/hf/<files>` (through `export_hf`) and last
`policies/step-S/hf/COMMITTED` (create-if-absent, a `schemas.records.HfFolderMarker` listing every file with its
size and sha256): a reader (a server, another worker) uses the folder only once that marker exists, so a worker
killed half-way leaves nothing a server would load; several workers may race, and they write identical bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any

import equinox as eqx
import fsspec
import jax
from levanter.models.lm_model import LmHeadModel

from pipeline.config import ModelSpec, ServerInferenceConfig
from pipeline.store import layout
from pipeline.store.urls import is_local, split_location
from policy.families import FAMILIES
from policy.hf_checkpoint import hf_converter as _hf_converter
from policy.hf_checkpoint import host_mesh as _host_mesh
from policy.policy_format.policies import policy_metadata, read_policy
from schemas.records import CommitFile, HfFolderMarker

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore

logger = logging.getLogger(__name__)


def export_hf(model: LmHeadModel, out_dir: str, tokenizer: Any, family: str = "llama") -> None:
    """Write a Hugging Face folder for `model` that transformers, vLLM and SGLang load as is.

    The folder: `config.json` (with `architectures` and `torch_dtype`), `generation_config.json` (BOS, EOS and
    pad ids), `model.safetensors`, and the tokenizer as `pipeline.environments.tokenizer.save_for_export` writes it (it
    encodes a prompt to the ids the rollout workers use, BOS included, and returns no `token_type_ids`).
    Nothing is fetched from a hub. `out_dir` may be local or an fsspec URL.
    """
    remote = not is_local(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "out") if remote else split_location(out_dir)[1]
        os.makedirs(local, exist_ok=True)
        _write_hf_folder(model, local, tokenizer, family, ref_dir=os.path.join(tmp, "ref"))
        if remote:
            fs, base = fsspec.core.url_to_fs(out_dir)
            for name in sorted(os.listdir(local)):
                fs.put_file(os.path.join(local, name), f"{base.rstrip('/')}/{name}")
    logger.info("exported HF checkpoint to %s", out_dir)


def _write_hf_folder(model: LmHeadModel, out: str, tokenizer: Any, family: str, ref_dir: str) -> None:
    import transformers

    from pipeline.environments.tokenizer import save_for_export

    hf_config = model.config.to_hf_config(model.Vocab.size)
    hf_config.architectures = [FAMILIES[family].architecture]
    hf_config.save_pretrained(ref_dir)
    converter = _hf_converter(ModelSpec(family=family), ref_dir, tokenizer=tokenizer)
    with _host_mesh():
        converter.save_pretrained(model, out, save_reference_code=False, save_tokenizer=False)
    save_for_export(tokenizer, out)
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config_file = os.path.join(out, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    # The generation defaults the converter copies into config.json (e.g. suppressing BOS/EOS/pad as the first
    # token) are not how the policy samples: generation_config.json below holds the ones that apply.
    for key in ("begin_suppress_tokens", "suppress_tokens", "decoder_start_token_id", "max_length"):
        config.pop(key, None)
    dtype = str(jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))[0].dtype)
    config.update(ids, torch_dtype=dtype, dtype=dtype)
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    transformers.GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(out)


HF_DIR = "hf"
HF_MARKER = "COMMITTED"


def hf_marker_path(step: int) -> str:
    """`policies/step-S/hf/COMMITTED`."""
    return f"{layout.policy_dir(step)}/{HF_DIR}/{HF_MARKER}"


def read_hf_marker(store: RunStore, step: int) -> HfFolderMarker | None:
    """The commit marker of policy `step`'s Hugging Face folder (None: not committed); RecordError naming the
    file and the field when it is not a valid `HfFolderMarker`."""
    path = hf_marker_path(step)
    if not store.exists(path):
        return None
    return HfFolderMarker.from_json(store.get(path), path=path)


def publish_hf_if_needed(store: RunStore, config: Any, step: int, tokenizer: Any) -> bool:
    """Write `policies/step-S/hf/` unless present or not asked for; True when this call wrote it."""
    inference = config.inference
    if not isinstance(inference, ServerInferenceConfig) or not inference.export_hf:
        return False
    folder = f"{layout.policy_dir(step)}/{HF_DIR}"
    if read_hf_marker(store, step) is not None:
        return False
    model = read_policy(store, step, config.model, policy_metadata(store, step).vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model, tmp, tokenizer, family=config.model.family)
        files = {}
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as f:
                data = f.read()
            store.put_unique(f"{folder}/{name}", data)
            files[name] = CommitFile(path=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    store.put_if_absent(hf_marker_path(step), HfFolderMarker(step=step, files=files).to_json())
    return True
