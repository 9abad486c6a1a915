"""`make bench`: every CPU benchmark in one run, then one summary table of ratios and absolute figures.

Each part runs in its own process (so one part's memory and JIT caches do not colour the next) and writes
JSON; this program prints each part's own table as it finishes, then the summary:

- storage: RunStore commit/read of rollout files vs raw pyarrow on the same tables (goal >= 0.9);
- BatchMaker: >= 200k synthetic rollouts, unpacked and packed, vs raw pyarrow read+write of the same
  bytes (goal >= 0.7), and memory at 1/4 and at the end of the files (bounded by the window);
- learner: tokens/s of a levanter train step, tiny and ~50M-parameter models;
- rollout: generation tokens/s, our dense sampler vs levanter's InferenceEngine (the peer), both sizes;
- continuous: the dense sampler's continuous vs static batching on long-tailed completion lengths (tokens/s, goal
  >= 2x) and on equal lengths (goal >= 0.95x), and prefill work with shared group prefixes at n = 8 (goal <= 1/4)
  (`bench.bench_continuous`);
- per-step latency: the demo job's per-hop breakdown and wall seconds per learner step (goal <= 0.2 s), and the same
  at TRL's cats setting (`bench.bench_latency --trl_setting`: mean / median per learner step from step 3, hops);
- retention: run-root bytes of a 100-step tiny cats job with retention off and on (`bench.bench_retention`);
- end to end: the demo job (`configs/demo_cats.yaml`) on a fresh run root: learner steps/min, fraction of
  learner wall time spent waiting for batches, rollouts/s, reward at the first and last batch;
- startup: each step's start (process start -> ready to work), cold and warm (goal <= 3 s);
- scale: N = 10, 100, 1,000 simulated rollout workers, the real BatchMaker and a stub learner on local disk and
  the GCS emulator: storage requests and latency per batch slot (`bench.bench_scale`, docs/scale.md);
- publish: publish-to-readable latency of 50/200/800 MB policies, 1 and 2 learner processes writing their own
  shards, local disk and the GCS emulator (`bench.bench_publish`, docs/scale.md);
- verifiers: the same single-turn task as a verifiers lesson (as configured by default: the chat program in
  process; with the warm harness pool; one step with a process per episode) and as an rlpipe environment class on
  the same sampler: rows/s ratio (goal <= 2) and the per-episode overhead in CPU seconds (`bench.bench_verifiers`);
- rows_trained: the share of generated rollout rows trained on (distinct rows in batches / rows generated) of the
  demo job (run here 5 times, pooled; once with `--quick`) and of the recipe's run root `runs/basic_arithmetic`
  when `make recipe` left one (`bench.bench_rows_trained`);
- trl: rlpipe vs TRL's GRPOTrainer on the cats task at the tiny and ~50M sizes (needs `trl` and CPU torch, the
  `bench` dependency group that `make bench` installs; `--skip_trl` leaves it out);
- train_step: the learner's jitted train step alone against PyTorch's on the same ~50M Llama and batch, CPU s per
  step, split into forward, backward and optimizer (`bench.bench_train_step`; needs CPU torch, left out with
  `--skip_trl`).

    python -m bench.run_all                      # everything (~15-25 min on 2 cores)
    python -m bench.run_all --quick              # smaller sizes, for a smoke check (~5 min)
    python -m bench.run_all --only storage,e2e   # some parts
Results: `<out>/bench-<time>.json` (default out: runs/bench). A full run (not `--quick`) also sets the figures it
measured in docs/bench_summary.json and renders docs/benchmarks.md's table from it (`bench.figures`; `--summary ''`
leaves both alone).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import figures
from bench.common import machine_name

logger = logging.getLogger("rlpipe.bench")

PARTS = (
    "storage",
    "batchmaker",
    "learner",
    "learner_mesh",
    "rollout",
    "continuous",
    "e2e",
    "startup",
    "trl",
    "train_step",
    "latency",
    "retention",
    "scale",
    "publish",
    "verifiers",
    "rows_trained",
)


def _run(cmd: list[str], timeout_s: float) -> float:
    """Run a benchmark process with its output shown; raise if it fails. Returns its wall seconds."""
    logger.info("$ %s", " ".join(cmd))
    t0 = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, check=True, timeout=timeout_s, env=env)
    return time.perf_counter() - t0


def part_storage(tmp: Path, quick: bool) -> dict[str, Any]:
    out = tmp / "storage.json"
    rows = "5000" if quick else "20000"
    _run([sys.executable, "-m", "bench.bench_storage", "--rows", rows, "--repeats", "3", "--json", str(out)], 1800)
    res = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    fig = {}
    for op in ("write", "read"):
        raw = res[f"{op} raw pyarrow (default snappy)"]
        ours = res[f"{op} RunStore commit_data/read_committed"]
        fig[op] = {"ours_mb_s": ours["mb_s"], "raw_mb_s": raw["mb_s"], "ratio": raw["seconds"] / ours["seconds"]}
    return fig


def part_batchmaker(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    out = tmp / "batchmaker.json"
    n = "25600" if quick else "204800"
    cmd = [sys.executable, "-m", "bench.bench_batch_maker", "--rollouts", n, "--both", "--repeats", "2"]
    _run([*cmd, "--tmp", str(tmp), "--json", str(out)], 3600)
    return list(json.loads(out.read_text()))


def part_learner(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    out = tmp / "learner.json"
    sizes = "tiny" if quick else "tiny,50m"
    _run([sys.executable, "-m", "bench.bench_learner", "--sizes", sizes, "--steps", "3", "--json", str(out)], 3600)
    return list(json.loads(out.read_text())["rows"])


def part_learner_mesh(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    out = tmp / "learner_mesh.json"
    _run([sys.executable, "-m", "bench.bench_learner_mesh", "--devices", "1,4", "--json", str(out)], 1800)
    return list(json.loads(out.read_text())["rows"])


def part_rollout(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    out = tmp / "rollout.json"
    sizes = "tiny" if quick else "tiny,50m"
    cmd = [sys.executable, "-m", "bench.bench_rollout", "--sizes", sizes, "--backends", "dense,levanter"]
    _run([*cmd, "--json", str(out)], 3600)
    return list(json.loads(out.read_text())["rows"])


def part_continuous(tmp: Path, quick: bool) -> dict[str, Any]:
    out = tmp / "continuous.json"
    prompts = "16" if quick else "64"
    _run([sys.executable, "-m", "bench.bench_continuous", "--prompts", prompts, "--json", str(out)], 3600)
    return dict(json.loads(out.read_text()))


def part_startup(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    out = tmp / "startup.json"
    _run([sys.executable, "-m", "bench.bench_startup", "--starts", "2" if quick else "3", "--json", str(out)], 3600)
    return list(json.loads(out.read_text())["rows"])


def part_trl(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    out = tmp / "trl.json"
    cmd = [sys.executable, "-m", "bench.bench_trl", "--sizes", "tiny" if quick else "tiny,50m"]
    _run([*cmd, "--steps", "20" if quick else "50", "--steps_50m", "10", "--json", str(out)], 7200)
    return list(json.loads(out.read_text())["rows"])


def part_train_step(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    out = tmp / "train_step.json"
    _run([sys.executable, "-m", "bench.bench_train_step", "--steps", "4" if quick else "12", "--json", str(out)], 1800)
    return list(json.loads(out.read_text()))


def e2e_figures(run_root: str, wall_s: float) -> dict[str, Any]:
    """Learner steps/min, learner waiting fraction, rollouts/s and reward from a finished run's metrics."""
    from pipeline.report import load_run

    data = load_run(run_root)
    learner = sorted(
        (r for r in data.metrics.get("learner", []) if "step" in r and "train_s" in r), key=lambda r: r["step"]
    )
    writes = [r for r in data.metrics.get("rollout", []) if r.get("event") == "write"]
    bm = sorted((r for r in data.metrics.get("batchmaker", []) if "mean_reward" in r), key=lambda r: r["slot"])
    if not learner or not writes:
        raise RuntimeError(f"{run_root}: no learner or rollout metrics; did the job run?")
    wait = sum(float(r.get("wait_s", 0.0)) for r in learner)
    train = sum(float(r["train_s"]) for r in learner)
    # Steady state: from the end of the first step (which includes JIT compilation) to the last step.
    span = learner[-1]["time"] - learner[0]["time"]
    steps_per_min = 60.0 * (len(learner) - 1) / span if len(learner) > 1 and span > 0 else None
    t_first = min(r["time"] for r in writes)
    t_last = max(r["time"] for r in writes)
    rows = sum(float(r.get("rows", 0.0)) for r in writes)
    return {
        "wall_s": wall_s,
        "learner_steps": len(learner),
        "learner_steps_per_min": steps_per_min,
        "learner_wait_fraction": wait / (wait + train) if wait + train > 0 else None,
        "learner_wait_fraction_after_first_step": (
            sum(float(r.get("wait_s", 0.0)) for r in learner[1:])
            / max(1e-9, sum(float(r.get("wait_s", 0.0)) + float(r["train_s"]) for r in learner[1:]))
            if len(learner) > 1
            else None
        ),
        "rollouts": rows,
        "rollouts_per_s": rows / (t_last - t_first) if t_last > t_first else None,
        "first_batch_reward": bm[0]["mean_reward"] if bm else None,
        "last_batch_reward": bm[-1]["mean_reward"] if bm else None,
    }


def part_e2e(tmp: Path, quick: bool) -> dict[str, Any]:
    config = "configs/test_cats.yaml" if quick else "configs/demo_cats.yaml"
    run_root = str(tmp / "e2e-run")
    wall = _run([sys.executable, "-m", "steps.run", "--config_path", config, "--run_root", run_root], 3600)
    figs = e2e_figures(run_root, wall)
    figs["config"] = config
    return figs


def part_rows_trained(tmp: Path, quick: bool) -> dict[str, Any]:
    out = tmp / "rows_trained.json"
    cmd = [sys.executable, "-m", "bench.bench_rows_trained", "--json", str(out),
           *(["--quick", "--demo_runs", "1"] if quick else [])]  # fmt: skip
    _run(cmd, 1800)
    return dict(json.loads(out.read_text()))


def part_latency(tmp: Path, quick: bool) -> dict[str, Any]:
    out = tmp / "latency.json"
    config = "configs/test_cats.yaml" if quick else "configs/demo_cats.yaml"
    _run([sys.executable, "-m", "bench.bench_latency", "--config", config, "--json", str(out)], 3600)
    figs = dict(json.loads(out.read_text()))
    # the same breakdown at TRL's cats setting (the TRL comparison's tiny rlpipe run), steady state from step 3
    trl_out = tmp / "latency-trl.json"
    cmd = [sys.executable, "-m", "bench.bench_latency", "--trl_setting", "--json", str(trl_out)]
    _run([*cmd, *(["--steps", "10"] if quick else [])], 3600)
    figs["trl_setting"] = json.loads(trl_out.read_text())
    return figs


def part_retention(tmp: Path, quick: bool) -> dict[str, Any]:
    out = tmp / "retention.json"
    steps = "30" if quick else "100"
    _run([sys.executable, "-m", "bench.bench_retention", "--steps", steps, "--json", str(out)], 3600)
    return dict(json.loads(out.read_text()))


def part_scale(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    out = tmp / "scale.json"
    cmd = [sys.executable, "-m", "bench.bench_scale", "--workers", "10,100" if quick else "10,100,1000"]
    _run([*cmd, "--json", str(out)], 900)
    return list(json.loads(out.read_text())["rows"])


def part_publish(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    out = tmp / "publish.json"
    cmd = [sys.executable, "-m", "bench.bench_publish", "--sizes_mb", "50" if quick else "50,200,800"]
    _run([*cmd, "--json", str(out)], 3000)
    return list(json.loads(out.read_text())["rows"])


def part_verifiers(tmp: Path, quick: bool) -> dict[str, Any]:
    out = tmp / "verifiers.json"
    cmd = [sys.executable, "-m", "bench.bench_verifiers", "--steps", "2" if quick else "3"]
    _run([*cmd, "--per_episode_steps", "0" if quick else "1", "--json", str(out)], 900)
    result = dict(json.loads(out.read_text()))
    # the same lesson beside a ~50M sampler: what the environments cost next to a small real model's sampling
    _run([*cmd, "--size", "50m", "--pool_steps", "0", "--per_episode_steps", "0", "--json", str(out)], 900)
    result["at_50m"] = json.loads(out.read_text())
    return result


def _f(x: Any, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


Row = tuple[str, str, str, str, str]
"""(figure, ours, reference, ratio, goal)": one row of the summary table."""


def _rows_storage(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `storage` part (none when it did not run)."""
    rows: list[Row] = []
    st = results.get("storage")
    if st:
        for op in ("write", "read"):
            f = st[op]
            rows.append(
                (
                    f"storage {op} (rollout files)",
                    f"{f['ours_mb_s']:.0f} MB/s",
                    f"raw pyarrow {f['raw_mb_s']:.0f} MB/s",
                    f"{f['ratio']:.2f}",
                    ">= 0.9",
                )
            )
    return rows


def _rows_batchmaker(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `batchmaker` part (none when it did not run)."""
    rows: list[Row] = []
    for r in results.get("batchmaker") or []:
        rows.append(
            (
                f"BatchMaker {r['mode']} ({r['rollouts']:,} rollouts)",
                f"{r['pipeline_rollouts_per_s']:,} rollouts/s",
                f"raw I/O same bytes {r['raw_same_bytes_rollouts_per_s']:,}/s",
                f"{r['ratio_pipeline_to_raw_same_bytes']:.2f}",
                ">= 0.7",
            )
        )
        q, e = r["memory"].get("quarter", {}), r["memory"].get("end", {})
        rows.append(
            (
                f"BatchMaker {r['mode']} memory (arrays peak)",
                f"{e.get('batchmaker_arrays_peak_mib', 0):.0f} MiB at end",
                f"{q.get('batchmaker_arrays_peak_mib', 0):.0f} MiB at 1/4 of files",
                f"{e.get('batchmaker_arrays_peak_mib', 0) / max(q.get('batchmaker_arrays_peak_mib', 0), 1e-9):.2f}",
                "~1 (bounded)",
            )
        )
    return rows


def _rows_learner(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `learner` part (none when it did not run)."""
    rows: list[Row] = []
    for r in results.get("learner") or []:
        rows.append(
            (
                f"learner train step, {r['model']} ({r['params'] / 1e6:.1f}M params)",
                f"{r['tokens_per_s']:,.0f} tokens/s",
                f"batch {r['batch']}",
                "-",
                "-",
            )
        )
    return rows


def _rows_learner_mesh(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `learner_mesh` part (none when it did not run)."""
    rows: list[Row] = []
    mesh_rows = results.get("learner_mesh") or []
    for r in mesh_rows:
        rows.append(
            (
                f"learner on {r['devices']} simulated CPU device(s), FSDP",
                f"{r['tokens_per_s']:,.0f} tokens/s",
                f"1 device: {mesh_rows[0]['tokens_per_s']:,.0f} tokens/s",
                f"{r['tokens_per_s'] / mesh_rows[0]['tokens_per_s']:.2f}",
                "same loss (correct scaling; simulated devices share the cores)",
            )
        )
    return rows


def _rows_rollout(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `rollout` part (none when it did not run)."""
    rows: list[Row] = []
    ro = results.get("rollout") or []
    by = {(r["size"], r["backend"]): r for r in ro}
    for size in dict.fromkeys(r["size"] for r in ro):
        dense, lev = by.get((size, "dense")), by.get((size, "levanter"))
        if dense and lev:
            rows.append(
                (
                    f"rollout generation, {size} ({dense['params'] / 1e6:.1f}M params)",
                    f"dense {dense['tokens_per_s']:,.0f} tokens/s",
                    f"levanter engine {lev['tokens_per_s']:,.0f} tokens/s",
                    f"{dense['tokens_per_s'] / lev['tokens_per_s']:.2f}",
                    "> 1 (vs peer)",
                )
            )
    return rows


def _rows_continuous(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `continuous` part (none when it did not run)."""
    c = results.get("continuous")
    if not c:
        return []
    w = c["workload"]
    return [
        (
            f"continuous batching, {w['prompts']}x{w['n']} geometric lengths mean {w['mean']} cap {w['max_len']}",
            f"{c['continuous']['tokens_per_s']:,.0f} tokens/s",
            f"static {c['static']['tokens_per_s']:,.0f} tokens/s",
            f"{c['speedup']:.2f}",
            ">= 2",
        ),
        *(
            [
                (
                    f"continuous batching, the same {w['prompts']}x{w['n']} samples at equal lengths {w['mean']}",
                    f"{c['equal']['continuous']['tokens_per_s']:,.0f} tokens/s",
                    f"static {c['equal']['static']['tokens_per_s']:,.0f} tokens/s",
                    f"{c['equal']['speedup']:.2f}",
                    ">= 0.95",
                )
            ]
            if "equal" in c
            else []
        ),
        (
            f"prefill tokens, shared group prefixes (n = {w['n']})",
            f"{c['continuous']['prefill_tokens']:,}",
            f"static {c['static']['prefill_tokens']:,}",
            f"{c['prefill_ratio']:.3f}",
            "<= 0.25",
        ),
    ]


def _rows_e2e(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `e2e` part (none when it did not run)."""
    rows: list[Row] = []
    e = results.get("e2e")
    if e:
        rows.append(
            (
                f"end to end ({e['config']}): learner",
                f"{_f(e['learner_steps_per_min'])} steps/min",
                f"{e['learner_steps']} steps in {e['wall_s']:.0f} s",
                "-",
                "-",
            )
        )
        rows.append(
            (
                "end to end: learner waiting for batches",
                f"{_f(e['learner_wait_fraction'], '.2f')} of time",
                f"{_f(e['learner_wait_fraction_after_first_step'], '.2f')} after step 1",
                "-",
                "-",
            )
        )
        rows.append(
            ("end to end: rollouts", f"{_f(e['rollouts_per_s'])} rollouts/s", f"{e['rollouts']:.0f} rollouts", "-", "-")
        )
        rows.append(
            (
                "end to end: batch mean reward",
                f"{_f(e['last_batch_reward'], '.2f')} last",
                f"{_f(e['first_batch_reward'], '.2f')} first",
                "-",
                "-",
            )
        )
    return rows


def _rows_rows_trained(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `rows_trained` part (none when it did not run; a row saying so when no recipe run)."""
    r = results.get("rows_trained")
    if not r:
        return []
    rows: list[Row] = []
    for name, label in (("demo", "demo job"), ("recipe", "recipe (runs/basic_arithmetic)")):
        fig = r.get(name)
        if fig is None:
            rows.append((f"generated rows trained, {label}", "not measured", "no finished run", "-", ">= 70%"))
            continue
        goal = ">= 80%" if name == "demo" else ">= 70%"
        runs = fig.get("runs") or []
        spread = f", {len(runs)} runs {min(runs):.0%}-{max(runs):.0%}" if len(runs) > 1 else ""
        rows.append((f"generated rows trained, {label}", f"{fig['fraction']:.1%}",
                     f"{fig['trained']:,} of {fig['generated']:,} rows{spread}", "-", goal))  # fmt: skip
        if fig.get("trained_with_signal") is not None:
            rows.append((f"generated rows trained with signal (advantage != 0), {label}",
                         f"{fig['trained_with_signal'] / fig['generated']:.1%}",
                         f"{fig['trained_with_signal']:,} of {fig['generated']:,} rows", "-", "-"))  # fmt: skip
    return rows


def _rows_startup(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `startup` part (none when it did not run)."""
    rows: list[Row] = []
    for r in results.get("startup") or []:
        rows.append(
            (f"step start: {r['step']}", f"{r['warm_s']:.2f} s warm", f"{r['cold_s']:.2f} s cold", "-", "<= 3 s")
        )
    return rows


def _rows_trl(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `trl` part (none when it did not run)."""
    rows: list[Row] = []
    trl_goals = {"steps_to_3x_start": "<= 1", "steps_to_0.5": "<= 1"}
    for r in results.get("trl") or []:
        if "ratio" not in r:
            continue
        trl = next(t for t in results["trl"] if t["size"] == r["size"] and t["system"] == "trl")
        # `ratio` is against the size's first TRL run; `bench.bench_trl` prints every pairing of settings
        lag = " max_lag 0" if r.get("max_lag") == 0 else ""
        mine = f"rlpipe {r['publish_dtype']}{lag}"
        setting = f" ({mine}, TRL omp={trl['omp_wait_policy']})" if "publish_dtype" in r else ""
        for key, label in (
            ("steps_to_3x_start", "learner steps to 3x start reward"),
            ("steps_to_0.5", "learner steps to reward 0.5"),
            ("s_per_step", "wall s per learner step"),
            ("s_to_3x_start", "wall s to 3x start reward"),
            ("s_to_0.5", "wall s to reward 0.5"),
            ("peak_rss_mib", "peak memory MiB"),
            ("cpu_s_per_step", "CPU s per learner step (process tree, whole run)"),
            ("cpu_s_per_step_steady", "CPU s per learner step (process tree, third step to last)"),
        ):
            rows.append(
                (
                    f"vs TRL, {r['size']}{setting}: {label}",
                    _f(r.get(key)),
                    f"TRL {_f(trl.get(key))}",
                    _f(r["ratio"].get(key), ".2f"),
                    trl_goals.get(key)
                    or {
                        ("tiny", "s_per_step"): "<= 0.2 s abs",
                        ("50m", "s_per_step"): "<= 0.5",
                        ("50m", "cpu_s_per_step"): "<= 1.5",
                    }.get((r["size"], key), "-"),
                )
            )
    return rows


def _rows_train_step(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `train_step` part (none when it did not run)."""
    runs = [r for r in results.get("train_step") or [] if "error" not in r]
    ours = next((r for r in runs if r["system"] == "rlpipe" and not r.get("xla_flags")), None)
    torch = next((r for r in runs if r["system"] == "pytorch"), None)
    if not ours or not torch:
        return []
    rows: list[Row] = []
    for key, label in (("train_step", "whole step"), ("forward", "forward"), ("optimizer", "optimizer + clip")):
        rows.append((f"train step alone, ~50M, 16 x 25 tokens: CPU s, {label}", _f(ours[key]),
                     f"PyTorch {_f(torch[key])}", _f(ours[key] / torch[key], ".2f"), "-"))  # fmt: skip
    bwd = ours["forward_backward"] - ours["forward"]
    rows.append(("train step alone, ~50M, 16 x 25 tokens: CPU s, backward", _f(bwd),
                 f"PyTorch {_f(torch['backward'])}", _f(bwd / torch["backward"], ".2f"), "-"))  # fmt: skip
    return rows


def _rows_latency(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `latency` part (none when it did not run)."""
    rows: list[Row] = []
    lat = results.get("latency")
    if lat:
        top = sorted(lat["hops_median_s"].items(), key=lambda kv: -kv[1])[:3]
        rows.append(
            (
                f"per-step latency ({lat['config']}): wall s/learner step",
                f"{_f(lat['steady_s_per_step'])} s",
                "median hops " + ", ".join(f"{h} {_f(s)}" for h, s in top),
                "-",
                "<= 0.2 s",
            )
        )
    trl = (lat or {}).get("trl_setting")
    if trl:
        top = sorted(trl["hops_mean_s"].items(), key=lambda kv: -kv[1])[:4]
        rows.append(
            (
                "per-step latency at TRL's cats setting: wall s/learner step, steady (step 3 on) mean / median",
                f"{_f(trl['steady_s_per_step'])} / {_f(trl['steady_median_step_s'])} s "
                f"(load {'->'.join(map(str, trl.get('load_avg') or []))})",
                "mean hops " + ", ".join(f"{h} {_f(s)}" for h, s in top),
                "-",
                "<= 0.2 s",
            )
        )
    return rows


def _rows_retention(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `retention` part (none when it did not run)."""
    rows: list[Row] = []
    rt = results.get("retention")
    if rt:
        off, on = (r["bytes"]["total"] for r in rt["rows"])
        rows.append(
            (
                f"run root bytes after {rt['steps']} steps, retention on",
                f"{on / 2**20:.1f} MiB",
                f"retention off {off / 2**20:.1f} MiB",
                f"{rt['ratio_on_to_off']:.2f}",
                "< 1",
            )
        )
    return rows


def _rows_scale(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `scale` part: per backend, BatchMaker requests and latency per slot at the largest N
    against the smallest (`bench.bench_scale`; goal: within 2x)."""
    rows: list[Row] = []
    sc = results.get("scale") or []
    for backend in dict.fromkeys(r["backend"] for r in sc):
        mine = sorted((r for r in sc if r["backend"] == backend), key=lambda r: r["workers"])
        lo, hi = mine[0], mine[-1]
        rows.append(
            (
                f"scale sim, {backend}: BatchMaker requests/slot at N={hi['workers']}",
                f"{hi['bm_ops_total_per_slot']:.0f}",
                f"N={lo['workers']}: {lo['bm_ops_total_per_slot']:.0f}",
                f"{hi['bm_ops_total_per_slot'] / max(lo['bm_ops_total_per_slot'], 1e-9):.2f}",
                "<= 2",
            )
        )
        a, b = lo.get("slot_latency_p50_s"), hi.get("slot_latency_p50_s")
        rows.append(
            (
                f"scale sim, {backend}: slot latency p50 at N={hi['workers']}",
                f"{_f(b)} s",
                f"N={lo['workers']}: {_f(a)} s",
                _f(b / a, ".2f") if a and b else "-",
                "<= 2",
            )
        )
    return rows


def _rows_publish(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `publish` part: per backend, publish-to-readable of the largest policy with 2 writer
    processes against 1 (`bench.bench_publish`, docs/scale.md)."""
    rows: list[Row] = []
    pub = [r for r in results.get("publish") or [] if r["mode"] == "parallel"]
    for backend in dict.fromkeys(r["backend"] for r in pub):
        by_w: dict[int, dict[str, Any]] = {}
        for r in pub:  # the largest policy of each writer count (sizes differ a little: rows split evenly)
            if r["backend"] == backend and r["size_mb"] >= by_w.get(r["writers"], {}).get("size_mb", 0):
                by_w[r["writers"]] = r
        big = max((r["size_mb"] for r in by_w.values()), default=0)
        if 1 in by_w and 2 in by_w:
            a, b = by_w[1]["total_s"], by_w[2]["total_s"]
            rows.append((f"policy publish-to-readable, {backend}, {big:.0f} MB, 2 writers", f"{b:.2f} s",
                         f"1 writer: {a:.2f} s", f"{b / a:.2f}", "< 1 (more bandwidth)"))  # fmt: skip
    return rows


def _rows_verifiers(results: dict[str, Any]) -> list[Row]:
    """Summary rows of the `verifiers` part: the verifiers lesson's rows/s against the rlpipe environment class's on
    the same task and sampler, as configured by default (the chat program in process), with the harness pool and
    (when measured) a process per episode."""
    v = results.get("verifiers")
    if not v:
        return []
    rows: list[Row] = []
    variants = (("verifiers", "in process"), ("verifiers_pool", "harness pool"),
                ("verifiers_per_episode", "a process per episode"))  # fmt: skip
    sized = [(v, key, label) for key, label in variants]
    if v.get("at_50m"):
        sized.append((v["at_50m"], "verifiers", "in process, ~50M sampler"))
    for at, key, label in sized:
        base, m = at["rlpipe"], at.get(key)
        if m:
            rows.append((f"verifiers lesson ({label}), {at['episodes_per_step']} episodes/step",
                         f"{_f(m['rows_per_s'])} rows/s, {m['overhead_cpu_s_per_episode']:.3f} CPU s/episode extra",
                         f"rlpipe env class {_f(base['rows_per_s'])} rows/s", _f(m["ratio"], ".1f"),
                         "<= 2" if key == "verifiers" else "-"))  # fmt: skip
    return rows


def summary_rows(results: dict[str, Any]) -> list[Row]:
    """(figure, ours, reference, ratio, goal) rows for whatever parts ran."""
    builders = (
        _rows_storage,
        _rows_batchmaker,
        _rows_learner,
        _rows_learner_mesh,
        _rows_rollout,
        _rows_continuous,
        _rows_e2e,
        _rows_startup,
        _rows_trl,
        _rows_train_step,
        _rows_latency,
        _rows_retention,
        _rows_scale,
        _rows_publish,
        _rows_verifiers,
        _rows_rows_trained,
    )
    return [row for build in builders for row in build(results)]


def print_summary(results: dict[str, Any]) -> None:
    rows = summary_rows(results)
    head = ("figure", "ours", "reference", "ratio", "goal")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(5)]
    print(f"\nrlpipe bench summary  {results['when']}  machine: {results['machine']}")
    print(f"python {platform.python_version()}, {results['versions']}")
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    print("ratio: ours / reference measured in this run (storage, BatchMaker: time of raw / time of ours).")


def _versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{p} {version(p)}" for p in ("pyarrow", "jax", "levanter", "haliax"))


def record_figures(results: dict[str, Any], path: Path, summary_path: Path) -> None:
    """Set the figures this run measured in the committed summary and render docs/benchmarks.md's table from it (a
    `--quick` run sets none). The README's lines that cite a changed figure then fail tests/test_bench_figures.py
    until they are updated: a stated figure is refreshed or flagged, never silently old."""
    summary = figures.load(summary_path)
    done = figures.record_run(summary, results, str(path))
    missing = figures.unmeasured(results)
    if missing:  # kept from an earlier run: a label saying "same run" would no longer hold
        print(f"figures: not measured by this run though their part ran, left from earlier runs: {', '.join(missing)}")
    if not done:
        print(f"figures: none updated in {summary_path} (quick run, or no part measured one)")
        return
    figures.save(summary, summary_path)
    if summary_path == figures.SUMMARY:
        figures.write_page(summary, dt.datetime.now(dt.UTC).date())
    print(f"figures updated in {summary_path}: {', '.join(done)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke check, not the stated goals)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    ap.add_argument("--out", default="runs/bench", help="folder for the results JSON")
    ap.add_argument("--skip_trl", action="store_true", help="leave out the TRL comparison (no bench env)")
    ap.add_argument("--summary", default=str(figures.SUMMARY), help="figures summary to update ('': none)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parts = [p for p in args.only.split(",") if p and not (args.skip_trl and p in ("trl", "train_step"))]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--only: unknown part(s) {bad}; choose from {PARTS}")
    results: dict[str, Any] = {
        "when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_name(),
        "node": platform.node(),
        "versions": _versions(),
        "quick": args.quick,
    }
    funcs = {
        "storage": part_storage,
        "batchmaker": part_batchmaker,
        "learner": part_learner,
        "learner_mesh": part_learner_mesh,
        "rollout": part_rollout,
        "continuous": part_continuous,
        "e2e": part_e2e,
        "startup": part_startup,
        "trl": part_trl,
        "train_step": part_train_step,
        "latency": part_latency,
        "retention": part_retention,
        "scale": part_scale,
        "publish": part_publish,
        "verifiers": part_verifiers,
        "rows_trained": part_rows_trained,
    }
    tmp = Path(tempfile.mkdtemp(prefix="rlpipe-bench-"))
    failed = []
    try:
        for p in parts:
            try:
                results[p] = funcs[p](tmp, args.quick)
            except (subprocess.SubprocessError, RuntimeError, OSError, KeyError) as e:
                logger.error("bench part %s failed: %s", p, e)
                failed.append(p)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    print_summary(results)
    print(f"results: {path}")
    if args.summary:
        record_figures(results, path, Path(args.summary))
    if failed:
        print(f"FAILED parts: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
