"""pass@k and mean@k of an evaluation: k samples per problem.

pass@k is the probability that at least one of k samples of a problem is a success, estimated from n >= k samples
of which c succeeded with the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on
Code" (arXiv:2107.03374, eq. 1): pass@k = E_problems[1 - C(n - c, k) / C(n, k)], computed as the product
prod_{i = n-c+1..n} (1 - k / i) for numerical stability (their Figure 3). mean@k is the mean reward over the k samples
of a problem, averaged over problems (with n > k samples: the mean over all n, its unbiased estimate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` successes among `n` samples (Chen et al. 2021, eq. 1).

    Raises ValueError unless 0 <= c <= n and 1 <= k <= n."""
    if not 0 <= c <= n:
        raise ValueError(f"c={c} successes must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, n={n}]")
    if n - c < k:  # every k-subset holds a success
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@dataclass(frozen=True)
class PassAtK:
    """pass@k and mean@k over the problems of an evaluation (`n_problems` of them, `n` samples each)."""

    k: int
    n: int
    n_problems: int
    pass_at_k: float
    mean_at_k: float


def pass_at_k_of_groups(groups: Mapping[str, Sequence[tuple[float, bool]]], k: int | None = None) -> PassAtK | None:
    """pass@k / mean@k of problems given as `{problem: [(reward, success), ...]}` (one entry per sample).

    `k` defaults to the smallest number of samples of a problem; n is that smallest number too (every problem is
    counted with all its samples). None when there are no problems. Raises ValueError when k exceeds n."""
    sizes = [len(v) for v in groups.values() if len(v) > 0]
    if not sizes:
        return None
    n = min(sizes)
    kk = n if k is None or k == 0 else k
    if kk > n:
        raise ValueError(f"pass@k with k={kk} needs >= {kk} samples of every problem; some have {n}")
    passes = [pass_at_k(len(v), sum(1 for _, s in v if s), kk) for v in groups.values() if v]
    means = [float(np.mean([r for r, _ in v])) for v in groups.values() if v]
    return PassAtK(kk, n, len(passes), float(np.mean(passes)), float(np.mean(means)))
