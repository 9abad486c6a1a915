"""Shared fixtures: a real GCS emulator for the session, and RunStores over every backend.

- `gcs_endpoint` (session): a running `GcsEmulator` (fake-gcs-server on loopback, in-memory, one bucket).
- `store` (parametrized: local, file, memory, gs): an empty `RunStore` on a fresh root of that backend.
- `local_store`: an empty `RunStore` on a fresh local folder.
- `store_factory(backend)`: a fresh empty root of the named backend (for tests that pick backends themselves).

- `default_job` (session): the test job (configs/test_cats.yaml as it is) run once on a local root, shared
  read-only by the tests that check what a finished job leaves behind.
- `learner_group_crash_run` (session): a job whose two-process learner group was SIGKILLed at random points
  (tests/test_job_crash_learner_group.py), shared read-only by that crash test and the two-process replay tests.

Scheduling over xdist workers (`make test` runs `-n 3 --dist loadgroup`): a test that uses a module- or
class-scoped fixture (a job shared by several assertions) is kept on one worker with the other users of that
fixture (its `xdist_group` is the module or class), so the fixture runs once; every other test is scheduled on
its own, so the long end-to-end tests spread over the workers instead of queueing behind one file. The tests that
mostly wait are scheduled first (`WAITING_FIRST`), then the longest tests and groups (`EXPECTED_SECONDS`), then the
other slow tests, so the short ones fill in at the end and the workers finish together. A test's own
`xdist_group` mark wins.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
# Every program into JAX's persistent compilation cache (when one is set, as `make test` does), not only those
# that took over a second: each step process compiles ~40 small programs, and the suite starts hundreds of them
# (measured: a 6-step test job with a warm cache 22.5 -> 20.1 s of CPU).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# ... and with no size limit, in the test processes and the steps they start (the Makefile's is 4 GiB): with a limit,
# JAX's cache scans the whole cache folder (a stat and an access-time read per entry) under its file lock at every
# write, and a clean-clone `make test` writes ~1,340 programs into a folder that grows to as many (measured:
# tests/test_loss_terms.py's 323 programs written into a folder of 4,000 entries, 82 s of CPU with the limit, 10 s
# without). Without a limit JAX takes no lock: a program read while another process writes it is a miss with a
# warning, compiled again. A checkout's `.cache/jax` holds only the suite's programs (`make clean` removes it).
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = "-1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gcs_emulator import GcsEmulator
from jobs import TEST_XLA_FLAGS, FinishedJob, job_config, run_job
from tiers import is_heavy

from pipeline.store.storage import RunStore

# A `make …` a test runs is a user's make in a fresh shell: not a sub-make of the `make test` that started pytest,
# whose command-line variables (`make test ARGS="-k x"`) would otherwise reach it through MAKEFLAGS and, exported by
# make to its recipes, as environment variables (ARGS would become every target's program flags).
_outer_command_line = os.environ.get("MAKEFLAGS", "").partition(" -- ")[2]
_outer_make_variables = re.findall(r"(?:^| )([A-Za-z_][A-Za-z0-9_]*)=", _outer_command_line)
for _name in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", *_outer_make_variables):
    os.environ.pop(_name, None)
# Every test process, and every process it starts, compiles with `TEST_XLA_FLAGS` (see tests/jobs.py).
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

BACKENDS = ("local", "file", "memory", "gs")


LONG_TIER = "guides_long"
"""The long tier's marker (tests/test_guides_long.py: recipes of CPU-minutes to CPU-hours, the judge on port 8000):
its tests run only when `-m` names it (`make test-guides`), never in `make test`, `make test-slow` or CI."""

FAST_TIER = os.environ.get("RLPIPE_TEST_TIER") == "fast"
"""Set by `make test-fast`: a test that starts a step program fails (see tests/tiers.py)."""


def _add_markers(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a slow test (crash suites, end-to-end runs)")
    config.addinivalue_line("markers", "heavy: not slow, but starts step programs or compiles models (tests/tiers.py)")
    config.addinivalue_line("markers", f"{LONG_TIER}: the long tier, run only when selected (`make test-guides`)")


def _shared_scope(item: pytest.Item) -> str | None:
    """The widest of module / class a fixture of `item` is scoped to ("module" wins), or None."""
    info = getattr(item, "_fixtureinfo", None)
    scopes = {d.scope for defs in (info.name2fixturedefs.values() if info else ()) for d in defs}
    if "module" in scopes or "package" in scopes:
        return "module"
    return "class" if "class" in scopes else None


_GROUPS_ENV = "RLPIPE_XDIST_GROUPS"


# Session-scoped fixtures that run a job: every test using one is kept on one worker, so the job runs once.
SHARED_SESSION_JOBS = ("default_job", "learner_group_crash_run")

# Wall seconds (fixtures included) of the longest tests and test groups on the 2-core CI machine under `make test`
# (the clean-clone run of 2026-11-26; tests cut since then: scaled by their measured CPU),
# by node-id prefix (the longest prefix that matches wins) or shared job fixture. Only their order matters: they
# are scheduled longest first, so no long test starts last while the other worker sits idle.
EXPECTED_SECONDS = {
    "tests/test_recipe.py": 217,  # SFT, then 40 RL steps of 512 rollouts (263 s with 50 in clean-clone make test)
    "tests/test_tool_recipe.py::test_tool_recipe_rl_gains_held_out_success": 300,  # SFT, then 20 two-turn RL steps
    # a job plus its judge (steps.serve), killed and restarted (was 106 with levanter's InferenceServer as the judge)
    "tests/test_judge_job.py::test_judged_lesson_with_a_served_policy_as_judge_survives_the_judge_dying": 85,
    # an SFT run, then one job with both verifiers lessons (was two jobs of 81 s each)
    "tests/test_verifiers_env.py::test_whole_job_trains_on_a_single_turn_and_a_tool_using_verifiers_env": 75,
    "tests/test_rescore.py::test_rescore_sigkilled_at_random_points_rescores_every_file_exactly_once": 30,
    "tests/test_eval_passk.py": 36,
    "tests/test_scale_sim.py::test_objects_listed_per_poll_do_not_grow_with_old_files": 25,  # run roots of 2,000 files
    "tests/test_agent_env.py": 40,
    # its crash test (8 steps; the job, then a reference group: 84 s scaled by CPU from 100 at 12) and two replays
    "learner_group_crash_run": 84,
    "tests/test_mesh.py": 125,  # five processes compiling the mesh cases (setup 119 s)
    "tests/test_parallel_publish.py": 50,  # two two-process learner starts (killed mid-publish, restarted)
    "tests/test_job_crash.py": 86,  # 14 steps, 20-22 kills (97 s with 20 steps and 24 kills)
    "tests/test_partial_rollouts.py::test_job_with_partial_rollouts_and_killed_rollout_worker": 45,  # job + replay
    "tests/test_inference.py": 46,  # not slow, but a module of in-process sampler tests
    "tests/test_decode_efficiency.py": 40,  # not slow: three sampler pairs compiled, and two programs' HLO
    "tests/test_make_batches_crash.py": 43,
    "tests/test_evaluate_step.py": 32,  # 8 evaluate processes where 11 ran (shared kill/--all and make fixtures)
    "tests/test_readme_gcs.py": 105,  # two gs:// runs; the scheduled one 12 step processes (3 rounds, ~82 s)
    "default_job": 40,
    "tests/test_server_job.py": 45,
    "tests/test_lora.py::test_lora_learns_cats": 45,  # the demo job (no evaluator, 20 steps), then a replay
    "tests/test_learn_crash.py": 34,
    "tests/test_loss_learning.py": 34,  # each the demo job (20 steps; critic PPO 24) without evaluator, probes, report
    "tests/test_opd.py::test_opd_on_cats_reaches_the_teacher_reward_in_fewer_steps_than_rloo": 40,  # 2 in-process runs
    "tests/test_storage.py::test_an_outage_of_a_real_endpoint": 36,
    "tests/test_critic_ppo.py::test_value_head_checkpoint_resume_replay_bitwise_and_never_published": 30,
    "tests/test_critic_ppo.py::test_several_updates_per_slot_replay_bitwise": 45,
    "tests/test_server_backend.py": 30,
    "tests/test_ray_learner_group.py": 49,
    "tests/test_job_ray.py": 26,
    "tests/test_job_ray.py::test_ray_backend_runs_the_same_steps": 62,  # a local Ray cluster start
    "tests/test_job_interrupt.py": 37,
    "tests/test_elastic_pool.py": 100,  # a 30-step job, a worker then the learner held (67-82 s), Ray start/stop (30 s)
    "tests/test_retention.py": 16,  # the gs:// job (the local tests use `default_job`)
    "tests/test_demo.py": 22,
    "tests/test_rollout_worker.py": 21,
    "tests/test_curriculum_run.py": 19,
    "tests/test_job_e2e.py": 17,
    "tests/test_rollout_join.py": 16,
    "tests/test_job_progress.py": 10,
    "tests/test_interrupts.py": 60,  # 14 programs started and interrupted at random points (31 s of CPU)
    "tests/test_rlpipe.py": 25,  # ten real programs through `rlpipe`, the guide's cron wrapper
    "tests/test_guide_commands.py::test_configuration_guide": 35,  # two 2-step jobs
    "tests/test_guide_commands.py::test_critic_ppo_guide": 35,  # a 4-step job, a replay, an export
    "tests/test_guide_commands.py::test_lora_guide": 25,  # a 2-step job, an export
}
WAITING_FIRST = (
    "tests/test_storage.py::test_an_outage_of_a_real_endpoint",  # ~33 s waiting out gcsfs's retries, no CPU
    "tests/test_make_batches_crash.py",  # ~45 s, half of it lease and restart waits
)
"""Tests that mostly wait (timers, leases): scheduled before everything else, so that their waits overlap the
longest CPU-bound tests instead of each other (with three workers on two cores, the first three tests start
together)."""
SLOW_SECONDS = 10
"""What a slow test not in `EXPECTED_SECONDS` is taken to last (every other test: 0)."""


def _expected_seconds(item: pytest.Item) -> float:
    for name in SHARED_SESSION_JOBS:
        if name in getattr(item, "fixturenames", ()):
            return EXPECTED_SECONDS[name]
    prefixes = [p for p in EXPECTED_SECONDS if item.nodeid.startswith(p)]
    if prefixes:
        return EXPECTED_SECONDS[max(prefixes, key=len)]
    return SLOW_SECONDS if item.get_closest_marker("slow") else 0


def _group(item: pytest.Item) -> str | None:
    """The xdist group of a test: its own `xdist_group` mark, else the shared session job it uses, else its
    module / class if it uses a fixture of that scope (a shared job), else None (scheduled on its own)."""
    for mark in item.iter_markers("xdist_group"):
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    for name in SHARED_SESSION_JOBS:
        if name in getattr(item, "fixturenames", ()):
            return name
    scope = _shared_scope(item)
    if scope == "module":
        return item.nodeid.split("::")[0]
    if scope == "class":
        return "::".join(item.nodeid.split("::")[:2])
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """On the xdist controller with `--dist loadgroup`: a file where the workers leave the test groups."""
    if getattr(config.option, "dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="rlpipe-xdist-groups-", suffix=".json")
        os.close(fd)
        os.environ[_GROUPS_ENV] = path  # inherited by the workers, started after this hook
    _add_markers(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The mostly waiting tests (`WAITING_FIRST`), then longest first (`EXPECTED_SECONDS`), then the other slow
    tests, so the short ones fill in at the end; a worker records the groups for the scheduler. The tests of
    tests/tiers.py are marked `heavy`. The long tier's tests (`LONG_TIER`) are deselected unless `-m` names it."""
    if LONG_TIER not in (config.getoption("markexpr", "") or ""):
        long_tier = [it for it in items if it.get_closest_marker(LONG_TIER)]
        if long_tier:
            config.hook.pytest_deselected(items=long_tier)
            items[:] = [it for it in items if not it.get_closest_marker(LONG_TIER)]
    for it in items:
        if is_heavy(it.nodeid, getattr(it, "fixturenames", ())):
            it.add_marker(pytest.mark.heavy)
    items.sort(key=lambda it: (not it.nodeid.startswith(WAITING_FIRST), -_expected_seconds(it)))
    path = os.environ.get(_GROUPS_ENV)
    if path and hasattr(config, "workerinput"):
        groups = {it.nodeid: g for it in items if (g := _group(it)) is not None}
        tmp = f"{path}.{config.workerinput['workerid']}"
        Path(tmp).write_text(json.dumps(groups))
        os.replace(tmp, path)  # every worker collects the same tests; the last complete write wins


def pytest_unconfigure(config: pytest.Config) -> None:
    path = os.environ.get(_GROUPS_ENV)
    if path and not hasattr(config, "workerinput"):
        Path(path).unlink(missing_ok=True)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` by the groups of `_group` (xdist's own `xdist_group` handling does not reach the
    scheduler under pytest 9, whose node ids no longer follow `item._nodeid`), in the collection's order: xdist
    would otherwise put the groups with the most tests first, whatever their length."""
    path = os.environ.get(_GROUPS_ENV)
    if getattr(config.option, "dist", "no") != "loadgroup" or not path:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FixtureGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:  # read once every worker has sent its collection (the file is written before)
                text = Path(path).read_text()
                self._groups = json.loads(text) if text else {}
            return self._groups.get(nodeid, nodeid)

    config.option.loadscopereorder = False
    return FixtureGroupScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def _test_process_jax_backend() -> None:
    """Start this test process's own JAX backend before any test runs.

    JAX fixes the device count when its backend starts; tests that set `XLA_FLAGS` (simulated devices) for the
    processes they start would otherwise, if they happened to be the first to touch JAX in this worker, leave
    every later in-process test of the worker on several devices (seen: a replay on 2 devices not bitwise equal
    to its 1-device run)."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return  # set by whoever started pytest: theirs to keep
    try:
        import jax
    except ImportError:
        return
    jax.devices()


@pytest.fixture(autouse=FAST_TIER)
def _fast_tier_guard(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[None]:
    """In `make test-fast`: a test that starts a step program (`python -m steps.…`, `rlpipe …`) fails, naming
    tests/tiers.py."""
    import subprocess

    started: list[str] = []
    original = subprocess.Popen.__init__

    def record(self: Any, args: Any, *a: Any, **kw: Any) -> None:
        words = [args] if isinstance(args, str | bytes) else [str(x) for x in args]
        line = " ".join(str(w) for w in words)
        program = os.path.basename(str(words[0]).split()[0]) if words and str(words[0]).strip() else ""
        if "-m steps." in line or " steps.run" in line or program == "rlpipe":
            started.append(line)
        original(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", record)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} starts a step program ({started[0][:200]}): list it in tests/tiers.py")


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[GcsEmulator]:
    """One fake-gcs-server for the whole test session (per xdist worker)."""
    emu = GcsEmulator()
    emu.start()
    try:
        yield emu
    finally:
        emu.stop()


StoreFactory = Callable[[str], RunStore]


@pytest.fixture
def store_factory(tmp_path: Path, request: pytest.FixtureRequest) -> StoreFactory:
    """`factory(backend)` -> an empty RunStore on a fresh root of `backend` (local, file, memory, gs)."""

    def make(backend: str) -> RunStore:
        uid = uuid.uuid4().hex[:10]
        if backend == "local":
            return RunStore(str(tmp_path / f"run-{uid}"))
        if backend == "file":
            return RunStore(f"file://{tmp_path}/run-{uid}")
        if backend == "memory":
            return RunStore(f"memory://rlpipe-{uid}")
        if backend == "gs":
            emu: GcsEmulator = request.getfixturevalue("gcs_endpoint")
            return RunStore(f"gs://{emu.bucket}/run-{uid}", emu.storage_options)
        raise ValueError(f"unknown backend {backend!r}")

    return make


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, store_factory: StoreFactory) -> RunStore:
    """An empty RunStore, once per backend."""
    return store_factory(str(request.param))


@pytest.fixture
def local_store(store_factory: StoreFactory) -> RunStore:
    """An empty RunStore on a fresh local folder."""
    return store_factory("local")


@pytest.fixture
def held_lease(tmp_path: Path) -> Iterator[Path]:
    """A run root whose BatchMaker lease a live holder (this process) keeps renewing."""
    import threading

    from pipeline.process.step_kind import StepKind
    from pipeline.store.lease import Lease

    root = tmp_path / "run"
    lease = Lease(RunStore(str(root)), StepKind.BATCHMAKER, "maker-A", ttl_s=6.0)
    lease.acquire()
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(0.3):
            lease.renew()

    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    yield root
    stop.set()
    thread.join()
    lease.release()


@pytest.fixture(scope="session")
def default_job(tmp_path_factory: pytest.TempPathFactory) -> FinishedJob:
    """The test job exactly as configs/test_cats.yaml has it (6 learner steps, 2 rollout workers, evaluator,
    checkpoints every 2 steps, 2 kept), run once through `python -m steps.run` on a fresh local root.

    Shared by several test files: a user must not write into `root` (copy it first)."""
    tmp = tmp_path_factory.mktemp("default-job")
    root = tmp / "run"
    proc = run_job(job_config(tmp, str(root)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return FinishedJob(root, proc)


@pytest.fixture(scope="session")
def learner_group_crash_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The crash job of tests/test_job_crash_learner_group.py (a two-process learner group × 2 simulated devices,
    SIGKILLed at random points, then run to its end; a checkpoint at every slot), run once: a
    `CrashedGroupRun`. Shared by several test files: a user must not write into its `root` (copy it first)."""
    from test_job_crash_learner_group import crashed_group_run

    return crashed_group_run(tmp_path_factory.mktemp("learner-group-crash"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported: freeze those objects out of the cyclic collector's full collections (as
    step programs do), which JAX's tracing in the tests triggers often."""
    gc.freeze()
