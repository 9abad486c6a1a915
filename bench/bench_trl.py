"""rlpipe vs TRL's GRPOTrainer on the cats task, side by side, at two model sizes.

Same task (the cats prompts, reward `min(count("cat"), 4) / 4`), same model shape (a Llama built from one
config: layers, width, heads, vocabulary of the `builtin:tiny` tokenizer), same batch (4 prompts x 4 samples =
16 completions of at most 16 tokens, temperature 1), learning rate 1e-3 (constant, no warm-up), KL 0, gradient
clip 1.0, same number of learner steps. The two runs of one size are interleaved (TRL, then rlpipe; the next
size in the opposite order) in one process tree, each in a fresh process.

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
every 0.2 s), CPU seconds per learner step (user + system of the whole process tree over the whole run, start-up
and compilation included, divided by the steps: the load-independent cost of a step) and the ratio rlpipe / TRL
of each.

    python -m bench.bench_trl --sizes tiny,50m --steps 50 --steps_50m 10 --json out.json
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
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import machine_name

# name -> (hidden, intermediate, layers, heads, kv heads)
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (64, 192, 4, 4, 2),
    "50m": (640, 1728, 10, 10, 5),
}
PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, MAX_TOKENS, LR = 4, 4, 16, 1e-3
ROLLOUT_WORKERS = {"tiny": 2, "50m": 1}
"""rlpipe's rollout workers per size: at ~50M one worker's sampler already uses both cores of the 2-core machine,
and a second one only races it for them (and for the same rows, which then go stale)."""


def seq_len_for_task() -> int:
    """rlpipe's batch row length: the longest cats prompt plus MAX_TOKENS, the most TRL trains on per
    sequence (it pads each batch to its longest prompt + completion); longer rows would only add padding."""
    from pipeline.environments.cats import TRAIN_PROMPTS
    from pipeline.environments.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    return max(len(tok(p)["input_ids"]) for p in TRAIN_PROMPTS) + MAX_TOKENS


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

    def reward(completions: list[str], **_: Any) -> list[float]:
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
class PeakRss:
    """Peak of the RSS summed over a process and its descendants, sampled in a thread; also the CPU seconds
    (user + system) of every process of the tree, as last sampled (`cpu_s`: their sum)."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        import psutil

        self._proc = psutil.Process(pid)
        self.peak = 0
        self._cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True)
        self._thread.start()

    def _loop(self, period_s: float) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self._proc, *self._proc.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                        t = p.cpu_times()
                        self._cpu[p.pid] = t.user + t.system
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                return
            self._stop.wait(period_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak

    @property
    def cpu_s(self) -> float:
        return sum(self._cpu.values())


def _spawn(
    cmd: list[str], timeout_s: float, extra_env: dict[str, str] | None = None
) -> tuple[float, int, float, float]:
    """Run cmd; (wall seconds, peak RSS bytes of its tree, start time as epoch seconds, CPU seconds of its tree)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.update(extra_env or {})
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env)
    mon = PeakRss(proc.pid)
    try:
        rc = proc.wait(timeout=timeout_s)
    finally:
        peak = mon.stop()
        if proc.poll() is None:
            proc.kill()
    if rc != 0:
        raise RuntimeError(f"{cmd[:4]} exited with {rc}")
    return time.time() - t0, peak, t0, mon.cpu_s


def run_trl(python: str, size: str, steps: int, tmp: Path) -> dict[str, Any]:
    out = tmp / f"trl-{size}.json"
    cmd = [python, "-m", "bench.bench_trl", "--trl_child", size, "--steps", str(steps), "--child_out", str(out)]
    # TRL needs transformers' PyTorch classes: USE_TORCH=0 (set for step processes) must not reach it.
    wall, peak, _, cpu = _spawn([*cmd, "--t_start", repr(time.time())], 3600, {"USE_TORCH": "1"})
    res = json.loads(out.read_text())
    return {"rows": res["rows"], "params": res["params"], "wall_s": wall, "peak_rss_mib": peak / 2**20, "cpu_s": cpu}


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
    ]  # fmt: skip


def run_rlpipe(size: str, steps: int, tmp: Path) -> dict[str, Any]:
    from pipeline.report import load_run

    run_root = str(tmp / f"rlpipe-{size}")
    wall, peak, t0, cpu = _spawn([sys.executable, "-m", "steps.run", *rlpipe_overrides(size, steps, run_root)], 3600)
    data = load_run(run_root)
    learner = {int(r["step"]): r for r in data.metrics.get("learner", []) if "step" in r and "train_s" in r}
    rewards = {
        int(r["slot"]): float(r["mean_reward"]) for r in data.metrics.get("batchmaker", []) if "mean_reward" in r
    }
    rows = [
        {"step": s, "reward": rewards[s], "t": float(learner[s]["time"]) - t0} for s in sorted(learner) if s in rewards
    ]
    _hidden, _inter, _layers, _heads, _kv = SIZES[size]
    return {"rows": rows, "wall_s": wall, "peak_rss_mib": peak / 2**20, "cpu_s": cpu}


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


def compare(sizes: list[str], steps: dict[str, int], trl_python: str) -> list[dict[str, Any]]:
    """One row per (size, system), with milestones, memory and ratios rlpipe / TRL."""
    have_trl = _trl_available(trl_python)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rlpipe-trl-") as d:
        tmp = Path(d)
        for i, size in enumerate(sizes):
            order = ["trl", "rlpipe"] if i % 2 == 0 else ["rlpipe", "trl"]
            got: dict[str, dict[str, Any]] = {}
            for system in order:
                if system == "trl" and not have_trl:
                    continue
                res = (
                    run_trl(trl_python, size, steps[size], tmp)
                    if system == "trl"
                    else run_rlpipe(size, steps[size], tmp)
                )
                got[system] = {
                    **milestones(res["rows"]),
                    "wall_s": res["wall_s"],
                    "peak_rss_mib": res["peak_rss_mib"],
                    "cpu_s_per_step": res["cpu_s"] / max(steps[size], 1),
                }
                got[system]["rewards"] = [round(r["reward"], 4) for r in sorted(res["rows"], key=lambda r: r["step"])]
            for system, figs in got.items():
                row = {"size": size, "system": system, "steps": steps[size], **figs}
                if system == "rlpipe" and "trl" in got:
                    row["ratio"] = {
                        k: (figs[k] / got["trl"][k] if figs.get(k) and got["trl"].get(k) else None)
                        for k in ("steps_to_3x_start", "steps_to_0.5", "s_per_step", "s_to_3x_start", "s_to_0.5",
                                  "peak_rss_mib", "cpu_s_per_step")
                    }  # fmt: skip
                results.append(row)
            if not have_trl:
                print(f"note: `trl` not importable by {trl_python}; TRL column skipped", file=sys.stderr)
    return results


def _f(x: Any, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


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
            r["system"],
            r["steps"],
            _f(r["start_reward"]),
            _f(r["end_reward"]),
            *(_f(r.get(c)) for c in cols),
        ]
        print("  ".join(f"{v!s:>17}" for v in vals))
        if "ratio" in r:
            rat = ["", "rlpipe/TRL", "", "", "", *(_f(r["ratio"][c], ".2f") for c in cols)]
            print("  ".join(f"{v!s:>17}" for v in rat))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,50m")
    ap.add_argument("--steps", type=int, default=50, help="learner steps for the tiny size (both systems)")
    ap.add_argument("--steps_50m", type=int, default=10, help="learner steps for the 50m size (both systems)")
    ap.add_argument("--trl_python", default=os.environ.get("TRL_PYTHON", sys.executable))
    ap.add_argument("--json", default=None)
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
    rows = compare(sizes, steps, args.trl_python)
    print_table(rows, machine)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
