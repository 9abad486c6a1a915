"""rlpipe vs TRL's GRPOTrainer on the cats task, side by side, at two model sizes.

Same task (the cats prompts, reward `min(count("cat"), 4) / 4`), same model shape (a Llama built from one
config: layers, width, heads, vocabulary of the `builtin:tiny` tokenizer), same batch (4 prompts x 4 samples =
16 completions of at most 16 tokens, temperature 1), learning rate 1e-3 (constant, no warm-up), KL 0, gradient
clip 1.0, same number of learner steps. The runs of one size alternate between the systems (TRL first at the first
size, rlpipe first at the next), each in a fresh process tree.

Differences that cannot be removed: TRL trains a PyTorch `LlamaForCausalLM` (random init from torch's seed),
rlpipe a levanter Llama (random init from JAX's key), so the starting policies differ; TRL's GRPO uses the
group-normalised advantage and its own loss aggregation, rlpipe the job's `rloo` loss module; rlpipe runs
asynchronously (a batch may come from the previous policy, `max_lag: 1`), TRL synchronously. rlpipe's batch rows
are as long as the longest prompt plus 16 tokens (`seq_len_for_task`: TRL pads each batch to its longest prompt +
completion, so neither trains on more positions). rlpipe's zero-variance filter is off here
(`train.filter_zero_variance false`): like TRL, it trains on the 16 rows it generated for a step, groups without
reward variance included (their advantages are 0). With the demo's filter on, a slot waits for 16 rows with
signal, so once the reward saturates every learner step needs several generated files (at ~50M: 38 files for 10
steps in a run that reached reward 1.0 by step 4, 20 in one that did not), and the per-step time measured the
learning curve as much as the pipeline.

Per size: learner steps to 3x the start reward and to 0.5 (start = mean of the first 3 steps; a milestone is
the first step whose 5-step trailing mean reaches it), wall seconds per learner step at steady state
(median of step-to-step intervals after the first 3 steps; of all intervals in a run of 4 steps or fewer),
wall time to each milestone from process start, peak memory (RSS summed over the run's process tree, sampled
every 0.2 s), CPU seconds per learner step and the ratio rlpipe / TRL of each. CPU per learner step comes twice:
over the whole run (user + system of the whole process tree, start-up and compilation included, from the reaped
tree's rusage, divided by the steps: the load-independent cost of a step, as the goal counts it) and at steady
state (the tree's CPU between the third learner step and the last, divided by the steps between them); both are
also split by process (runner, fork server, learner, BatchMaker, rollout workers, evaluator: `bench.common.
TreeCpu`). Without `trl`, rlpipe's CPU is compared with TRL's last recorded figure (`TRL_RECORDED_CPU_S_PER_STEP`),
and the printout says so; with `trl` the ratios printed are the ones measured in this run (TRL's CPU per step
grows with the machine's load far more than rlpipe's: compare runs at the same load). At steady state rlpipe's CPU
is also split by phase (`rlpipe_phases`: the learner's train steps and batch reads, the rollout workers' sampling
and file writes, cut at the times their metrics records give; the rest of each process, i.e. the learner's publishing
and the workers' policy loads, and the other processes).

Settings, each run once in the same invocation at the sizes of `--every_setting` (default ~50M; the tiny size runs
only the first of each, to keep the part short): TRL with `OMP_WAIT_POLICY=PASSIVE` and with PyTorch's default
(`pytorch`: OMP_WAIT_POLICY unset, its OpenMP threads spin while they wait; `TRL_OMP_WAIT_POLICIES`,
`--trl_omp_wait_policy`), rlpipe publishing its policies in bfloat16 and in float32, the job's default on CPU
(`PUBLISH_DTYPES`, `--publish_dtype`); every rlpipe run is compared with every TRL run of its size (`ratios`), the
first pairing also as `ratio`; and rlpipe once more on-policy (`train.max_lag 0`, bfloat16: `ONPOLICY_DTYPE`,
`--onpolicy_dtype`), as TRL's synchronous step samples with the policy it trains. rlpipe runs without its evaluator
(`evaluator: false`): TRL evaluates nothing, and both systems' rewards are read from their training batches.

    python -m bench.bench_trl --sizes tiny,50m --steps 50 --steps_50m 10 --json out.json [--work_dir DIR]
    python -m bench.bench_trl --sizes 50m --publish_dtype bfloat16 --trl_omp_wait_policy PASSIVE --onpolicy_dtype ''
TRL runs in the interpreter named by --trl_python (default: this one); without `trl` there, the TRL column is
skipped with a note.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import TreeCpu, machine_name

# name -> (hidden, intermediate, layers, heads, kv heads)
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (64, 192, 4, 4, 2),
    "50m": (640, 1728, 10, 10, 5),
}
PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, MAX_TOKENS, LR = 4, 4, 16, 1e-3
PUBLISH_DTYPE = "bfloat16"
"""rlpipe publishes its policies in bfloat16 here (`model.publish_dtype`; the job's default on an accelerator, float32
on CPU): half the bytes serialised, hashed, written, read and laid out for the sampler per learner step (measured at
~50M: 1.1 -> 0.55 CPU s per publish + load alone; 4.67 -> 4.23 CPU s per learner step at steady state in the bench,
2026-11-26). The sampler still computes in float32 on weights rounded to bfloat16: its logprobs differ from the
learner's float32 ones by 0.007 nats per token on average (max 0.03, random init at ~50M), two orders of magnitude
below the one-step policy lag of these runs (`mismatch_abs_logp` 1.1-1.7). `--publish_dtype float32` measures
the job's CPU default."""
ONPOLICY_TAG = "+onpolicy"
"""How `compare` names the on-policy run's setting internally (after its publish dtype)."""
PUBLISH_DTYPES = ("bfloat16", "float32")
"""The publish dtypes rlpipe runs with at the sizes of `--every_setting` (`--publish_dtype`): bfloat16, and the
job's CPU default float32; the first is the only one at the other sizes and the one `ratio` and the recorded
figures name first."""
ONPOLICY_DTYPE = "bfloat16"
"""At the sizes of `--every_setting` rlpipe also runs once on-policy (`train.max_lag 0`, publishing in this dtype;
`--onpolicy_dtype ''` leaves it out): TRL's GRPO step samples with the policy it then trains, rlpipe's job by
default trains on rows one policy old (`max_lag: 1`) while the next ones are sampled. Measured at ~50M (AMD EPYC
2-core VM, 2026-11-30, three runs each): reward 0.5 reached at learner step 3, 4, 4 on-policy against 6, 8 and
once not within the 10 steps with the default lag (TRL: 8), for the same CPU (27.7 against 27.2 CPU s over the job)
and about 1 s more wall time."""
ROLLOUT_WORKERS = {"tiny": 2, "50m": 1}
"""rlpipe's rollout workers per size: at ~50M one worker's sampler already uses both cores of the 2-core machine,
and a second one only races it for them (and for the same rows, which then go stale)."""


def seq_len_for_task() -> int:
    """rlpipe's batch row length: the longest cats prompt as rlpipe's rollouts encode it (BOS first,
    `encode_prompt`) plus MAX_TOKENS, what TRL trains on per sequence (it pads each batch to its longest prompt +
    completion; its prompts carry no BOS, so rlpipe's rows are one token longer); longer rows would only add
    padding, shorter ones would cut the longest prompt's completions (`train.overlong: truncate`)."""
    from pipeline.environments.base import encode_prompt
    from pipeline.environments.cats import TRAIN_PROMPTS
    from pipeline.environments.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    return max(len(encode_prompt(tok, p)) for p in TRAIN_PROMPTS) + MAX_TOKENS


# ----------------------------------------------------------------------------------------------- TRL (child)
def trl_child(size: str, steps: int, out: str, t_start: float) -> None:
    """Train with TRL's GRPOTrainer; write per-step (step, reward, seconds since t_start) to `out`."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.environments.cats import TRAIN_PROMPTS, count_cats
    from pipeline.environments.tokenizer import build_tiny_tokenizer

    torch.manual_seed(0)
    tok = build_tiny_tokenizer()
    hidden, inter, layers, heads, kv = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    n_prompts = max(steps * PROMPTS_PER_STEP, len(TRAIN_PROMPTS))
    data = Dataset.from_dict({"prompt": [TRAIN_PROMPTS[i % len(TRAIN_PROMPTS)] for i in range(n_prompts)]})

    def reward(completions: list[str], **_: Any) -> list[float | None]:  # TRL's reward-function type
        return [min(count_cats(c), 4) / 4 for c in completions]

    rows: list[dict[str, float]] = []

    class Record(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                rows.append({"step": state.global_step, "reward": logs["reward"], "t": time.time() - t_start})

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES_PER_PROMPT,
        num_generations=SAMPLES_PER_PROMPT, max_completion_length=MAX_TOKENS, temperature=1.0, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, beta=0.0, max_grad_norm=1.0, max_steps=steps, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, seed=0, bf16=False, disable_tqdm=True,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
    trainer.add_callback(Record())
    trainer.train()
    params = sum(p.numel() for p in model.parameters())
    Path(out).write_text(json.dumps({"rows": rows, "params": params}))


# ------------------------------------------------------------------------------------------------ harness
def _spawn(cmd: list[str], timeout_s: float, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run cmd to its end: its wall seconds, start time (epoch), peak RSS of its tree (bytes), the tree's exact CPU
    seconds (`cpu_s`: the child's rusage once reaped, its reaped descendants included), the sampled per-process
    monitor (`tree`: a `TreeCpu`) and the machine's 1-minute load average at its start and end (`load`)."""
    import resource

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.update(extra_env or {})
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env)
    mon = TreeCpu(proc.pid)
    try:
        rc = proc.wait(timeout=timeout_s)
    finally:
        peak = mon.stop()
        if proc.poll() is None:
            proc.kill()
    if rc != 0:
        raise RuntimeError(f"{cmd[:4]} exited with {rc}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    load = [round(load0, 2), round(os.getloadavg()[0], 2)]
    return {"wall_s": time.time() - t0, "t0": t0, "peak": peak, "cpu_s": cpu, "tree": mon, "load": load}


def cpu_breakdown(tree: TreeCpu, cpu_s: float, step_times: list[float], steps: int) -> dict[str, Any]:
    """CPU per learner step of a run: whole run (`cpu_s` / `steps`, start-up and compilation included), per process
    role over the whole run, and at steady state: CPU between the third learner step and the last (epoch times
    `step_times`, ascending) divided by the steps in between, in total and per role. Steady-state figures are None
    for a run of fewer than 4 steps."""
    whole = {role: round(v, 2) for role, v in sorted(tree.by_role().items())}
    out: dict[str, Any] = {
        "cpu_s": cpu_s,
        "cpu_s_per_step": cpu_s / max(steps, 1),
        "cpu_s_by_process": whole,
        "cpu_s_per_step_steady": None,
        "cpu_s_per_step_steady_by_process": None,
    }
    if len(step_times) >= 4:
        a, b = tree.cpu_at(step_times[2]), tree.cpu_at(step_times[-1])
        n = len(step_times) - 3
        per = {role: round((b.get(role, 0.0) - a.get(role, 0.0)) / n, 3) for role in sorted(b)}
        out["cpu_s_per_step_steady"] = sum(per.values())
        out["cpu_s_per_step_steady_by_process"] = per
        out["steady_steps"] = n
    return out


def _overlap(a: float, b: float, intervals: list[tuple[float, float]]) -> float:
    """Seconds of (a, b] inside the union of `intervals` (sorted by start, not overlapping one another)."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in intervals if hi > a and lo < b)


def cpu_by_phase(
    tree: TreeCpu, lo: float, hi: float, steps: int, phases: dict[str, list[tuple[str, list[tuple[float, float]]]]]
) -> dict[str, float]:
    """CPU seconds per learner step between epoch times `lo` and `hi` (cut at the same samples as `cpu_at`) split by
    phase: a process of role R in `phases` gives each named phase its CPU inside that phase's intervals (a sample
    period's CPU shared in proportion to the time inside) and `R: other` the rest; a process of any other role
    gives its CPU to its role. Where phases of one role overlap in time, the one listed first takes the CPU."""
    samples = [(t, cpu) for t, cpu in tree.samples if t <= hi]
    first = max((i for i, (t, _) in enumerate(samples) if t <= lo), default=0)
    out: dict[str, float] = {}
    for (ta, ca), (tb, cb) in itertools.pairwise(samples[first:]):
        for pid, c in cb.items():
            delta = c - ca.get(pid, 0.0)
            role = tree.roles.get(pid, "other")
            left = delta
            for name, intervals in phases.get(role, []):
                share = delta * _overlap(ta, tb, intervals) / max(tb - ta, 1e-9)
                share = min(share, left) if delta >= 0 else share  # phases that overlap: the first listed has it
                out[name] = out.get(name, 0.0) + share
                left -= share
            key = f"{role}: other" if role in phases else role
            out[key] = out.get(key, 0.0) + left
    return {k: round(v / max(steps, 1), 3) for k, v in sorted(out.items())}


def rlpipe_phases(metrics: dict[str, list[dict[str, Any]]]) -> dict[str, list[tuple[str, list[tuple[float, float]]]]]:
    """The phases of an rlpipe run's learner and rollout processes, as intervals of epoch time from their metrics
    records: the learner's jitted train steps (`train_started_at` -> `trained_at`) and batch reads (the batch
    noticed -> its train step started); the rollout workers' sampling (`generate_started_at` -> `generated_at`: the
    sampler's calls and scoring) and rollout-file writes (-> `rollout_committed_at`). What is left of a process is
    its `other`: the learner's publishing (on its publisher thread, while it waits for the next batch) and waits, the
    worker's policy loads (read, crc32c, sampler layout) and pacing. With several rollout workers (the tiny size's
    two) their intervals are pooled: one worker's CPU while another samples counts as sampling."""

    def spans(rows: list[dict[str, Any]], a: str, b: str) -> list[tuple[float, float]]:
        """The union of the rows' intervals (several workers' overlap: no second a worker's CPU is counted twice)."""
        out: list[tuple[float, float]] = []
        for lo, hi in sorted((float(r[a]), float(r[b])) for r in rows if a in r and b in r):
            if out and lo <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], hi))
            else:
                out.append((lo, hi))
        return out

    learner = [r for r in metrics.get("learner", []) if "train_s" in r]
    writes = [r for r in metrics.get("rollout", []) if r.get("event") == "write"]
    return {
        "learner": [
            ("learner: train step", spans(learner, "train_started_at", "trained_at")),
            ("learner: batch read", spans(learner, "learner_noticed_at", "train_started_at")),
        ],
        "rollout": [
            ("rollout: sampling", spans(writes, "generate_started_at", "generated_at")),
            ("rollout: write", spans(writes, "generated_at", "rollout_committed_at")),
        ],
    }


TRL_OMP_WAIT_POLICY = "PASSIVE"
"""The bench's OMP_WAIT_POLICY for TRL (`--trl_omp_wait_policy`): PyTorch's OpenMP threads otherwise spin while they
wait, and on a loaded machine that spin, not TRL's work, sets its CPU per step. rlpipe's processes do not spin
while they wait (measured 2026-11-26: the learner's XLA threads 0.03 CPU s per 0.5 s wait for a batch, the rollout
worker 0.11 cores while idle; docs/benchmarks.md "rlpipe vs TRL"), so with PASSIVE the bench compares two systems
whose idle threads sleep."""
TRL_OMP_WAIT_POLICIES = (TRL_OMP_WAIT_POLICY, "pytorch")
"""TRL's OpenMP waiting at the sizes of `--every_setting` (`--trl_omp_wait_policy`): PASSIVE, and PyTorch's default
(`pytorch`: OMP_WAIT_POLICY unset, its threads spin); the first is the only one at the other sizes."""


def run_trl(python: str, size: str, steps: int, tmp: Path, omp_wait_policy: str | None = None) -> dict[str, Any]:
    """TRL's run at `size` (`trl_child` in a fresh process); `omp_wait_policy` sets its `OMP_WAIT_POLICY` (None:
    PyTorch's default, whose OpenMP threads spin while they wait: on a loaded machine that multiplies TRL's CPU per
    step, 18.2 against 4.0 CPU s with `PASSIVE` at ~50M, load 5-7, 2026-11-26)."""
    out = tmp / f"trl-{size}-{omp_wait_policy or 'pytorch'}.json"
    cmd = [python, "-m", "bench.bench_trl", "--trl_child", size, "--steps", str(steps), "--child_out", str(out)]
    # TRL needs transformers' PyTorch classes: USE_TORCH=0 (set for step processes) must not reach it.
    t_start = time.time()
    env = {"USE_TORCH": "1", **({"OMP_WAIT_POLICY": omp_wait_policy} if omp_wait_policy else {})}
    run = _spawn([*cmd, "--t_start", repr(t_start)], 3600, env)
    res = json.loads(out.read_text())
    times = sorted(t_start + r["t"] for r in res["rows"])
    return {
        "rows": res["rows"], "params": res["params"], "wall_s": run["wall_s"], "peak_rss_mib": run["peak"] / 2**20,
        "load_avg": run["load"], **cpu_breakdown(run["tree"], run["cpu_s"], times, steps),
    }  # fmt: skip


def rlpipe_overrides(size: str, steps: int, run_root: str) -> list[str]:
    hidden, inter, layers, heads, kv = SIZES[size]
    return [
        "--config_path", "configs/demo_cats.yaml", "--run_root", run_root,
        "--model.hidden_dim", str(hidden), "--model.intermediate_dim", str(inter), "--model.num_layers", str(layers),
        "--model.num_heads", str(heads), "--model.num_kv_heads", str(kv),
        "--train.num_train_steps", str(steps), "--train.batch_size", str(PROMPTS_PER_STEP * SAMPLES_PER_PROMPT),
        "--optimizer.learning_rate", str(LR),
        "--curriculum.default_sampling.n_prompts", str(PROMPTS_PER_STEP),
        "--curriculum.default_sampling.n_generations_per_prompt", str(SAMPLES_PER_PROMPT),
        "--curriculum.default_sampling.max_tokens", str(MAX_TOKENS),
        "--cadence.checkpoint_interval", str(max(steps, 1)), "--curriculum.eval_frequency", str(10 * steps),
        "--train.seq_len", str(seq_len_for_task()), "--num_rollout_workers", str(ROLLOUT_WORKERS[size]),
        "--train.filter_zero_variance", "false",
        # No evaluator: TRL evaluates nothing, and the rewards compared are the batches' own. The job's evaluator
        # would score policy 0 and the final policy on held-out prompts (`eval_frequency` beyond the run still
        # leaves those two): at ~50M ~20 CPU s of a 10-step run, work TRL's run does not have.
        "--evaluator", "false",
    ]  # fmt: skip


def run_rlpipe(size: str, steps: int, tmp: Path, extra: list[str] | None = None, tag: str = "") -> dict[str, Any]:
    """The rlpipe job at `size` for `steps` learner steps (`rlpipe_overrides`, then the overrides `extra`), its run
    root `rlpipe-<size>[-<tag>]` under `tmp`. At steady state its CPU is also split by phase (`rlpipe_phases`)."""
    from pipeline.report import load_run

    run_root = str(tmp / "-".join(["rlpipe", size, *([tag] if tag else [])]))
    run = _spawn([sys.executable, "-m", "steps.run", *rlpipe_overrides(size, steps, run_root), *(extra or [])], 3600)
    t0 = run["t0"]
    data = load_run(run_root)
    learner = {int(r["step"]): r for r in data.metrics.get("learner", []) if "step" in r and "train_s" in r}
    rewards = {
        int(r["slot"]): float(r["mean_reward"]) for r in data.metrics.get("batchmaker", []) if "mean_reward" in r
    }
    rows = [
        {"step": s, "reward": rewards[s], "t": float(learner[s]["time"]) - t0} for s in sorted(learner) if s in rewards
    ]
    times = sorted(float(learner[s]["time"]) for s in learner)
    cpu = cpu_breakdown(run["tree"], run["cpu_s"], times, steps)
    if cpu.get("steady_steps"):
        phases = rlpipe_phases(data.metrics)
        cpu["cpu_s_per_step_steady_by_phase"] = cpu_by_phase(
            run["tree"], times[2], times[-1], cpu["steady_steps"], phases
        )
    return {
        "rows": rows, "wall_s": run["wall_s"], "peak_rss_mib": run["peak"] / 2**20, "load_avg": run["load"], **cpu,
    }  # fmt: skip


def milestones(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Steps and seconds to 3x start reward and to 0.5, and the steady-state seconds per learner step."""
    rows = sorted(rows, key=lambda r: r["step"])
    rewards = [r["reward"] for r in rows]
    start = statistics.mean(rewards[:3]) if rewards else float("nan")
    out: dict[str, Any] = {"start_reward": start, "end_reward": statistics.mean(rewards[-5:]) if rewards else None}
    for name, target in (("3x_start", 3 * start), ("0.5", 0.5)):
        hit = next((i for i in range(len(rows)) if statistics.mean(rewards[max(0, i - 4) : i + 1]) >= target), None)
        out[f"steps_to_{name}"] = None if hit is None else int(rows[hit]["step"])
        out[f"s_to_{name}"] = None if hit is None else rows[hit]["t"]
    steady = rows[3:] if len(rows) > 4 else rows  # a short smoke run has no steady state: all intervals
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(steady)]
    out["s_per_step"] = statistics.median(gaps) if gaps else None
    return out


def _trl_available(python: str) -> bool:
    probe = subprocess.run(
        [python, "-c", "import trl, torch"], capture_output=True, env={**os.environ, "USE_TORCH": "1"}
    )
    return probe.returncode == 0


RATIO_KEYS = (
    "steps_to_3x_start", "steps_to_0.5", "s_per_step", "s_to_3x_start", "s_to_0.5", "peak_rss_mib", "cpu_s_per_step",
    "cpu_s_per_step_steady",
)  # fmt: skip
"""The figures compared as rlpipe / TRL."""


def _ratios(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    return {k: (mine[k] / theirs[k] if mine.get(k) and theirs.get(k) else None) for k in RATIO_KEYS}


def compare(
    sizes: list[str],
    steps: dict[str, int],
    trl_python: str,
    work_dir: str | None = None,
    rlpipe_extra: list[str] | None = None,
    trl_omp_wait_policy: str | None = TRL_OMP_WAIT_POLICY,
    publish_dtypes: list[str] | None = None,
    omp_policies: list[str | None] | None = None,
    every_setting: tuple[str, ...] = ("50m",),
    onpolicy_dtype: str | None = None,
) -> list[dict[str, Any]]:
    """One row per (size, system, setting), with milestones, memory and CPU; each rlpipe row also has rlpipe / TRL
    for every TRL run of its size (`ratios`: TRL's `OMP_WAIT_POLICY`, `pytorch` for PyTorch's default, -> figure ->
    ratio; `ratio`: against the first TRL setting), measured in this run when `trl` imports, else `vs_recorded_trl`
    (rlpipe's CPU against TRL's recorded figure).

    Settings: rlpipe runs once per publish dtype of `publish_dtypes` (default `[PUBLISH_DTYPE]`), TRL once per
    `OMP_WAIT_POLICY` of `omp_policies` (None: PyTorch's default; default `[trl_omp_wait_policy]`), at the sizes of
    `every_setting`; at the other sizes only the first of each; with `onpolicy_dtype`, one more rlpipe run there,
    on-policy (`train.max_lag 0`) publishing in that dtype (`ONPOLICY_DTYPE`). The runs of a size alternate between
    the systems (TRL first at the first size, rlpipe first at the next, ...). `rlpipe_extra`: overrides appended to
    rlpipe's job command line after the dtype's. The runs' files (rlpipe's run roots, with their step logs) go to
    `work_dir` when given (kept), else to a temporary folder (removed)."""
    dtypes = publish_dtypes or [PUBLISH_DTYPE]
    policies = omp_policies or [trl_omp_wait_policy]
    have_trl = _trl_available(trl_python)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rlpipe-trl-") as d:
        tmp = Path(work_dir or d)
        tmp.mkdir(parents=True, exist_ok=True)
        for i, size in enumerate(sizes):
            every = size in every_setting
            trl_runs = [("trl", p) for p in (policies if every else policies[:1])] if have_trl else []
            rl_runs = [("rlpipe", dt) for dt in (dtypes if every else dtypes[:1])]
            if every and onpolicy_dtype:
                rl_runs.append(("rlpipe", f"{onpolicy_dtype}{ONPOLICY_TAG}"))
            first, second = (trl_runs, rl_runs) if i % 2 == 0 else (rl_runs, trl_runs)
            order = [r for pair in itertools.zip_longest(first, second) for r in pair if r is not None]
            got: list[dict[str, Any]] = []
            for system, setting in order:
                if system == "trl":
                    res = run_trl(trl_python, size, steps[size], tmp, setting)
                    label = {"omp_wait_policy": setting or "pytorch"}
                else:
                    dtype, onpolicy = str(setting).removesuffix(ONPOLICY_TAG), str(setting).endswith(ONPOLICY_TAG)
                    lag = ["--train.max_lag", "0"] if onpolicy else []
                    extra = ["--model.publish_dtype", dtype, *lag, *(rlpipe_extra or [])]
                    res = run_rlpipe(size, steps[size], tmp, extra, tag=str(setting).replace("+", "-"))
                    label = {"publish_dtype": dtype, **({"max_lag": 0} if onpolicy else {})}
                got.append({
                    "size": size, "system": system, **label, "steps": steps[size], **milestones(res["rows"]),
                    "wall_s": res["wall_s"], "peak_rss_mib": res["peak_rss_mib"], "load_avg": res["load_avg"],
                    **{k: v for k, v in res.items() if k.startswith("cpu_s")},
                    "rewards": [round(r["reward"], 4) for r in sorted(res["rows"], key=lambda r: r["step"])],
                })  # fmt: skip
            trls = [r for r in got if r["system"] == "trl"]
            # TRL's rows first, each system's in its settings' order: `ratio` is against TRL's first setting
            for row in sorted(got, key=lambda r: (r["system"] != "trl", order.index((r["system"], _setting(r))))):
                if row["system"] == "rlpipe" and trls:
                    row["ratios"] = {t["omp_wait_policy"]: _ratios(row, t) for t in trls}
                    row["ratio"] = row["ratios"][trls[0]["omp_wait_policy"]]
                elif row["system"] == "rlpipe" and TRL_RECORDED_CPU_S_PER_STEP.get(size, (None,))[0] == steps[size]:
                    _, recorded, where = TRL_RECORDED_CPU_S_PER_STEP[size]
                    row["vs_recorded_trl"] = {
                        "trl_cpu_s_per_step": recorded, "source": where,
                        "cpu_s_per_step": row["cpu_s_per_step"] / recorded,
                        "cpu_s_per_step_steady": (row["cpu_s_per_step_steady"] or 0) / recorded or None,
                    }  # fmt: skip
                results.append(row)
            if not have_trl:
                print(f"note: `trl` not importable by {trl_python}; TRL column skipped", file=sys.stderr)
    return results


def _setting(row: dict[str, Any]) -> str | None:
    """The setting a row was run with, as `compare` lists it (TRL's OMP_WAIT_POLICY, None for PyTorch's; rlpipe's
    publish dtype, `ONPOLICY_TAG` after it for the on-policy run)."""
    if row["system"] == "trl":
        return None if row["omp_wait_policy"] == "pytorch" else str(row["omp_wait_policy"])
    return str(row["publish_dtype"]) + (ONPOLICY_TAG if row.get("max_lag") == 0 else "")


TRL_RECORDED_CPU_S_PER_STEP: dict[str, tuple[int, float, str]] = {
    "tiny": (50, 0.36, "docs/benchmarks.md, TRL 1.16, 2026-11-25 01:11-01:13 UTC, 2-core VM, load 1.4-1.9"),
    "50m": (10, 2.92, "docs/benchmarks.md, TRL 1.16, 2026-11-25 01:11-01:13 UTC, 2-core VM, load 1.4-1.9 (2.96, 2.87)"),
}
"""size -> (learner steps of that run, TRL's CPU seconds per learner step over it, where it was recorded): what rlpipe
is compared with when `trl` cannot be imported here, for a run of the same steps only (start-up is part of the
whole-run figure); the comparison then says so. A TRL steady-state figure was not recorded."""


def _f(x: Any, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _name(row: dict[str, Any]) -> str:
    """A row's system and setting, as the table prints them."""
    if row["system"] == "trl":
        return f"TRL omp={row.get('omp_wait_policy', '-')}"
    return f"rlpipe {row.get('publish_dtype', '-')}" + (" lag 0" if row.get("max_lag") == 0 else "")


def print_table(rows: list[dict[str, Any]], machine: str) -> None:
    print(f"\nrlpipe vs TRL GRPOTrainer, cats task, machine: {machine}")
    cols = (
        "steps_to_3x_start", "steps_to_0.5", "s_per_step", "s_to_3x_start", "s_to_0.5", "peak_rss_mib",
        "cpu_s_per_step",
    )  # fmt: skip
    head = ["size", "system", "steps", "start", "end", *cols]
    print("  ".join(f"{h:>17}" for h in head))
    for r in rows:
        vals = [
            r["size"],
            _name(r),
            r["steps"],
            _f(r["start_reward"]),
            _f(r["end_reward"]),
            *(_f(r.get(c)) for c in cols),
        ]
        print("  ".join(f"{v!s:>17}" for v in vals))
        for omp, ratio in (r.get("ratios") or {}).items():
            rat = ["", f"/ TRL omp={omp}", "", "", "", *(_f(ratio[c], ".2f") for c in cols)]
            print("  ".join(f"{v!s:>17}" for v in rat))
    print("\nrlpipe / TRL per pairing: CPU s per learner step, whole run (start-up and compilation included) | steady")
    print("state (third step to last); learner steps to 3x start reward")
    for r in rows:
        for omp, ratio in (r.get("ratios") or {}).items():
            steps_trl = _trl_row(rows, r["size"], omp).get("steps_to_3x_start")
            print(
                f"  {r['size']:>5} {_name(r):>16} / TRL omp={omp:<8}: CPU {_f(ratio.get('cpu_s_per_step'), '.2f')}"
                f" | {_f(ratio.get('cpu_s_per_step_steady'), '.2f')}   steps to 3x"
                f" {_f(ratio.get('steps_to_3x_start'), '.2f')} ({_f(r.get('steps_to_3x_start'))} vs {_f(steps_trl)})"
            )
    print("\nCPU s per learner step: whole run | steady state (third step to last)")
    for r in rows:
        line = (
            f"  {r['size']:>5} {_name(r):>16}: {_f(r.get('cpu_s_per_step'))} | {_f(r.get('cpu_s_per_step_steady'))}"
            f"   (load average {'→'.join(map(str, r.get('load_avg') or []))})"
        )
        if "vs_recorded_trl" in r:
            v = r["vs_recorded_trl"]
            line += (f"   vs TRL's recorded {v['trl_cpu_s_per_step']} (TRL not run here; {v['source']}): "
                     f"{_f(v['cpu_s_per_step'], '.2f')} | {_f(v['cpu_s_per_step_steady'], '.2f')} "
                     "(steady against TRL's whole run: a lower bound)")  # fmt: skip
        print(line)
        whole, steady = r.get("cpu_s_by_process") or {}, r.get("cpu_s_per_step_steady_by_process") or {}
        for role in sorted(set(whole) | set(steady), key=lambda k: -whole.get(k, 0.0)):
            print(f"      {role:>12}: {_f(whole.get(role))} CPU s whole run | {_f(steady.get(role))} per step steady")
        phases = r.get("cpu_s_per_step_steady_by_phase") or {}
        if phases:
            print("      by phase, CPU s per step at steady state:")
            for name, v in sorted(phases.items(), key=lambda kv: -kv[1]):
                print(f"      {name:>36}: {_f(v)}")


def _trl_row(rows: list[dict[str, Any]], size: str, omp: str) -> dict[str, Any]:
    return next((r for r in rows if r["size"] == size and r.get("omp_wait_policy") == omp), {})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,50m")
    ap.add_argument("--steps", type=int, default=50, help="learner steps for the tiny size (both systems)")
    ap.add_argument("--steps_50m", type=int, default=10, help="learner steps for the 50m size (both systems)")
    ap.add_argument("--trl_python", default=os.environ.get("TRL_PYTHON", sys.executable))
    ap.add_argument("--json", default=None)
    ap.add_argument("--work_dir", default=None, help="keep the runs' files (rlpipe run roots, step logs) here")
    ap.add_argument(
        "--publish_dtype",
        default=",".join(PUBLISH_DTYPES),
        help="rlpipe's model.publish_dtype, one run each, comma-separated, of auto, float32, bfloat16 (default "
        "%(default)s; the job's own default on CPU is float32); at sizes not in --every_setting only the first",
    )
    ap.add_argument(
        "--trl_omp_wait_policy",
        default=",".join(TRL_OMP_WAIT_POLICIES),
        help="OMP_WAIT_POLICY for TRL's process, one run each, comma-separated, of PASSIVE (idle threads sleep, as "
        "rlpipe's do), ACTIVE, pytorch (PyTorch's own, spinning) (default %(default)s); at sizes not in "
        "--every_setting only the first",
    )
    ap.add_argument(
        "--onpolicy_dtype",
        default=ONPOLICY_DTYPE,
        help="publish dtype of one more rlpipe run, on-policy (train.max_lag 0), at the --every_setting sizes "
        "(default %(default)s; '' for none)",
    )
    ap.add_argument(
        "--every_setting",
        default="50m",
        help="sizes that run every --publish_dtype and --trl_omp_wait_policy (default %(default)s; '' for none)",
    )
    ap.add_argument(
        "--rlpipe_args",
        default="",
        help="extra overrides for rlpipe's job, given with '=': --rlpipe_args='--train.max_batches_ahead 2'",
    )
    ap.add_argument("--trl_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child_out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--t_start", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trl_child:
        trl_child(args.trl_child, args.steps, args.child_out, args.t_start or time.time())
        return 0
    sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        ap.error(f"--sizes: unknown {bad}; choose from {list(SIZES)}")
    steps = {s: (args.steps_50m if s == "50m" else args.steps) for s in sizes}
    machine = machine_name()
    dtypes = [d for d in args.publish_dtype.split(",") if d]
    policies = [p for p in args.trl_omp_wait_policy.split(",") if p]
    if not dtypes or not set(dtypes) <= {"auto", "float32", "bfloat16"}:
        ap.error(f"--publish_dtype: {args.publish_dtype!r}: choose from auto, float32, bfloat16")
    if not policies or not set(policies) <= {"PASSIVE", "ACTIVE", "pytorch"}:
        ap.error(f"--trl_omp_wait_policy: {args.trl_omp_wait_policy!r}: choose from PASSIVE, ACTIVE, pytorch")
    extra = args.rlpipe_args.split()
    omp: list[str | None] = [None if p == "pytorch" else p for p in policies]
    every = tuple(s for s in args.every_setting.split(",") if s)
    if args.onpolicy_dtype not in ("", "auto", "float32", "bfloat16"):
        ap.error(f"--onpolicy_dtype: {args.onpolicy_dtype!r}: choose from auto, float32, bfloat16, ''")
    onpolicy = args.onpolicy_dtype or None
    rows = compare(sizes, steps, args.trl_python, args.work_dir, extra, None, dtypes, omp, every, onpolicy)
    print_table(rows, machine)
    if args.json:
        settings = {
            "publish_dtypes": dtypes, "trl_omp_wait_policies": policies, "every_setting": list(every),
            "onpolicy_dtype": onpolicy,
        }  # fmt: skip
        Path(args.json).write_text(
            json.dumps({"machine": machine, "rlpipe_args": extra, **settings, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
