"""Hugging Face folders of committed policies for servers that load them (`policies/step-S/hf/`), and where a
child server's log goes.

`publish_hf_if_needed(store, config, step, tokenizer)` is a no-op unless `inference` is a `server` config with
`export_hf: true`. Otherwise it writes `policies/step-S/hf/<files>` (through `policy.model.export_hf`) and last
`policies/step-S/hf/COMMITTED` (create-if-absent): a reader (a server, another worker) uses the folder only once
that marker exists, so a worker killed half-way leaves nothing a server would load; several workers may race,
and they write identical bytes.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from pipeline import layout
from pipeline.config import ServerInferenceConfig

HF_DIR = "hf"
HF_MARKER = "COMMITTED"


def run_root_of(store: Any) -> str:
    """The run root as a server on this machine names it (absolute local path, or the gs:// URL)."""
    return str(store.root if store.is_local else store.url).rstrip("/")


def server_log_path(store: Any, worker_name: str) -> str | None:
    """`<run root>/logs/server/<worker>.log` for a local run root (None elsewhere: the child inherits our output)."""
    if not store.is_local:
        return None
    folder = os.path.join(store.root, "logs", "server")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{worker_name}.log")


def publish_hf_if_needed(store: Any, config: Any, step: int, tokenizer: Any) -> bool:
    """Write `policies/step-S/hf/` unless present or not asked for; True when this call wrote it."""
    inference = config.inference
    if not isinstance(inference, ServerInferenceConfig) or not inference.export_hf:
        return False
    folder = f"{layout.policy_dir(step)}/{HF_DIR}"
    if store.exists(f"{folder}/{HF_MARKER}"):
        return False
    from policy.model import export_hf, load_policy, policy_metadata

    model = load_policy(store, step, config.model, policy_metadata(store, step).vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model, tmp, tokenizer, family=config.model.family)
        names = sorted(os.listdir(tmp))
        for name in names:
            with open(os.path.join(tmp, name), "rb") as f:
                store.put_unique(f"{folder}/{name}", f.read())
    store.put_if_absent(f"{folder}/{HF_MARKER}", json.dumps({"step": step, "files": names}).encode())
    return True
