"""pass@k / mean@k of evaluations (pipeline.rollout.passk, the eval summary's version-2 fields) and a short real job
on a reasoning-gym lesson: rows keep text, answer and ground truth; `make evaluate --all` writes pass@k; the report
shows the pass@k curves and right and wrong answers."""

from __future__ import annotations

import io
import itertools
import subprocess
import sys
from collections import defaultdict
from math import comb
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import reasoning_gym
import yaml

from pipeline.rollout.passk import pass_at_k, pass_at_k_of_groups
from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import EVAL_ROW, EVAL_SUMMARY, ROLLOUT, EvalSummaryRow
from schemas.base import SCHEMA_NAME_KEY, SCHEMA_VERSION_KEY

ROOT = Path(__file__).resolve().parents[1]


def brute_force(successes: list[bool], k: int) -> float:
    """The fraction of k-subsets of the samples holding at least one success (what pass@k estimates)."""
    subsets = list(itertools.combinations(successes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    ("n", "c", "k", "want"),
    [
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (4, 1, 1, 0.25),
        (4, 2, 2, 1 - 1 / 6),
        (5, 0, 3, 0.0),
        (5, 3, 3, 1.0),
        (10, 1, 10, 1.0),
    ],
)
def test_pass_at_k_by_hand(n: int, c: int, k: int, want: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(want)


def test_pass_at_k_equals_brute_force_enumeration() -> None:
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                flags = [True] * c + [False] * (n - c)
                assert pass_at_k(n, c, k) == pytest.approx(brute_force(flags, k)), (n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_at_k_refuses_impossible_counts() -> None:
    for n, c, k in ((3, 4, 1), (3, 1, 4), (3, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_groups_give_pass_and_mean_at_k() -> None:
    groups = {"a": [(1.0, True), (0.0, False), (0.5, False)], "b": [(0.0, False)] * 3, "c": [(1.0, True)] * 3}
    p = pass_at_k_of_groups(groups, 2)
    assert p is not None and (p.k, p.n, p.n_problems) == (2, 3, 3)
    assert p.pass_at_k == pytest.approx((brute_force([True, False, False], 2) + 0.0 + 1.0) / 3)
    assert p.mean_at_k == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert pass_at_k_of_groups(groups).k == 3  # type: ignore[union-attr]
    assert pass_at_k_of_groups({}) is None
    with pytest.raises(ValueError):
        pass_at_k_of_groups(groups, 4)


def test_version_1_summaries_read_without_pass_at_k() -> None:
    row = EvalSummaryRow(3, "l0", "eval", 10, 0.5, 0.25, 12.5, 0.0, 0.5, "s", 1.0)
    old_fields = [
        f for f in EVAL_SUMMARY.schema if f.name not in ("samples_per_problem", "pass_k", "pass_at_k", "mean_at_k")
    ]
    old = pa.Table.from_pylist([{f.name: getattr(row, f.name) for f in old_fields}], schema=pa.schema(old_fields))
    old = old.replace_schema_metadata({SCHEMA_NAME_KEY: b"eval_summary", SCHEMA_VERSION_KEY: b"1"})
    sink = io.BytesIO()
    pq.write_table(old, sink)
    table = RunStore.parse_parquet(sink.getvalue(), EVAL_SUMMARY, "old.summary.parquet")
    (back,) = EVAL_SUMMARY.from_table(table)
    assert (back.samples_per_problem, back.pass_k, back.pass_at_k, back.mean_at_k) == (0, 0, None, None)
    assert back.success_rate == 0.25


def _job(tmp_path: Path) -> Path:
    cfg = yaml.safe_load((ROOT / "configs/test_cats.yaml").read_text())
    cfg["store"]["run_root"] = str(tmp_path / "run")
    cfg["train"].update(num_train_steps=2, seq_len=56)
    cfg["num_rollout_workers"] = 1  # one worker samples the 2 steps (a second only adds a process start)
    cur = cfg["curriculum"]
    cur["lessons"] = {
        "sums": {
            "lesson_id": "sums",
            "env": {
                "env_class": "reasoning_gym",
                "env_args": {"task": "chain_sum", "level": 0, "answer_format": "first_line", "n_eval": 8},
            },
        }
    }
    cur["eval_sampling"].update(temperature=1.0, n_generations_per_prompt=4)
    cur.update(eval_frequency=2, eval_n_examples=4, eval_pass_k=2)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_reasoning_gym_job_rows_passk_and_report(tmp_path: Path) -> None:
    _run("-m", "steps.run", "--config_path", str(_job(tmp_path)))
    root = tmp_path / "run"
    _run("-m", "steps.evaluate", "--store.run_root", str(root), "--all", "true")  # what `make evaluate` runs
    store = RunStore(str(root))
    # rollout rows: the response as text, what was extracted from it and the library's own answer
    rows = [
        r
        for folder in store.list(layout.ROLLOUTS)
        for rel in store.list_committed(folder)
        for r in RunStore.parse_parquet(store.get(rel), ROLLOUT, rel).to_pylist()
    ]
    assert rows
    for r in rows[:40]:
        seed = int(r["example_id"].rsplit("-", 1)[1])
        assert seed >= 8  # train item seeds come after the eval ones
        entry = reasoning_gym.create_dataset(
            "chain_sum", seed=seed, size=1, min_terms=2, max_terms=2, min_digits=1, max_digits=1
        )[0]
        assert r["ground_truth"] == entry["answer"]
        first = [ln for ln in r["response_text"].splitlines() if ln.strip()]
        assert r["extracted_answer"] == (first[0].strip() if first else None)
    # every committed policy evaluated (the job evaluated 2, --all the rest) with pass@k and mean@k from its rows
    for step in (0, 1, 2):
        (summary,) = EVAL_SUMMARY.from_table(store.read_parquet(layout.eval_summary_file(step, "sums"), EVAL_SUMMARY))
        eval_rows = EVAL_ROW.from_table(store.read_parquet(layout.eval_rollouts_file(step, "sums"), EVAL_ROW))
        assert all(r.ground_truth and r.response_text is not None for r in eval_rows)
        per_problem: dict[str, list[tuple[float, bool]]] = defaultdict(list)
        for r in eval_rows:
            per_problem[r.group_key].append((r.episode_reward, r.episode_reward >= 1.0))
        assert (summary.samples_per_problem, summary.pass_k) == (4, 2)
        want = sum(brute_force([s for _, s in v], 2) for v in per_problem.values()) / len(per_problem)
        assert summary.pass_at_k == pytest.approx(want)
        mean = sum(sum(x for x, _ in v) / len(v) for v in per_problem.values()) / len(per_problem)
        assert summary.mean_at_k == pytest.approx(mean)
    _run("-m", "pipeline.report", str(root))
    page = (root / "report" / "index.html").read_text()
    assert (root / "report" / "plots" / "eval_pass_at_k.png").stat().st_size > 1000
    section = page[page.index("Right and wrong answers</h2>") :]
    assert "sums: wrong" in section and "eval step 2" in section and "rollout step" in section
    assert any(f'<td class="text">{r["ground_truth"]}</td>' in section for r in rows)
    assert "pass@k (k/n)" in page
