"""What every benchmark prints about where it ran, and the synthetic learner batch the learner benches train on."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path
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


def learner_on_mesh(config: Any, vocab: int, sampler_logprob: float) -> tuple[Any, Any, Any]:
    """(state, batch, step) for timing `policy.learner.mesh_train_step` under `config` (a `LearnerStepConfig`): the
    model built from scratch and sharded with a fresh optimizer state, one synthetic batch slot on the mesh
    (`synthetic_learner_batch`), and the jitted step `(model, opt_state, reference, batch) -> (model, opt_state,
    metrics)`."""
    import equinox as eqx

    from policy import learner as L
    from policy import mesh as mesh_lib
    from policy import model as M
    from policy.losses import Batch

    lm = mesh_lib.build_mesh(config.mesh)
    model = M.build_model(config.model, vocab)
    optimizer = L.build_optimizer(config.optimizer, config.train.num_train_steps)
    state = L.shard_state(L.LearnerState(0, model, optimizer.init(eqx.filter(model, eqx.is_array)), None), lm)
    B, S = config.train.batch_size, config.train.seq_len
    batch = Batch(**mesh_lib.global_batch(synthetic_learner_batch(B, S, vocab, sampler_logprob), lm, B))
    return state, batch, L.mesh_train_step(config, lm)


STEP_ROLES = (
    ("steps.forkserver", "fork server"),
    ("steps.learn", "learner"),
    ("steps.make_batches", "batchmaker"),
    ("steps.rollout", "rollout"),
    ("steps.evaluate", "evaluator"),
    ("steps.run", "runner"),
)
"""(module in a process's command line, role): the processes of an rlpipe job. A step forked by the job's fork
server carries its own `python -m steps.<name>` title (`steps.forkserver` sets it), so it is told apart from the
server that forked it."""


def process_role(cmdline: list[str]) -> str:
    """The role of a process of a benchmarked tree by its command line: an rlpipe step (`STEP_ROLES`), else `other`
    (e.g. a TRL child, the fork server's short-lived intermediate forks)."""
    words = " ".join(cmdline).split()  # a title set by setproctitle may come back as one string
    modules = {words[i + 1] for i, w in enumerate(words[:-1]) if w == "-m"}
    return next((role for module, role in STEP_ROLES if module in modules), "other")


class TreeCpu:
    """CPU seconds (user + system) of a process and all its descendants, by process, sampled every `period_s` in a
    thread; also the peak of their summed RSS. Samples are kept as (epoch time, {pid: cpu}) so that the CPU of any
    interval of the run can be read back (`cpu_at`), and each pid's role (`process_role`) is recorded once.

    A process's CPU after its last sample (at most `period_s` before it exits) is not seen; the whole tree's exact
    figure is the root's rusage once it is reaped (`_spawn` in `bench.bench_trl` reads it with `os.wait4`)."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        import threading

        import psutil

        self._proc = psutil.Process(pid)
        self.peak = 0
        self.roles: dict[int, str] = {}
        self.samples: list[tuple[float, dict[int, float]]] = []
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True)
        self._thread.start()

    def _loop(self, period_s: float) -> None:
        import time

        import psutil

        while not self._stop.is_set():
            try:
                procs = [self._proc, *self._proc.children(recursive=True)]
            except psutil.Error:
                return
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                    t = p.cpu_times()
                    # read again at every sample: a step forked by the fork server shows the server's command line
                    # until it sets its own title
                    self.roles[p.pid] = process_role(p.cmdline())
                    self._last[p.pid] = t.user + t.system
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self.samples.append((time.time(), dict(self._last)))
            self._stop.wait(period_s)

    def stop(self) -> int:
        """Stop sampling; the peak RSS in bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak

    @property
    def cpu_s(self) -> float:
        """The tree's CPU seconds as last sampled."""
        return sum(self._last.values())

    def cpu_at(self, t: float) -> dict[str, float]:
        """CPU seconds by role up to epoch time `t` (the last sample at or before it; the first if none is)."""
        if not self.samples:
            return {}
        at = self.samples[0][1]
        for ts, cpu in self.samples:
            if ts > t:
                break
            at = cpu
        out: dict[str, float] = {}
        for pid, s in at.items():
            role = self.roles.get(pid, "other")
            out[role] = out.get(role, 0.0) + s
        return out

    def by_role(self) -> dict[str, float]:
        """CPU seconds by role over the whole run (as last sampled)."""
        return self.cpu_at(float("inf"))


def gcs_emulator_class() -> Any:
    """tests/gcs_emulator.py's `GcsEmulator` (the same fake-gcs-server the tests run), loaded by path: the tests
    folder is not a package."""
    path = Path(__file__).resolve().parents[1] / "tests" / "gcs_emulator.py"
    spec = importlib.util.spec_from_file_location("rlpipe_gcs_emulator", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.GcsEmulator
