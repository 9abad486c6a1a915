"""The Ray backend starts a two-process learner: one Ray actor per process, wired to one coordinator.

A local Ray cluster started by the test; the learner trains pre-committed batches as two `python -m steps.learn`
processes × 2 simulated CPU devices under `jax.distributed`, and its checkpoints are sharded over both processes."""

from __future__ import annotations

import time
from pathlib import Path

import draccus
import psutil
import pytest
from jobs import simulated_devices, step_module

from pipeline.config import RayBackendConfig
from pipeline.jobs.launchers.base import StepSpec
from pipeline.jobs.launchers.ray import RayLauncher, RayProcessGroup
from pipeline.jobs.step_logs import log_target
from pipeline.process.step_kind import StepKind
from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas.records import CommitMarker

pytest.importorskip("jax")

from test_learner import tiny_config, write_batches

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def learner_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What every learner process inherits: CPU, 2 simulated devices, a shared compilation cache."""
    monkeypatch.chdir(REPO)
    for k, v in {
        "JAX_PLATFORMS": "cpu",
        "HF_HUB_OFFLINE": "1",
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": str(REPO),
        "XLA_FLAGS": simulated_devices(2),
    }.items():
        monkeypatch.setenv(k, v)


def _prepare(tmp_path: Path, steps: int) -> tuple[RunStore, str]:
    """A run root with batches 1..steps committed, and the learner's config file for it."""
    store = RunStore(str(tmp_path / "run"))
    write_batches(store, range(1, steps + 1))
    cfg = tiny_config(store.root, steps=steps, keep_checkpoints=1000, batch_wait_timeout_s=120.0)
    config_path = tmp_path / "learner.yaml"
    with open(config_path, "w") as f:
        draccus.dump(cfg, f)
    return store, str(config_path)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one Ray cluster at a time: two starting together on 2 cores took minutes
def test_ray_backend_starts_one_actor_per_learner_process(tmp_path: Path, learner_env: None) -> None:
    store, config_path = _prepare(tmp_path, steps=2)
    launcher = RayLauncher(RayBackendConfig())
    spec = StepSpec("learner", StepKind.LEARNER, config_path, processes=2)
    try:
        launcher.prepare([spec])
        group = launcher.start(spec, log_target(store.root, None, "learner"))
        assert isinstance(group, RayProcessGroup) and len(group.members) == 2
        deadline = time.monotonic() + 600
        niceness: set[int] = set()  # of the learner programs (children of Ray workers of the cluster started here)
        while (rc := group.poll()) is None:
            assert time.monotonic() < deadline, "the learner group did not finish"
            for p in psutil.Process().children(recursive=True):
                try:
                    if step_module(p.cmdline()) == "steps.learn":
                        niceness.add(p.nice())
                except psutil.Error:
                    pass
            time.sleep(0.2)
    finally:
        ray.shutdown()
    rels = [rel for rel in store.list(layout.join(layout.LOGS, "learner")) if rel.endswith(".log")]
    logs = {rel: store.get(rel).decode(errors="replace") for rel in rels}
    assert rc == 0, "\n".join(text[-2000:] for text in logs.values())
    assert store.exists(layout.LEARNER_DONE)
    assert len(logs) == 2 and all("jax.distributed: process" in text for text in logs.values()), list(logs)
    rec = CommitMarker.from_json(store.get(layout.checkpoint_marker(2)), path="m")
    assert sorted(rec.files) == ["p0", "p1"]  # both processes wrote blocks of the checkpoint
    # at this process's niceness, not Ray's worker default of 15 (a fraction of the CPU beside other work)
    assert niceness == {psutil.Process().nice()}, niceness
