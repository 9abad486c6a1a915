"""Helpers of the end-to-end job tests: a job config on a given run root, running the job, run checks."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import draccus
from invariants import audit_run

from pipeline.config import RLJobConfig
from pipeline.store import layout
from pipeline.store.storage import RunStore

ROOT = Path(__file__).resolve().parents[1]
TEST_CONFIG = ROOT / "configs/test_cats.yaml"


def job_config(tmp_path: Path, run_root: str, storage_options: dict | None = None, **overrides: str) -> Path:
    """A copy of the test job config with its run root (and storage options) set."""
    cfg = draccus.parse(RLJobConfig, config_path=str(TEST_CONFIG), args=[f"--{k}={v}" for k, v in overrides.items()])
    import dataclasses

    cfg = dataclasses.replace(
        cfg, store=dataclasses.replace(cfg.store, run_root=run_root, storage_options=storage_options or {})
    )
    path = tmp_path / "job.yaml"
    path.write_text(str(draccus.dump(cfg)))  # dump returns the text when given no stream
    return path


TEST_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)
"""XLA flags of every test process and every process a test starts (conftest.py sets them): programs compiled at
LLVM optimisation level 0, with XLA:CPU's older fusion code generator instead of its MLIR fusion emitters, and
each as one LLVM module (XLA splits a module to compile its parts on several threads; with both cores busy the
split only adds work). Compiling, not running, is most of a test's XLA time at these model sizes (measured on the
2-core VM with no compile cache, the microbatch tests: 71 s of CPU with XLA's defaults, 43 s at level 0, 25 s with
the second flag; three job tests: 134 -> 115 s from the second flag; the microbatch, learner and inference tests:
46 -> 41-42 s of CPU from the third). Every program of a test is compiled the same way, so bitwise comparisons
(replay, crash against uninterrupted) hold as before; `make demo` and `make bench` keep XLA's defaults."""


def simulated_devices(n: int) -> str:
    """`XLA_FLAGS` for a process that sees `n` simulated CPU devices, compiled with `TEST_XLA_FLAGS`."""
    return f"--xla_force_host_platform_device_count={n} {TEST_XLA_FLAGS}"


def step_module(cmdline: list[str]) -> str | None:
    """The module a process runs (`python -m <module> ...`) by its command line, else None. A step forked by the
    job's fork server shows its command line as one string (its process title), so the words are re-split."""
    words = " ".join(cmdline).split()
    return words[words.index("-m") + 1] if "-m" in words[:-1] else None


@dataclass(frozen=True)
class FinishedJob:
    """A job that ran to the end: its local run root and the runner's completed process (stdout, stderr)."""

    root: Path
    proc: subprocess.CompletedProcess[str]


def run_job(
    config_path: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The job runner on `config_path` to its end (`env`: the whole environment, default this process's)."""
    return subprocess.run(
        [sys.executable, "-m", "steps.run", "--config_path", str(config_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def check_finished_run(store: RunStore, num_steps: int, max_lag: int, evaluated: bool = True) -> None:
    """The run audit passes, slots and policies 1..num_steps are committed and within the staleness window, and
    (`evaluated`: a job with the evaluator) the first and the final policy were scored."""
    audit = audit_run(store, max_samples_per_rollout=1, max_lag=max_lag)
    assert not audit.problems, "\n".join(audit.problems[:20])
    assert audit.slots == list(range(1, num_steps + 1))
    assert audit.policies[0] == 0 and audit.policies[-1] == num_steps
    assert store.exists(layout.LEARNER_DONE)
    assert store.exists(layout.RUN_CONFIG)
    # every rollout that went into a batch respected the staleness window of its slot
    for slot in audit.slots:
        from schemas import BATCH

        t = store.read_parquet(store.read_log_entry(slot).data_file, BATCH)
        for steps in t.column("policy_steps").to_pylist():
            for p in steps:
                assert 0 <= (slot - 1) - p <= max_lag, (slot, p)
    if not evaluated:
        return
    # the evaluator scored the first and the final policy
    assert store.exists(layout.eval_summary_file(0, "cats"))
    assert store.exists(layout.eval_summary_file(num_steps, "cats"))


def policy_arrays(store: RunStore, step: int) -> list:
    """Every parameter of committed policy `step` of a run of the test job config, as numpy arrays."""
    from pipeline.environments.tokenizer import load_tokenizer
    from policy.model import model_vocab_size, numpy_params
    from policy.policy_format import read_policy

    cfg = draccus.parse(RLJobConfig, config_path=str(TEST_CONFIG), args=[])
    tok = load_tokenizer(cfg.model.tokenizer)
    return numpy_params(read_policy(store, step, cfg.model, model_vocab_size(tok)))


DEMO_CONFIG = ROOT / "configs/demo_cats.yaml"


@dataclass(frozen=True)
class DemoRewards:
    """What `make demo` measures of a job's learning, from its committed rollout files alone (`steps.demo`'s
    `show_rewards`): the mean cats reward of the rollouts of the first and of the last `WINDOW` policies."""

    start: float
    end: float
    last_policies: list[int]
    root: Path
    proc: subprocess.CompletedProcess[str]


def demo_job_rewards(tmp_path: Path, *args: str, loss: object = None) -> DemoRewards:
    """The `make demo` job (configs/demo_cats.yaml with `args`, draccus flags such as `--train.num_train_steps=16`,
    and `loss` in place of its loss block when given) run through `python -m steps.run` on a fresh local root
    under `tmp_path`, without the evaluator, and its learning measured as `make demo` measures it.

    `steps.demo` itself would also run the evaluator, greedy probes and the HTML report, none of which changes the
    rollouts these rewards are read from (a learning test asserts only the rewards): measured on the 2-core VM,
    the GSPO learning job took 29 s of CPU through `steps.demo`, and its whole test (pytest's start included)
    19 s this way."""
    import dataclasses

    from steps.demo import WINDOW, rewards_by_policy

    cfg = draccus.parse(RLJobConfig, config_path=str(DEMO_CONFIG), args=list(args))
    root = tmp_path / "run"
    cfg = dataclasses.replace(
        cfg, evaluator=False, store=dataclasses.replace(cfg.store, run_root=str(root), storage_options={})
    )
    if loss is not None:
        cfg = dataclasses.replace(cfg, loss=loss)  # type: ignore[arg-type]
    path = tmp_path / "job.yaml"
    path.write_text(str(draccus.dump(cfg)))  # dump returns the text when given no stream
    proc = run_job(path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_policy = rewards_by_policy(RunStore(str(root)))
    steps = sorted(by_policy)
    start = float(sum(by_policy[s] for s in steps[:WINDOW]) / len(steps[:WINDOW]))
    end = float(sum(by_policy[s] for s in steps[-WINDOW:]) / len(steps[-WINDOW:]))
    return DemoRewards(start, end, steps[-WINDOW:], root, proc)


def tamper_batch(store: RunStore, slot: int) -> int:
    """Change batch slot `slot` of a finished local run: +0.5 on the advantages of the loss tokens of one row of
    its second half (the rows a two-process learner's process 1 reads); the log entry gets the new size and digest,
    so the file verifies and replay trains on it. Returns the row."""
    import pyarrow as pa

    from schemas import BATCH

    entry_path = layout.batch_log_entry(slot)
    entry = json.loads(store.get(entry_path))
    table = store.read_parquet(entry["data_file"], BATCH)
    rows = table.to_pylist()
    row = next(r for r in range(len(rows) - 1, len(rows) // 2 - 1, -1) if any(rows[r]["loss_mask"]))
    rows[row]["advantages"] = [
        a + 0.5 if m else a for a, m in zip(rows[row]["advantages"], rows[row]["loss_mask"], strict=True)
    ]
    data = store.parquet_bytes(pa.Table.from_pylist(rows, schema=table.schema), BATCH, entry["data_file"])
    Path(store.full_path(entry["data_file"])).write_bytes(data)
    entry.update(data_size=len(data), data_sha256=hashlib.sha256(data).hexdigest())
    Path(store.full_path(entry_path)).write_text(json.dumps(entry))
    return row


def run_sft_then_rl(tmp_path: Path, sft: dict | None, rl: dict, env: dict[str, str], timeout: float) -> Path:
    """Write the recipe's two configs (SFT, then RL from the SFT run) under `tmp_path` and run `steps.sft` then
    `steps.run` on them as real processes from the repository root (each must exit 0); returns the RL run root.
    `sft=None`: the SFT run is already made (`rl`'s init_policy), only RL runs."""
    import yaml

    runs = [("steps.run", "rl.yaml")]
    if sft is not None:
        (tmp_path / "sft.yaml").write_text(yaml.safe_dump(sft))
        runs.insert(0, ("steps.sft", "sft.yaml"))
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(rl))
    for module, cfg in runs:
        done = subprocess.run(
            [sys.executable, "-m", module, "--config_path", str(tmp_path / cfg)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    return Path(rl["store"]["run_root"])
