"""The figures the docs state come from one summary (docs/bench_summary.json) and cannot drift from it.

- docs/benchmarks.md's "Current figures" table is the summary's rendering on the date it states (a hand edit of the
  table, or a summary changed without `make docs`, fails);
- every figure the README states that the summary covers reads as the summary has it, and the README states no
  other percentage or ratio (goals named below), so a new `make bench` figure fails here until the README follows;
- a figure older than the summary's limit is marked stale in the table; a full `make bench` result and a GPU JSON
  set the figures they measured, a `--quick` one none.

All in-process, on the committed files and small dictionaries.
"""

from __future__ import annotations

import copy
import datetime as dt
import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from bench import figures
from bench.run_all import PARTS

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_GOALS = {"3×": "the demo's pass line: the last batch's reward ≥ 3× the first", "70%": "the decode goal"}
"""Percentages and ratios the README states that are goals, not measured figures (what each is)."""
FIGURE_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:–\d+(?:\.\d+)?)?(?:%|×)")


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def summary() -> dict[str, Any]:
    return figures.load()


def test_the_page_table_is_the_summarys_rendering(summary: dict[str, Any]) -> None:
    text = figures.PAGE.read_text()
    when = figures.rendered_date(text)
    assert when is not None, "docs/benchmarks.md has no rendered table between its markers"
    assert figures.render_page(text, summary, when) == text, "the figures table is stale or hand-edited: `make docs`"
    assert figures.main(["--check"]) == 0


def test_a_hand_edit_of_the_table_is_caught(summary: dict[str, Any]) -> None:
    text = figures.PAGE.read_text()
    when = figures.rendered_date(text)
    assert when is not None
    fig = figures.figures(summary)["storage_read_ratio"]
    row = f"| {figures.number(fig)}{fig['unit']} |"
    assert row in text
    edited = text.replace(row, "| 0.99× |", 1)
    assert figures.render_page(edited, summary, when) != edited
    changed = copy.deepcopy(summary)
    figures.figures(changed)["storage_read_ratio"]["value"] = 0.91
    assert figures.render_page(text, changed, when) != text


def test_every_readme_figure_equals_the_summary(summary: dict[str, Any]) -> None:
    readme = one_line(README.read_text())
    cited = {fid: str(figures.readme_text(f)) for fid, f in figures.figures(summary).items() if f.get("readme")}
    assert len(cited) >= 5, cited
    missing = {fid: text for fid, text in cited.items() if text not in readme}
    assert not missing, f"README lines that do not state docs/bench_summary.json's figure as it is now: {missing}"
    rest = readme
    for text in cited.values():
        rest = rest.replace(text, " ")
    uncovered = sorted(set(FIGURE_NUMBER.findall(rest)) - set(README_GOALS))
    assert not uncovered, f"README figures that no summary entry covers (add one with a `readme` template): {uncovered}"


def test_every_docs_figure_equals_the_summary(summary: dict[str, Any]) -> None:
    """A guide that states a measured figure names it in the summary (`docs` templates) and says it as it is now."""
    cited = {
        (fid, page): text for fid, f in figures.figures(summary).items() for page, text in figures.doc_texts(f).items()
    }
    assert cited, "no summary entry names a docs page"
    missing = {k: t for k, t in cited.items() if t not in one_line((REPO / k[1]).read_text())}
    assert not missing, f"docs lines that do not state docs/bench_summary.json's figure as it is now: {missing}"


def test_a_figure_older_than_the_limit_is_marked_stale(summary: dict[str, Any]) -> None:
    small = {"stale_after_days": 30, "cpu": copy.deepcopy(summary["cpu"][:2]), "gpu": []}
    old, new = small["cpu"]
    old["date"], new["date"] = "2026-01-01 10:00 UTC", "2026-02-20"
    table = figures.render_table(small, dt.date(2026, 3, 1))
    rows = [line for line in table.splitlines() if line.startswith(f"| {old['figure']}")]
    rows += [line for line in table.splitlines() if line.startswith(f"| {new['figure']}")]
    assert "2026-01-01 10:00 UTC **stale**" in rows[0]
    assert "**stale**" not in rows[1]
    assert figures.stale_ids(small, dt.date(2026, 3, 1)) == [old["id"]]
    assert figures.stale_ids(small, dt.date(2026, 1, 31)) == []


def test_every_figure_is_complete_and_its_command_works_as_typed(summary: dict[str, Any]) -> None:
    targets = set(re.findall(r"^([a-zA-Z_-]+):", (REPO / "Makefile").read_text(), re.M))
    ids = [f["id"] for g in figures.GROUPS for f in summary[g]]
    assert len(ids) == len(set(ids))
    for fig in figures.figures(summary).values():
        assert {"figure", "value", "unit", "command", "machine", "date", "source"} <= set(fig), fig["id"]
        figures.measured_on(fig)  # a date
        figures.number(fig)  # a value its format can write
        words = shlex.split(fig["command"])
        if words[0] == "make":
            assert words[1] in targets, fig["command"]
            only = [w.split("--only ")[1] for w in words[2:] if w.startswith("ARGS=--only ")]
            assert all(set(o.split(",")) <= set(PARTS) for o in only), fig["command"]
        elif words[0] == "bash":
            assert (REPO / words[1]).is_file(), fig["command"]
        else:
            assert words[:2] == [".venv/bin/python", "-m"], fig["command"]
            spec = importlib.util.find_spec(words[2])
            assert spec is not None and spec.origin, fig["command"]
            source = Path(spec.origin).read_text()
            assert all(f'"{w}"' in source for w in words[3:] if w.startswith("--")), fig["command"]


def test_a_full_run_sets_its_figures_and_a_quick_run_none(summary: dict[str, Any]) -> None:
    results = {
        "when": "2027-01-02 03:04 UTC",
        "machine": "test machine",
        "quick": False,
        "storage": {"write": {"ratio": 1.5}, "read": {"ratio": 0.95}},
        "startup": [
            {"step": "learn", "warm_s": 2.1},
            {"step": "rollout", "warm_s": 2.4},
            {"step": "learn (forked)", "warm_s": 0.6},
        ],
        "trl": [{"size": "50m", "system": "trl"}, {"size": "50m", "ratio": {"cpu_s_per_step": 1.2}}],
    }
    mine = copy.deepcopy(summary)
    assert figures.record_run(mine, {**results, "quick": True}, "x.json") == []
    done = figures.record_run(mine, results, "runs/bench/x.json")
    startup = ["startup_fresh_warm_s", "startup_forked_warm_s"]
    assert sorted(done) == sorted(["storage_write_ratio", "storage_read_ratio", *startup, "trl_50m_cpu_ratio"])
    by = figures.figures(mine)
    assert by["startup_fresh_warm_s"]["value"] == 2.4 and by["startup_forked_warm_s"]["value"] == 0.6
    assert by["trl_50m_cpu_ratio"]["value"] == 1.2
    assert str(figures.readme_text(by["trl_50m_cpu_ratio"])).startswith("1.20×")
    assert by["storage_read_ratio"]["date"] == "2027-01-02 03:04 UTC"
    assert by["storage_read_ratio"]["machine"] == "test machine"
    assert by["e2e_steps_per_min"] == figures.figures(summary)["e2e_steps_per_min"]  # not measured: left as it was
    # figures of a part that ran but gave no value (e.g. a reward never reached) are named: their stored values
    # come from an earlier run; parts that did not run are not
    missing = figures.unmeasured(results)
    assert "trl_50m_steps_ratio_f32" in missing and "trl_50m_cpu_ratio" not in missing
    assert not any(f.startswith(("storage_", "startup_", "e2e_")) for f in missing)
    assert figures.unmeasured({**results, "quick": True}) == []


def test_the_trl_figures_name_their_pairing_of_settings(summary: dict[str, Any]) -> None:
    """`bench.bench_trl` compares every rlpipe publish dtype with every TRL OpenMP setting (`ratios`); each TRL
    figure takes its own pairing, whatever the rows' order."""

    def rlpipe(dtype: str, passive: float, pytorch: float, **lag: int) -> dict[str, Any]:
        ratios = {"PASSIVE": {"cpu_s_per_step": passive}, "pytorch": {"cpu_s_per_step": pytorch}}
        ratios["PASSIVE"]["steps_to_0.5"] = passive / 2
        row = {"size": "50m", "system": "rlpipe", "publish_dtype": dtype, "ratios": ratios, **lag}
        return {**row, "ratio": ratios["PASSIVE"]}

    trl = [{"size": "50m", "system": "trl", "omp_wait_policy": p} for p in ("PASSIVE", "pytorch")]
    results = {
        "when": "2027-01-02 03:04 UTC",
        "machine": "m",
        # the on-policy run (max_lag 0) first: the default-lag figures must not take it
        "trl": [
            *trl,
            rlpipe("bfloat16", 0.8, 0.7, max_lag=0),
            rlpipe("float32", 1.4, 1.3),
            rlpipe("bfloat16", 1.2, 1.1),
        ],
    }
    mine = copy.deepcopy(summary)
    figures.record_run(mine, results, "x.json")
    by = figures.figures(mine)
    assert by["trl_50m_cpu_ratio"]["value"] == 1.2
    assert by["trl_50m_cpu_ratio_bf16_pytorch"]["value"] == 1.1
    assert by["trl_50m_cpu_ratio_f32_passive"]["value"] == 1.4
    assert by["trl_50m_cpu_ratio_f32_pytorch"]["value"] == 1.3
    assert by["trl_50m_half_steps_ratio_bf16"]["value"] == 0.6
    assert by["trl_50m_cpu_ratio_onpolicy"]["value"] == 0.8
    assert by["trl_50m_half_steps_ratio_onpolicy"]["value"] == 0.4


def test_a_gpu_json_sets_the_gpu_figures(summary: dict[str, Any]) -> None:
    result = {
        "date": "2027-01-02 03:04 UTC",
        "device": "NVIDIA Test (gpu) x1",
        "rows": [
            {"shape": "1b", "rl_runs": [{"rl_mfu": 0.35}, {"rl_mfu": 0.41}],
             "decode": {"runs": [{"variant": "fast", "batch": 128, "decode_roofline_ratio": 0.55},
                                 {"variant": "legacy", "batch": 128, "decode_roofline_ratio": 0.45}]}},
        ],
    }  # fmt: skip
    mine = copy.deepcopy(summary)
    done = figures.record_gpu_run(mine, result, "gpu.json")
    assert sorted(done) == ["gpu_decode_step_roofline_b128", "gpu_learner_mfu_1b"]
    by = figures.figures(mine)
    assert by["gpu_learner_mfu_1b"]["value"] == 41.0 and by["gpu_decode_step_roofline_b128"]["value"] == 55.0
    assert by["gpu_learner_mfu_1b"]["machine"] == "NVIDIA Test (gpu) x1"
