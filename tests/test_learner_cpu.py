"""The learner's CPU accounting hooks: the final checkpoint falls after the last step's metrics record,
and `RLPIPE_PROFILE` writes a cProfile of the learner process. Real learner runs on a tiny model and run root."""

from __future__ import annotations

import os
import pstats
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")

from test_learner import tiny_config, write_batches  # noqa: E402

from pipeline.store import layout  # noqa: E402
from pipeline.store.storage import RunStore  # noqa: E402
from pipeline.telemetry.metrics import read_metrics  # noqa: E402
from policy import policy_format as pf  # noqa: E402
from steps import learn  # noqa: E402


def test_last_step_is_logged_before_the_final_checkpoint(tmp_path: Path) -> None:
    """With a checkpoint every step, steps 1..N-1 are checkpointed inside their step and the last step's checkpoint
    is written after its metrics record: its `step_ended_at` precedes the final checkpoint's commit marker, which
    still exists (with LEARNER_DONE) when the learner returns."""
    root = str(tmp_path / "run")
    store = RunStore(root)
    write_batches(store, range(1, 4))
    assert learn.main(tiny_config(root, steps=3, keep_checkpoints=3)) == 0
    assert pf.committed_checkpoints(store) == [1, 2, 3]
    assert store.exists(layout.LEARNER_DONE)
    records = {int(r["step"]): r for r in read_metrics(store, "learner") if "step_ended_at" in r}
    assert sorted(records) == [1, 2, 3]
    marker_mtime = {s: os.path.getmtime(os.path.join(root, layout.checkpoint_marker(s))) for s in (2, 3)}
    # step 2's checkpoint is part of step 2 (written before its record); step 3's comes after step 3's record
    assert records[2]["step_ended_at"] >= marker_mtime[2]
    assert records[3]["step_ended_at"] <= marker_mtime[3]


def test_profile_env_writes_a_cprofile_of_the_learner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`RLPIPE_PROFILE=<dir>`: the learner writes `learner-<pid>.prof` there, a pstats file whose calls include the
    training loop; unset, nothing is written."""
    prof_dir = tmp_path / "prof"
    root = str(tmp_path / "run")
    write_batches(RunStore(root), range(1, 3))
    monkeypatch.setenv(learn.PROFILE_ENV, str(prof_dir))
    # 2 steps of a 3-step schedule: the train step program of the test above (the schedule's length is compiled in)
    assert learn.main(tiny_config(root, steps=3, max_steps=2)) == 0
    path = prof_dir / f"learner-{os.getpid()}.prof"
    assert path.is_file()
    funcs = {f"{os.path.basename(f)}:{name}" for f, _, name in pstats.Stats(str(path)).stats}  # type: ignore[attr-defined]
    assert "learner_loop.py:train" in funcs and "learner_loop.py:train_one" in funcs  # policy.learner_loop


def test_one_copy_safetensors_bytes_read_back_as_safetensors_own(tmp_path: Path) -> None:
    """`policy.policy_format.st_bytes.save` (the learner's policy and checkpoint serialiser) gives a file that
    safetensors itself validates and reads (names, dtypes, shapes, metadata) and that `st_load` reads back with the
    same values as from `safetensors.numpy.save`'s bytes: bfloat16, integers, bool, 0-d, empty, transposed
    (non-contiguous) and big-endian arrays; a dtype safetensors has no code for is refused by name."""
    import ml_dtypes
    import numpy as np
    import safetensors
    from safetensors.numpy import save as reference_save

    from policy.policy_format import st_load
    from policy.policy_format.st_bytes import save

    rng = np.random.default_rng(0)
    tensors = {
        "w": rng.standard_normal((3, 5)).astype(np.float32),
        "b16": rng.standard_normal((4, 2)).astype(ml_dtypes.bfloat16),
        "ids": np.arange(7, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 3), np.float32),
        "t": rng.standard_normal((3, 4)).astype(np.float32).T,
        "be": np.arange(6, dtype=">f4").reshape(2, 3),
    }
    data = save(tensors, metadata={"format": "test"})
    ours = st_load(data)
    # safetensors.numpy.save has no bfloat16 and keeps big-endian bytes: compare those against numpy itself
    theirs = st_load(reference_save({k: v for k, v in tensors.items() if k not in ("b16", "be")}))
    assert sorted(ours) == sorted(tensors)
    for name, array in tensors.items():
        assert ours[name].shape == array.shape and ours[name].dtype == array.dtype.newbyteorder("=")
        np.testing.assert_array_equal(ours[name], array)
        if name in theirs:
            assert theirs[name].dtype == ours[name].dtype
            np.testing.assert_array_equal(theirs[name], ours[name])
    parsed = dict(safetensors.deserialize(data))  # the Rust reader's validation of header and offsets
    assert parsed["b16"]["dtype"] == "BF16" and list(parsed["w"]["shape"]) == [3, 5]
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    with safetensors.safe_open(str(path), "numpy") as f:
        assert f.metadata() == {"format": "test"} and sorted(f.keys()) == sorted(tensors)
    with pytest.raises(ValueError, match=r"'c'.*complex64"):
        save({"c": np.zeros(2, np.complex64)})
