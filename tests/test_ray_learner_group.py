"""The Ray backend starts a two-process learner: one Ray actor per process, wired to one coordinator.

A local Ray cluster started by the test; the learner trains pre-committed batches (as in the two-process crash
test) as two `python -m steps.learn` processes × 2 simulated CPU devices under `jax.distributed`, and its
checkpoints are sharded over both processes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_learn_crash_multiprocess import _prepare, learner_env  # noqa: F401 - the fixture is used by name

from pipeline import layout
from pipeline.config import RayBackendConfig
from pipeline.runners.base import StepSpec
from pipeline.runners.ray import RayLauncher, RayProcessGroup
from pipeline.step_logs import log_target
from schemas.records import CommitMarker

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_ray_backend_starts_one_actor_per_learner_process(tmp_path: Path, learner_env: None) -> None:  # noqa: F811
    store, config_path = _prepare(tmp_path, "run", steps=2)
    launcher = RayLauncher(RayBackendConfig())
    spec = StepSpec("learner", "learner", config_path, processes=2)
    try:
        launcher.prepare([spec])
        group = launcher.start(spec, log_target(store.root, None, "learner"))
        assert isinstance(group, RayProcessGroup) and len(group.members) == 2
        deadline = time.monotonic() + 600
        while (rc := group.poll()) is None:
            assert time.monotonic() < deadline, "the learner group did not finish"
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
