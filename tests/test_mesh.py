"""The learner on a device mesh: the same committed batches give the same parameters on every mesh shape.

Each case runs `tests/mesh_run_steps.py` (3 optimizer steps on fixed synthetic 32-row batches, f32, CPU) in a
subprocess with its number of simulated CPU devices (fixed when JAX starts); the cases of one device count share
one process. Reference: one device, one pass per slot. Tolerance: per parameter tensor, ‖a − b‖ / ‖a‖ ≤ 1e-5.
Every case is compiled with the tests' XLA flags (see `_env`). Measured on the 2-core CI machine with LLVM level 0
alone: FSDP×4 5.7e-8, data 2 × model 2 7.7e-8, microbatches 6.8e-8, two processes 5.7e-8, resumed on another mesh
5.7e-8 (the figure measured at the default level; resuming on 1 or 2 devices passes the same tolerance); resumed on
the same mesh: bitwise equal; the same microbatches averaged per microbatch (the wrong normalisation) differ by
4.5e-3, so the tolerance separates.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jobs import TEST_XLA_FLAGS, job_config, run_job, simulated_devices
from makefile import make_env, recipe_command

from pipeline.config import ConfigError, LearnerStepConfig, MeshConfig, ModelSpec, TrainParams, validate_learner
from pipeline.process.ports import reserve_port

SCRIPT = Path(__file__).with_name("mesh_run_steps.py")
ROOT = SCRIPT.parent.parent
RTOL = 1e-5


def _env(devices: int, **extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    env.update(
        JAX_PLATFORMS="cpu",
        HF_HUB_OFFLINE="1",
        PYTHONHASHSEED="0",
        PYTHONPATH=str(ROOT),
        USE_TORCH="0",  # transformers (imported by levanter) would load PyTorch, unused here: ~4 s of CPU per process
        # the tests' XLA flags (jobs.TEST_XLA_FLAGS): compiling is most of these processes' CPU (each compiles its
        # own train step and runs it 3 times); LLVM level 0 against the default level: 5e-7 relative.
        XLA_FLAGS=simulated_devices(devices),
    )
    return env


def _start(
    out: Path, devices: int, *cases: str, distributed: tuple[object, ...] = (), **env: str
) -> subprocess.Popen[str]:
    """One process with `devices` simulated devices running `cases` (`NAME:DATA:FSDP:MODEL:MICRO[:MODE]`) in turn."""
    cmd = [sys.executable, str(SCRIPT), str(out), *cases]
    if distributed:
        cmd += ["--distributed", *map(str, distributed)]
    return subprocess.Popen(cmd, env=_env(devices, **env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen[str], timeout: float = 400) -> None:
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, output[-4000:]


def _params(path: Path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def _assert_close(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b)
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape
        rel = float(np.linalg.norm(x.astype(np.float64) - y) / max(np.linalg.norm(x.astype(np.float64)), 1e-30))
        worst = max(worst, rel)
    assert worst <= RTOL, f"relative parameter difference {worst:.3g} > {RTOL}"
    return worst


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every mesh case once: reference, FSDP×4 (committing a checkpoint of step 2), data 2 × model 2,
    microbatches 4×8, the FSDP×4 checkpoint (sharded, 4 blocks per FSDP tensor) resumed on 2 devices (data 2), on 1
    device and on 4 devices (FSDP×4 again: exact replay), two processes × 2 devices."""
    d = tmp_path_factory.mktemp("mesh")
    names = ("ref", "fsdp4", "dp2tp2", "micro", "resumed", "resumed1", "replay4", "two_proc")
    ckpt = {"MESH_CKPT_ROOT": str(d / "root")}
    # One process per device count, running its mesh shapes in turn (JAX starts once per process); the resumed
    # cases wait for the FSDP×4 checkpoint of step 2. Then the two distributed processes: the CI machine has 2 cores.
    procs = [
        _start(d, 4, "fsdp4:1:4:1:0:save", "dp2tp2:2:1:2:0", "replay4:1:-1:1:0:resume", **ckpt),
        _start(d, 1, "ref:1:-1:1:0", "micro:1:-1:1:8", "resumed1:1:-1:1:0:resume", **ckpt),
        _start(d, 2, "resumed:2:1:1:0:resume", **ckpt),
    ]
    for p in procs:
        _finish(p)
    with reserve_port() as port:  # held until both processes ended: nobody else can bind it meanwhile
        procs = [_start(d, 2, "two_proc:1:-1:1:0", distributed=(port.address, 2, i)) for i in range(2)]
        for p in procs:
            _finish(p)
    return {name: d / f"{name}.npz" for name in names}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp4", "dp2tp2", "micro", "resumed", "resumed1", "two_proc"])
def test_mesh_shapes_give_the_same_parameters(runs: dict[str, Path], case: str) -> None:
    ref = _params(runs["ref"])
    other = _params(runs[case])
    _assert_close(ref, other)
    # and the steps moved the parameters (the comparison is not of untouched initial weights)
    assert any(np.abs(x).sum() > 0 for x in ref)


@pytest.mark.slow
def test_replay_on_the_same_mesh_is_bitwise(runs: dict[str, Path]) -> None:
    """FSDP×4's sharded checkpoint of step 2, resumed on the same mesh with the same batch 3: the same bits."""
    a, b = _params(runs["fsdp4"]), _params(runs["replay4"])
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_make_replay_of_a_multi_device_run_is_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose learner ran on 2 simulated devices (mesh fsdp=-1, so fsdp=2), replayed through `make replay`'s
    command line from a process started with one device: replay rebuilds the recorded mesh (fsdp=2 over 2 devices)
    and gives the committed policy bit for bit."""
    run_root = tmp_path / "run"
    overrides = {"train.num_train_steps": "3", "evaluator": "false", "num_rollout_workers": "1"}
    overrides["cadence.checkpoint_interval"] = "1"
    monkeypatch.setenv("XLA_FLAGS", simulated_devices(2))
    job = run_job(job_config(tmp_path, str(run_root), None, **overrides))
    assert job.returncode == 0, job.stderr[-3000:]
    env = {**make_env(), "XLA_FLAGS": TEST_XLA_FLAGS, "PYTHONPATH": str(ROOT)}
    cmd = recipe_command("replay", RUN=str(run_root), FROM="2", TO="3", ARGS=f"--scratch {tmp_path / 'scratch'}")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "bitwise equal" in proc.stdout
    assert "learner mesh: data=1 fsdp=2 model=1 over 2 devices" in proc.stderr


def test_replay_names_the_topology_it_needs() -> None:
    """A multi-process run is refused in one line naming its processes, devices and mesh."""
    from policy.replay import Topology, use_recorded_devices

    line = use_recorded_devices(Topology(processes=2, devices=4, mesh=MeshConfig()))
    assert line is not None and "\n" not in line
    assert line.startswith("this run's learner ran on 2 processes × 2 devices (mesh fsdp=4); replay needs the same")


def test_replay_difference_names_an_element() -> None:
    """The first differing element is named by its index in the tensor, with both values."""
    import jax.numpy as jnp

    from policy.replay import compare

    a = {"w": jnp.zeros((2, 3), jnp.float32)}
    b = {"w": jnp.zeros((2, 3), jnp.float32).at[1, 2].set(0.5)}
    diff = compare(a, b)["['w']"]
    assert diff.index == (1, 2) and diff.ours == 0.5 and diff.theirs == 0.0
    assert "first at [1, 2]: run 0.0, replay 0.5" in str(diff)


def test_batch_not_divisible_by_data_axis_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"train.batch_size=30"):
        validate_learner(LearnerStepConfig(train=TrainParams(batch_size=30), mesh=MeshConfig(data=2, fsdp=2)))


def test_microbatch_not_dividing_batch_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"train.microbatch_size=12"):
        validate_learner(LearnerStepConfig(train=TrainParams(batch_size=32, microbatch_size=12)))


def test_microbatch_not_divisible_by_data_axis_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"train.microbatch_size=2.*mesh.data × mesh.fsdp = 4"):
        cfg = LearnerStepConfig(train=TrainParams(batch_size=32, microbatch_size=2), mesh=MeshConfig(data=4, fsdp=1))
        validate_learner(cfg)


def test_heads_not_divisible_by_model_axis_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"model.num_heads=6.*mesh.model=4"):
        model = ModelSpec(hidden_dim=48, num_heads=6, num_kv_heads=6)
        validate_learner(LearnerStepConfig(model=model, mesh=MeshConfig(fsdp=1, model=4)))


def test_bad_mesh_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"mesh.fsdp=0"):
        MeshConfig(fsdp=0)
    with pytest.raises(ConfigError, match=r"at most one axis may be -1"):
        MeshConfig(data=-1, fsdp=-1)
