"""The learner's train step alone against PyTorch's, at the TRL comparison's ~50M shape, in CPU seconds per step:

    python -m bench.bench_train_step [--steps 12] [--xla_flags= --xla_flags=--xla_cpu_use_onednn=true ...] [--json OUT]

Same Llama shape as `bench.bench_trl`'s 50m size (hidden 640, MLP 1728, 10 layers, 10/5 heads, the `builtin:tiny`
vocabulary), same batch (16 rows of 25 tokens: the cats prompts plus 16 new tokens), float32. rlpipe: the jitted
`policy.learner.mesh_train_step` (the `rloo` loss module, logprobs and entropy of every token, AdamW, gradient
clipping), split into its forward (logprobs), forward + backward and optimizer update, each jitted alone. PyTorch:
`transformers`' `LlamaForCausalLM`, forward + log-softmax gather, backward, gradient clipping and AdamW, with
`OMP_WAIT_POLICY=PASSIVE` as in the TRL comparison. Each setting runs in a process of its own (XLA reads its flags
once per process); the figure is the median of `--steps` steps after a warm-up step, user + system CPU of the
process. What this measured and what it found is in docs/benchmarks.md ("The train step against PyTorch's").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

HIDDEN, MLP, LAYERS, HEADS, KV_HEADS = 640, 1728, 10, 10, 5
ROWS, SEQ = 16, 25


def _cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _median_cpu(fn: Any, steps: int) -> float:
    """Median CPU seconds of `fn()` over `steps` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(steps):
        c0 = _cpu()
        fn()
        times.append(_cpu() - c0)
    return sorted(times)[len(times) // 2]


def rlpipe_child(steps: int) -> dict[str, Any]:
    """rlpipe's train step and its parts in this process (run by `main` in a fresh process per XLA setting)."""
    import equinox as eqx
    import jax

    from bench.common import learner_on_mesh
    from pipeline.config import LearnerStepConfig, MeshConfig, ModelSpec, TrainParams
    from pipeline.environments.tokenizer import build_tiny_tokenizer
    from policy import learner as L

    vocab = len(build_tiny_tokenizer())
    spec = ModelSpec(
        hidden_dim=HIDDEN,
        intermediate_dim=MLP,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        max_seq_len=64,
        tokenizer="builtin:tiny",
    )
    config = LearnerStepConfig(
        model=spec, train=TrainParams(batch_size=ROWS, seq_len=SEQ, num_train_steps=1000), mesh=MeshConfig(fsdp=-1)
    )
    state, batch, step = learner_on_mesh(config, vocab, -3.0)
    model = state.model
    optimizer = L.build_optimizer(config.optimizer, 1000)
    carry = [state.model, state.opt_state]

    def train() -> None:
        m, o, _ = step(carry[0], carry[1], None, batch)
        jax.block_until_ready(m)
        carry[:] = [m, o]

    logprobs = L.make_logprob_fn("float32")
    forward = eqx.filter_jit(lambda m, b: logprobs(m, b)[0].sum())
    grad = eqx.filter_jit(eqx.filter_grad(lambda m, b: logprobs(m, b)[0].sum()))
    params = eqx.filter(model, eqx.is_array)
    opt_state = optimizer.init(params)
    grads = grad(model, batch)
    update = eqx.filter_jit(lambda g, s, p: optimizer.update(g, s, p))
    return {
        "train_step": _median_cpu(train, steps),
        "forward": _median_cpu(lambda: jax.block_until_ready(forward(model, batch)), steps),
        "forward_backward": _median_cpu(lambda: jax.block_until_ready(grad(model, batch)), steps),
        "optimizer": _median_cpu(lambda: jax.block_until_ready(update(grads, opt_state, params)), steps),
    }


def torch_child(steps: int) -> dict[str, Any]:
    """PyTorch's step and its parts on the same shape in this process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.environments.tokenizer import build_tiny_tokenizer

    vocab = len(build_tiny_tokenizer())
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randint(0, vocab, (ROWS, SEQ))
    parts: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": [], "train_step": []}
    for i in range(steps + 1):
        c0 = _cpu()
        logits = model(x).logits
        loss = -torch.log_softmax(logits.float(), -1).gather(-1, x[..., None]).mean()
        c1 = _cpu()
        loss.backward()
        c2 = _cpu()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        c3 = _cpu()
        if i:
            for name, v in (
                ("forward", c1 - c0),
                ("backward", c2 - c1),
                ("optimizer", c3 - c2),
                ("train_step", c3 - c0),
            ):
                parts[name].append(v)
    return {name: sorted(v)[len(v) // 2] for name, v in parts.items()}


def _child(kind: str, steps: int, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.bench_train_step", "--child", kind, "--steps", str(steps)]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--xla_flags",
        action="append",
        help="an XLA_FLAGS setting for rlpipe, in a process of its own (repeat; write --xla_flags=VALUE; an empty "
        "value is XLA's defaults, which run when none is given)",
    )
    ap.add_argument("--skip_torch", action="store_true")
    ap.add_argument("--json", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        fn = rlpipe_child if args.child == "rlpipe" else torch_child
        print(json.dumps(fn(args.steps)))
        return
    rows: list[dict[str, Any]] = []
    for flags in args.xla_flags or [""]:
        rows.append({"system": "rlpipe", "xla_flags": flags, **_child("rlpipe", args.steps, {"XLA_FLAGS": flags})})
    if not args.skip_torch:
        rows.append(
            {"system": "pytorch", "omp": "PASSIVE", **_child("torch", args.steps, {"OMP_WAIT_POLICY": "PASSIVE"})}
        )
    print(f"{'system':<10} {'setting':<44} {'step':>6} {'fwd':>6} {'fwd+bwd':>8} {'bwd':>6} {'opt':>6}  (CPU s)")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:<10} {r.get('xla_flags', '')!s:<44} error {r['error']}")
            continue
        bwd = r.get("backward", r.get("forward_backward", 0) - r["forward"])
        fb = r.get("forward_backward", r["forward"] + bwd)
        setting = r.get("xla_flags") or r.get("omp") or "XLA default"
        print(
            f"{r['system']:<10} {setting:<44} {r['train_step']:6.2f} {r['forward']:6.2f} {fb:8.2f} {bwd:6.2f} "
            f"{r['optimizer']:6.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
