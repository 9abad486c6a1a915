"""The HTML report: built from a synthetic run root written with the real writers (RunStore,
MetricsWriter, the declared schemas); every section present, plots are real PNGs, numbers from
the data reach the summary, and missing or malformed data never crashes it."""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import re
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
from log_entries import put_log_entry

from pipeline import report
from pipeline.environments.tokenizer import BOS_ID, BUILTIN_TINY, build_tiny_tokenizer_object
from pipeline.rollout.samples import samples_record, to_samples
from pipeline.store import layout
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter
from schemas import BATCH, EVAL_SUMMARY, ROLLOUT, BatchRow, EvalSummaryRow, RolloutRow
from schemas.dropped import DROPPED, DroppedRow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
N_STEPS = 5
FINAL_REWARD = 0.8125
LESSONS = ("cats", "addition_easy")


def _batch_row(rollout_ids: list[str], no_signal: tuple[int, ...] = ()) -> BatchRow:
    """One packed training row holding one segment per rollout id (4 tokens each); the segments `no_signal` at
    advantage 0 (as a slot filled without signal has them), the others at 0.5."""
    n = len(rollout_ids)
    seg = [i for i in range(n) for _ in range(4)]
    return BatchRow(
        tokens=[1] * 4 * n,
        loss_mask=[0, 1, 1, 1] * n,
        segment_ids=seg,
        position_ids=[0, 1, 2, 3] * n,
        advantages=[0.0 if i in no_signal else 0.5 for i in seg],
        generator_logprobs=[-1.0] * 4 * n,
        reference_logprobs=None,
        truncated=[False] * n,
        temperatures=[1.0] * n,
        policy_steps=[0] * n,
        rollout_ids=rollout_ids,
        source_files=["rollouts/step-00000000/w0-00000000.parquet"] * n,
    )


def _dropped(slot: int, rows: list[tuple[str, str]]) -> pa.Table:
    return DROPPED.to_table(
        [
            DroppedRow(rid, "rollouts/step-00000000/w0-00000000.parquet", i, 0, reason, "", slot)
            for i, (rid, reason) in enumerate(rows)
        ]
    )


TINY = build_tiny_tokenizer_object()
PROMPT, COMPLETION = "Do you like cats?", " I love cats <3\n  meow"


def _rollout_row(policy_step: int, rid: str, reward: float) -> RolloutRow:
    response = TINY.encode(COMPLETION).ids
    return RolloutRow(
        rollout_id=rid,
        env_name="cats",
        example_id="e0",
        lesson_id="cats",
        group_key="g0",
        prompt_tokens=[BOS_ID, *TINY.encode(PROMPT).ids],
        response_tokens=response,
        response_logprobs=[-1.0] * len(response),
        token_rewards=[0.0] * len(response),
        response_loss_mask=[1] * len(response),
        episode_reward=reward,
        truncated=False,
        finish_reason="stop",
        temperature=1.0,
        policy_step=policy_step,
        worker_id="w0",
        timestamp=1.0,
    )


def _write_run(root: Path) -> None:
    """A small run: 5 learner steps, 2 rollout workers, 2 lessons, evals, drops, curriculum."""
    store = RunStore(str(root))
    store.put_json_if_absent(
        layout.RUN_CONFIG,
        {"config": {"model": {"name": "tiny-llama", "tokenizer": BUILTIN_TINY}, "train": {"num_train_steps": 5}}},
    )

    learner = MetricsWriter(store, "learner", "learner")
    bm = MetricsWriter(store, "batchmaker", "bm")
    workers = [MetricsWriter(store, "rollout", f"w{i}") for i in range(2)]
    for step in range(1, N_STEPS + 1):
        reward = 0.1 if step == 1 else (FINAL_REWARD if step == N_STEPS else 0.1 + 0.15 * step)
        learner.log(
            {
                "step": step,
                "loss": 1.0 / step,
                "tokens_per_s": 900.0 + step,
                "wait_s": 0.5,
                "train_s": 1.5,
                "kl": 0.01,
                "step_s": 2.0,
                "hops": {"learner_notice": 0.5, "train": 1.5},
            }
        )
        bm.log(
            {
                "slot": step,
                "mean_reward": reward,
                "reward/cats": reward,
                "reward/addition_easy": reward / 2,
                "staleness_min": 0,
                "staleness_mean": 0.5,
                "staleness_max": 1,
                "groups_used": 4,
                "groups_filtered_zero_variance": 1,
                "rows": 8,
                "padding_fraction": 0.1,
                "wait_s": 0.2,
            }
        )
        for i, w in enumerate(workers):
            w.log(
                {
                    "event": "write",
                    "policy_step": step - 1,
                    "lesson_id": LESSONS[i],
                    "mean_reward": reward,
                    "rollouts_per_s": 3.0 + i,
                    "tokens_per_s": 120.0,
                    "truncation_rate": 0.0,
                    "lag": 0,
                    "rows": 8,
                    "env/n_examples": 4.0,
                    "env/n_skipped_prompts": 1.0,
                    "env/n_retested_prompts": float(i),
                }
            )
    workers[1].log(samples_record(to_samples([_rollout_row(N_STEPS - 1, "r-old", 0.5)], TINY.decode), "f"))
    # A malformed record: missing and non-numeric fields must be skipped, not crash the report.
    learner.log({"step": "oops", "tokens_per_s": None})
    # Not a rollout write (no training data): left out of reward and throughput.
    workers[0].log({"event": "micro_eval", "lesson_id": "cats", "policy_step": 0, "mean_reward": 0.0123})
    for w in (learner, bm, *workers):
        w.flush()

    for policy_step in (0, 2, 4):
        rows = [
            EvalSummaryRow(
                policy_step=policy_step,
                lesson_id=lesson,
                eval_type="eval",
                n_examples=16,
                mean_reward=0.2 * policy_step / 4 + 0.1,
                success_rate=0.1 * policy_step / 4,
                mean_response_tokens=7.0,
                truncation_rate=0.0,
                temperature=1.0,
                source="policy",
                timestamp=1.0,
            )
            for lesson in LESSONS
        ]
        for row in rows:
            store.write_parquet(
                layout.eval_summary_file(policy_step, row.lesson_id), EVAL_SUMMARY.to_table([row]), EVAL_SUMMARY
            )
    baseline = dataclasses.replace(rows[0], policy_step=0, source="hf:base", mean_reward=0.05)
    store.write_parquet(
        layout.eval_summary_file(0, baseline.lesson_id, external="hf-base"),
        EVAL_SUMMARY.to_table([baseline]),
        EVAL_SUMMARY,
    )

    drops = {2: [("x1", "stale"), ("x2", "stale"), ("x3", "zero_variance")], 4: [("x4", "too_long")]}
    for step in range(1, N_STEPS + 1):
        attempt = f"a{step}"
        data_rel = layout.batch_data_file(step, attempt)
        ids = [f"r{step}-{j}" for j in range(4)]
        rows = [_batch_row(ids[:2]), _batch_row(ids[2:], no_signal=(1,))]  # r{step}-3 without signal
        store.write_parquet(data_rel, BATCH.to_table(rows), BATCH)
        dropped_rel = None
        if step in drops:
            dropped_rel = layout.dropped_file(step, attempt)
            store.write_parquet(dropped_rel, _dropped(step, drops[step]), DROPPED)
        put_log_entry(
            store, step, data_file=data_rel, attempt_id=attempt, ingested_files=["rollouts/x"], dropped_file=dropped_rel
        )
    # A losing attempt at slot 3 (named by no log entry): its drops do not count.
    store.write_parquet(layout.dropped_file(3, "lost"), _dropped(3, [("y1", "stale")]), DROPPED)

    # Rollout files: the samples of the latest policy come from the newest committed one (policy 4, sequence 2);
    # an uncommitted newer file (no ready marker) is not read.
    for policy_step, seq, reward in ((3, 0, 0.1), (4, 1, 0.2), (4, 2, 0.75)):
        rows = [_rollout_row(policy_step, f"w0-{seq}-{i}", reward) for i in range(2)]
        store.commit_data(layout.rollout_file(policy_step, "w0", seq), ROLLOUT.to_table(rows), ROLLOUT)
    store.write_parquet(layout.rollout_file(4, "w0", 3), ROLLOUT.to_table([_rollout_row(4, "u", 0.9)]), ROLLOUT)

    # Each state lists every event so far (schemas.curriculum); the newest one is the truth.
    unlock = {"step": 3, "lesson_id": "addition_easy", "from_status": "locked", "to_status": "active",
              "reason": "cats reached 0.8 >= 0.8"}  # fmt: skip
    store.put_json_if_absent(layout.curriculum_state(2), {"slot": 2, "events": []})
    store.put_json_if_absent(layout.curriculum_state(3), {"slot": 3, "events": [unlock]})
    store.put_json_if_absent(layout.curriculum_state(4), {"slot": 4, "events": [unlock]})
    store.put_unique(layout.curriculum_state(5), b"{not json")  # unreadable newest state: fall back, note it


def _section(page: str, title: str) -> str:
    """The HTML of one section (from its <h2> to the end of the section)."""
    m = re.search(rf"<h2>{re.escape(title)}</h2>(.*?)</section>", page, re.S)
    assert m, f"section {title!r} missing"
    return m.group(1)


def test_report_of_a_small_run(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _write_run(root)
    out = tmp_path / "out"
    index = report.build_report(str(root), str(out))
    assert Path(index) == out / "index.html"
    page = Path(index).read_text()

    for title in report.SECTION_TITLES:
        assert f"<h2>{title}</h2>" in page
    summary = _section(page, "Summary")
    assert report.fmt(FINAL_REWARD) in summary and "0.1" in summary
    assert page.index("<h2>Reward per lesson</h2>") < page.index("<h2>Summary</h2>")  # the curves lead
    config = _section(page, "Run config")
    assert page.rstrip().endswith(f"{config}</section>\n</body></html>")  # the folded config is last
    assert "<details><summary>" in config and "tiny-llama" in config
    assert "0.25" in summary  # learner idle fraction 0.5 / (0.5 + 1.5)
    # Every data section has data: no 'no data' note anywhere.
    assert "no data" not in page and "section failed" not in page

    embedded = [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]
    files = sorted((out / "plots").glob("*.png"))
    assert len(embedded) == len(files) >= 6
    for png in embedded + [f.read_bytes() for f in files]:
        assert png.startswith(PNG_MAGIC) and len(png) > 5_000

    evaluation = _section(page, "Evaluation")
    assert "baseline cats [hf-base]" in evaluation and "<td>external</td>" in evaluation
    fates = _section(page, "Rollout fates")
    assert "<td>used in batches</td><td>20</td>" in fates  # 5 slots x 4 distinct rollouts
    assert "<td>dropped: stale</td><td>2</td>" in fates  # the losing attempt's drop (y1) is not counted
    assert "<td>dropped: too_long</td><td>1</td>" in fates
    curriculum = _section(page, "Curriculum events")
    assert curriculum.count("locked -&gt; active") == 1 and "cats reached 0.8" in curriculum
    assert "curriculum/state-00000005.json is not valid JSON" in summary
    generated = 2 * N_STEPS * 8  # two workers' writes of 8 rows each
    assert f"<td>rollout rows generated</td><td>{generated}</td>" in summary
    assert f"<td>{report.sections.GENERATED_TRAINED_LABEL}</td><td>{report.fmt(20 / generated)}</td>" in summary
    # the fourth rollout of each slot's batch went in at advantage 0: used, but not with signal
    assert f"<td>{report.sections.GENERATED_SIGNAL_LABEL}</td><td>{report.fmt(15 / generated)}</td>" in summary
    # one draw of four passed over in each write: a skip rate of 1 / (1 + 4)
    assert f"<td>{report.sections.SKIP_RATE_LABEL}</td><td>{report.fmt(0.2)}</td>" in summary
    assert f"<td>{2 * N_STEPS} / {N_STEPS}</td>" in summary  # passed over / kept as re-tests (worker 1's)

    learner = _section(page, "Learner")
    for term in ("learner_loss", "learner_kl"):
        assert f'<img alt="{term}"' in learner
    assert "not in the learner records (not drawn): entropy, clip_fraction, ratio_mean, grad_norm" in learner
    samples = _section(page, "Sample completions")
    assert "step 4" in samples and "w0-00000002.parquet" in samples and "<td>0.75</td>" in samples
    assert f'<td class="text">{PROMPT}</td>' in samples
    assert html.escape(COMPLETION) in samples  # decoded exactly, whitespace kept
    assert "<td>4</td><td>cats</td>" in samples and "<td>0.5</td>" in samples  # the logged samples record
    fates_groups = report.load_run(str(root)).metrics["batchmaker"]
    assert all(r["groups_used"] == 4 for r in fates_groups)

    data = report.load_run(str(root))
    assert len(data.metrics["rollout"]) == 2 * N_STEPS  # the micro_eval event is not a write


def test_empty_run_root_says_no_data(tmp_path: Path) -> None:
    index = report.build_report(str(tmp_path / "missing-run"), str(tmp_path / "out"))
    page = Path(index).read_text()
    for title in report.SECTION_TITLES:
        assert f"<h2>{title}</h2>" in page
    assert page.count("no data") >= len(report.SECTION_TITLES) - 1
    assert "section failed" not in page and "data:image/png" not in page


def test_default_out_dir_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    store = RunStore(str(root))
    store.put_unique(layout.RUN_CONFIG, b"not json")
    w = MetricsWriter(store, "learner", "l")
    w.log({"step": 1, "wait_s": 1.0, "train_s": 3.0})
    w.flush()
    report.main([str(root)])
    printed = capsys.readouterr().out.strip()
    assert Path(printed) == root / "report" / "index.html"
    page = Path(printed).read_text()
    assert "run.json is not valid JSON" in page
    assert "idle fraction 0.25" in page
    assert report.default_out_dir("gs://bucket/runs/demo/") == "gs://bucket/runs/demo/report"


@pytest.mark.parametrize("backend", ["memory", "gs"])
def test_report_without_out_is_written_under_a_url_run_root(
    backend: str, store_factory: Callable[[str], RunStore], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """`make report RUN=gs://…` without `--out` uploads `<run root>/report/` (as the docs say), nothing in the
    working directory."""
    store = store_factory(backend)
    store.put_unique(layout.RUN_CONFIG, b"{}")
    w = MetricsWriter(store, "learner", "l")
    w.log({"step": 1, "wait_s": 1.0, "train_s": 3.0})
    w.flush()
    monkeypatch.chdir(tmp_path)
    report.main([store.url, "--store.storage_options", json.dumps(store.storage_options)])
    assert capsys.readouterr().out.strip() == f"{store.url}/report/index.html"
    assert "idle fraction 0.25" in store.get("report/index.html").decode()
    assert store.list("report/plots"), "no plot files under <run root>/report/plots"
    assert list(tmp_path.iterdir()) == []


def test_corrupt_eval_summary_is_skipped_with_a_note(tmp_path: Path) -> None:
    root = tmp_path / "run"
    store = RunStore(str(root))
    store.put_unique(layout.eval_summary_file(1, "cats"), b"PAR1 truncated")
    store.put_unique(
        layout.batch_log_entry(1), json.dumps({"data_file": "batches/data/step-00000001-z.parquet"}).encode()
    )
    page = Path(report.build_report(str(root), str(tmp_path / "out"))).read_text()
    assert "skipped evaluation summary evals/step-00000001/cats.summary.parquet" in page
    assert "section failed" not in page


@pytest.mark.parametrize("backend", ["memory", "gs"])
def test_report_of_a_url_run_root(backend: str, store_factory: Callable[[str], RunStore], tmp_path: Path) -> None:
    """A URL run root (gs:// on the emulator, memory://) is read through RunStore with its storage options."""
    store = store_factory(backend)
    w = MetricsWriter(store, "batchmaker", "bm")
    for slot, reward in ((1, 0.25), (2, 0.625)):
        # BatchMaker stats names (aliases of mean_reward and staleness_*).
        w.log({"slot": slot, "reward_mean": reward, "reward/cats": reward, "lag_min": 0, "lag_mean": 0.5, "lag_max": 1})
    w.flush()
    # No batch log entries name it: the dropped folder's listing is used.
    store.write_parquet(layout.dropped_file(1, "a"), _dropped(1, [("x1", "stale")]), DROPPED)
    index = report.build_report(store.url, str(tmp_path / "out"), storage_options=store.storage_options)
    page = Path(index).read_text()
    assert "<td>last mean reward (BatchMaker)</td><td>0.625</td>" in page
    assert "<td>dropped: stale</td><td>1</td>" in page
    assert '<img alt="staleness"' in _section(page, "Staleness")
