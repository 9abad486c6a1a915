"""Hugging Face folders of committed policies for servers that load them (`policies/step-S/hf/`), and where a
child server's log goes.

`publish_hf_if_needed(store, config, step, tokenizer)` is a no-op unless `inference` is a `server` config with
`export_hf: true`. Otherwise it writes `policies/step-S/hf/<files>` (through `policy.model.export_hf`) and last
`policies/step-S/hf/COMMITTED` (create-if-absent, a `schemas.records.HfFolderMarker` listing every file with its
size and sha256): a reader (a server, another worker) uses the folder only once that marker exists, so a worker
killed half-way leaves nothing a server would load; several workers may race, and they write identical bytes.

A worker's child server logs to `pipeline.jobs.step_logs.server_log(store, worker_id)`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

from pipeline.config import ServerInferenceConfig
from pipeline.store import layout
from schemas.records import CommitFile, HfFolderMarker

HF_DIR = "hf"
HF_MARKER = "COMMITTED"


def hf_marker_path(step: int) -> str:
    """`policies/step-S/hf/COMMITTED`."""
    return f"{layout.policy_dir(step)}/{HF_DIR}/{HF_MARKER}"


def read_hf_marker(store: Any, step: int) -> HfFolderMarker | None:
    """The commit marker of policy `step`'s Hugging Face folder (None: not committed); RecordError naming the
    file and the field when it is not a valid `HfFolderMarker`."""
    path = hf_marker_path(step)
    if not store.exists(path):
        return None
    return HfFolderMarker.from_json(store.get(path), path=path)


def publish_hf_if_needed(store: Any, config: Any, step: int, tokenizer: Any) -> bool:
    """Write `policies/step-S/hf/` unless present or not asked for; True when this call wrote it."""
    inference = config.inference
    if not isinstance(inference, ServerInferenceConfig) or not inference.export_hf:
        return False
    folder = f"{layout.policy_dir(step)}/{HF_DIR}"
    if read_hf_marker(store, step) is not None:
        return False
    from policy.model import export_hf, load_policy, policy_metadata

    model = load_policy(store, step, config.model, policy_metadata(store, step).vocab_size)
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
