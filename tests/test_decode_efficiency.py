"""Decode efficiency of the dense sampler (policy/inference/dense_sampler.py, `DecodeOptions`), CPU float32.

What is checked:
- the fast decode loop (static no-controls sampling, head-major KV cache, length phases with caches grown
  between phases) samples the legacy loop's tokens and logprobs (same PRNG streams), at T = 1 and greedy,
  with stop tokens and per-row budgets, in both cache layouts, with phases exercised (a small length bucket);
- the KV cache is updated in place: in the compiled program, no operation reads a whole cache and writes a
  whole cache (a copy, transpose or re-layout) other than the in-place dynamic-update-slice, while the legacy
  program (where the attention products read the [batch, slots, heads, dim] cache transposed) has such copies,
  which shows the check can fail; the same for the continuous sampler's decode program (per-slot cache writes
  as scatters into the loop-carried cache; its slot-major layout, kept for the legacy options, has the copies);
- fused projections (query/key/value as one weight, gate/up as one) sample the unfused loop's tokens, with
  biases (qwen2), query/key norms (qwen3) and neither (llama), static and continuous, and a policy swapped in
  through `update_params` / `stage_model` is fused too;
- no weight is copied or transposed inside the decode loop (weights are [out, in] matrices; the layout they had
  before, several output axes, was transposed into a new buffer at every step on CPU), separate and fused;
- the phase lengths: powers of two times the bucket above the prompt bucket, the last one the cache length.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np
import pytest

from pipeline.config import ModelSpec
from policy.inference.continuous import ContinuousSampler, SeqRequest
from policy.inference.dense_sampler import LEGACY_DECODE, DecodeOptions, DenseSampler, phase_lengths
from policy.model import build_model

SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64)
PROMPTS = [[1, 40, 41, 42, 43], [1, 7], [1, 2, 3, 4, 5, 6, 7, 8]]
BUDGETS = [20, 20, 7]
STOPS = [5]


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(SPEC, 512, key=jax.random.PRNGKey(0))


def _generate(sampler: DenseSampler, temperature: float) -> Any:
    return sampler.generate(
        PROMPTS,
        [0, 1, 2],
        batch_size=4,
        max_tokens=BUDGETS,
        max_new_bucket=32,
        stop_tokens=STOPS,
        temperature=temperature,
        seed=3,
    )


def test_phase_lengths() -> None:
    assert phase_lengths(64, 192, 128) == [128, 192]
    assert phase_lengths(8, 40, 8) == [16, 32, 40]
    assert phase_lengths(256, 2304, 128) == [512, 1024, 2048, 2304]
    assert phase_lengths(8, 24, 128) == [24]
    assert phase_lengths(64, 192, 0) == [192]


@pytest.mark.parametrize(
    "options",
    [
        DecodeOptions(length_bucket=8),
        DecodeOptions(head_major_cache=False, length_bucket=8),
        DecodeOptions(reduce_attention=True, length_bucket=8),
    ],
    ids=["head-major", "slot-major", "reduce-attention"],
)
def test_fast_decode_samples_what_legacy_samples(model: Any, options: DecodeOptions) -> None:
    legacy = DenseSampler(model, "float32", fast_compile=True, decode=LEGACY_DECODE)
    fast = DenseSampler(model, "float32", fast_compile=True, decode=options)
    for temperature in (1.0, 0.0):
        a, b = _generate(legacy, temperature), _generate(fast, temperature)
        np.testing.assert_array_equal(b.lengths, a.lengths)
        np.testing.assert_array_equal(b.stopped, a.stopped)
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
        # the budgets bind and generation runs past the first phase (16 cache slots: prompt bucket 8 + 8 tokens)
        assert a.lengths[2] <= 7 and a.lengths.max() > 8


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_projections_sample_the_same_tokens(family: str) -> None:
    spec = dataclasses.replace(SPEC, family=family)
    first, second = (build_model(spec, 512, key=jax.random.PRNGKey(s)) for s in (0, 1))
    plain = DenseSampler(
        first, "float32", fast_compile=True, decode=DecodeOptions(length_bucket=8, fused_projections=False)
    )
    fused = DenseSampler(
        first, "float32", fast_compile=True, decode=DecodeOptions(length_bucket=8, fused_projections=True)
    )
    layer = fused.params["layers"][0]
    assert "w_qkv" in layer and "w_gate_up" in layer and "wq" not in layer and "w_up" not in layer
    assert (layer["b_qkv"] is not None) == (family == "qwen2")
    for model in (first, second):  # the second through update_params: the swapped-in weights are fused too
        plain.update_params(model)
        fused.update_params(model)
        a, b = _generate(plain, 1.0), _generate(fused, 1.0)
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_array_equal(b.lengths, a.lengths)
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    requests = [SeqRequest(p, n, i, 3) for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS, strict=True))]
    results = []
    for sampler in (plain, fused):
        cont = ContinuousSampler(sampler)
        cont.stage_model(first, 0)
        results.append(cont.run(requests, slots=2, stop_tokens=STOPS, temperature=1.0))
    for x, y in zip(*results, strict=True):
        np.testing.assert_array_equal(y.tokens, x.tokens)
        assert len(x.tokens) > 0
        np.testing.assert_allclose(y.logprobs, x.logprobs, atol=1e-5, rtol=0)


def _compiled_text(sampler: DenseSampler) -> str:
    """The optimized HLO of the static sampler's program (4 rows, 8-token prompts, 32 new tokens)."""
    B = 4
    host = (
        np.zeros((B, 8), np.int32),
        np.ones(B, np.int32),
        np.ones(B, np.int32),
        np.ones(B, bool),
        jax.random.PRNGKey(0),
        np.zeros(B, np.uint32),
        np.zeros(4, np.int32),
        np.float32(1.0),
    )
    controls = (np.float32(1.0), np.int32(0), np.float32(0.0))
    truncate = not sampler.decode.fast_sampling
    compiled = sampler._jitted.lower(sampler.params, *host, controls, max_new=32, truncate=truncate).compile()
    return compiled.as_text() or ""


def _loop_weight_copies(hlo: str, sizes: set[int]) -> list[str]:
    """Copies and transposes inside while-loop bodies (what a decode step runs) whose result has as many elements
    as one of the weights (`sizes`): a weight re-laid out into a new buffer at every step."""
    comps: dict[str, list[str]] = {}
    current = None
    for raw in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?(%[\w.-]+) .*\{$", raw)
        if header:
            current = comps.setdefault(header.group(1), [])
        elif current is not None:
            current.append(raw.split(", metadata=")[0].strip())
    called = re.compile(r"(?:calls|body|condition|to_apply|branch_computations)=\{?(%[\w.-]+)")
    todo = re.findall(r"body=(%[\w.-]+)", hlo)
    loop: set[str] = set()
    while todo:
        c = todo.pop()
        if c not in loop:
            loop.add(c)
            todo += [d for line in comps.get(c, []) for d in called.findall(line)]
    out = []
    for c in loop:
        for line in comps.get(c, []):
            m = re.search(r"= f32\[([\d,]*)\]\S* (copy|transpose)\(", line)
            if m and math.prod(int(d) for d in m.group(1).split(",") if d) in sizes:
                out.append(line)
    return out


def _weight_sizes(sampler: DenseSampler) -> set[int]:
    return {int(w.size) for lp in sampler.params["layers"] for w in lp.values() if hasattr(w, "ndim") and w.ndim >= 2}


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_weights_read_in_place(fused: bool) -> None:
    # sizes no other array of the program has (cache 4·40·2·12, logits 4·500, ...), so a copy's size names a weight
    spec = dataclasses.replace(SPEC, hidden_dim=48, intermediate_dim=88)
    model = build_model(spec, 500, key=jax.random.PRNGKey(0))
    sampler = DenseSampler(model, "float32", decode=DecodeOptions(fused_projections=fused))
    sizes = _weight_sizes(sampler)
    assert _loop_weight_copies(_compiled_text(sampler), sizes) == []
    # the check is not blind: a loop reading a query weight laid out [kv_heads, group, head, embed] (the layout the
    # sampler used before) copies it, transposed, at every step on CPU
    K, G, h, D = 2, 2, 8, 32
    wq = np.ones((K, G, h, D), np.float32)

    def body(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.numpy.einsum("bd,kghd->bkgh", x, w).reshape(x.shape[0], -1)[:, :D] * 0.5

    loop = jax.jit(lambda x, w: jax.lax.fori_loop(0, 4, lambda i, y: body(y, w), x))
    hlo = loop.lower(np.ones((4, D), np.float32), wq)
    assert _loop_weight_copies(hlo.compile().as_text() or "", {K * G * h * D}), "the check is blind"


def _cache_copies(sampler: DenseSampler) -> list[str]:
    """Instructions run per decode step (in the while loops' bodies, fusions included) of the optimized program
    that take a whole-cache-sized operand and produce a whole-cache-sized result other than an in-place
    dynamic-update-slice (a transposed or re-laid-out copy of the cache)."""
    a = sampler.arch
    return _loop_cache_copies(_compiled_text(sampler), (4, 8 + 32, a.num_kv_heads, a.head_dim))


# ops that pass a cache buffer through or update it in place (not a per-step copy)
_NOT_COPIES = ("parameter", "get-tuple-element", "tuple", "bitcast", "while", "call", "dynamic-update-slice", "scatter")


def _loop_cache_copies(hlo: str, cache_dims: tuple[int, ...]) -> list[str]:
    """The instructions of `_cache_copies` in optimized HLO text, for caches of `cache_dims` (any order). Scatters
    count as in place (where XLA cannot update a scatter's operand in place, copy insertion adds a `copy`), and so
    do calls and loops, whose computations are checked themselves (a CPU scatter runs as a loop of updates)."""
    dims = sorted(cache_dims)
    shape = re.compile(r"f32\[(\d+),(\d+),(\d+),(\d+)\]")

    def full(text: str) -> bool:
        return any(sorted(int(d) for d in m.groups()) == dims for m in shape.finditer(text))

    # the optimized module, split into computations: name -> [(instruction, result shape, op, operands, line)]
    comps: dict[str, list[tuple[str, str, str, list[str], str]]] = {}
    current = None
    instr = re.compile(r"^(?:ROOT )?(%[\w.-]+) = (.+?) ([\w-]+)\((.*)$")
    for raw in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?(%[\w.-]+) .*\{$", raw)
        if header:
            current = comps.setdefault(header.group(1), [])
            continue
        m = instr.match(raw.split(", metadata=")[0].strip())
        if m and current is not None:
            name, result, op, rest = m.groups()
            current.append((name, result, op, re.findall(r"%[\w.-]+", rest), rest))
    result_of = {i[0]: i[1] for body in comps.values() for i in body}
    root_op = {c: body[-1][2] for c, body in comps.items() if body}
    called = re.compile(r"(?:calls|body|condition|to_apply|branch_computations)=\{?(%[\w.-]+)")
    # the computations run per decode step: the while bodies and everything they call
    todo = [c for body in comps.values() for i in body if i[2] == "while" for c in re.findall(r"body=(%[\w.-]+)", i[4])]
    loop: set[str] = set()
    while todo:
        c = todo.pop()
        if c not in loop:
            loop.add(c)
            todo += [d for i in comps.get(c, []) for d in called.findall(i[4])]
    out = []
    for c in loop:
        for name, result, op, operands, rest in comps.get(c, []):
            if op in _NOT_COPIES:
                continue
            fused = called.findall(rest)
            if op == "fusion" and fused and root_op.get(fused[0]) in ("dynamic-update-slice", "scatter"):
                continue  # updates its operand buffer in place
            if full(result) and any(full(result_of.get(o, "")) for o in operands):
                out.append(f"{name} = {result} {op}({', '.join(operands)})")
    return out


def test_kv_cache_updated_in_place(model: Any) -> None:
    legacy = _cache_copies(DenseSampler(model, "float32", decode=LEGACY_DECODE))
    assert legacy, "the legacy program's transposed cache copies were not found: the check is blind"
    fast = _cache_copies(DenseSampler(model, "float32", decode=DecodeOptions(length_bucket=0)))
    assert fast == [], "\n".join(fast)


def _continuous_cache_copies(sampler: DenseSampler) -> list[str]:
    """`_cache_copies` of the continuous sampler's decode program (4 slots, cache 8 + 32, no controls)."""
    cont = ContinuousSampler(sampler)
    S, L, T, K = 4, 8 + 32, 32, 4
    state = cont._empty_state(S, L, T, K)
    controls = (np.float32(1.0), np.int32(0), np.float32(0.0))
    lowered = cont._decode.lower(
        sampler.params,
        state,
        np.int32(1),
        controls,
        np.int32(8),
        length=L,
        truncate=not sampler.decode.fast_sampling,
    )
    hlo: str = lowered.compile().as_text() or ""
    a = sampler.arch
    return _loop_cache_copies(hlo, (S, L, a.num_kv_heads, a.head_dim))


def test_continuous_kv_cache_updated_in_place(model: Any) -> None:
    legacy = _continuous_cache_copies(DenseSampler(model, "float32", decode=LEGACY_DECODE))
    assert legacy, "the slot-major continuous program's transposed cache copies were not found: the check is blind"
    fast = _continuous_cache_copies(DenseSampler(model, "float32"))
    assert fast == [], "\n".join(fast)
