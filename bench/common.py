"""What every benchmark prints about where it ran, and the synthetic learner batch the learner benches train on."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or what `platform` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def machine_name() -> str:
    """The accelerator JAX uses if it is not the CPU, else the CPU model, core count and load average."""
    jax = sys.modules.get("jax")
    if jax is not None:
        dev = jax.devices()[0]
        if dev.platform != "cpu":
            return f"{dev.device_kind} ({dev.platform}) x{jax.device_count()}"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu_model()}, {os.cpu_count()} cores, load avg {load:.1f}"


def synthetic_learner_batch(batch: int, seq: int, vocab: int, sampler_logprob: float) -> dict[str, Any]:
    """Host arrays of one learner batch slot, named by the fields of `policy.losses.Batch`: random tokens (seed 0),
    one full-length sequence per row, every token a loss token with a random advantage, sampler logprobs all
    `sampler_logprob`, temperature 1."""
    import numpy as np

    rng = np.random.default_rng(0)
    rows = np.arange(batch, dtype=np.int32)[:, None]
    shape = (batch, seq)
    return {
        "tokens": rng.integers(0, vocab, shape).astype(np.int32),
        "segment_ids": np.zeros(shape, np.int32),
        "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int32), shape).copy(),
        "loss_mask": np.ones(shape, np.float32),
        "advantages": rng.normal(size=shape).astype(np.float32),
        "generator_logprobs": np.full(shape, sampler_logprob, np.float32),
        "temperature": np.ones(shape, np.float32),
        "truncated": np.zeros(shape, bool),
        "seq_index": np.broadcast_to(rows * seq, shape).astype(np.int32),
    }
