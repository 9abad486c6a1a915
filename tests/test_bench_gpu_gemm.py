"""`bench.gpu_gemm` on CPU: every XLA variant of a decode product computes the product, and each is timed."""

from __future__ import annotations

import json
from pathlib import Path

from bench import gpu_gemm


def test_gemm_variants_compute_the_product_and_are_timed(tmp_path: Path) -> None:
    assert gpu_gemm.main(["--tiny", "--layers", "2", "--reps", "1", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "gemm.jsonl").read_text().splitlines()]
    variants = {"xla-in-out", "xla-out-in", "xla-splitk-2", "xla-splitk-4", "xla-splitk-8"}
    for product in gpu_gemm.SHAPES_TINY:
        mine = {r["variant"]: r for r in rows if r["product"] == product}
        assert set(mine) == variants, (product, sorted(mine))
        for r in mine.values():
            assert "error" not in r, r
            # bf16 products of sums over 64-256 terms: a wrong split or layout is off by whole units, not 1e-2
            assert r["max_abs_err"] < 0.05 and r["us"] > 0 and r["timing"] == "wall", r
