"""Group-relative advantage estimators: RLOO, GRPO, Dr.GRPO.

Each estimator is a small pure numpy function of the episode rewards of rollouts sampled from the
same prompt by the same policy (a *group*). Every function takes the rewards `r` (shape [n]) and
optionally `group_ids` (shape [n], integer group labels): with `group_ids` the formula is applied
to each group independently, vectorised over all groups at once (what the BatchMaker does per
rollout file); without it the whole array is one group.

Promises, for every estimator and every group:
- a group of one gets advantage 0 (no baseline to compare with);
- a group whose rewards are all equal gets advantage 0;
- no random noise is added (no jitter to break ties: equal-reward groups are filtered by the
  BatchMaker with a recorded reason instead);
- RLOO and Dr.GRPO advantages sum to zero within each group; GRPO advantages too (up to float
  rounding), being mean-centred.

Registry: `ADVANTAGE_ESTIMATORS[name]` for `TrainParams.advantage_estimator` in {rloo, grpo, dr_grpo};
`estimator_for(name)` raises KeyError naming the known ones.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GRPO_EPS",
    "AdvantageFn",
    "dr_grpo_advantages",
    "estimator_for",
    "group_stats",
    "grpo_advantages",
    "rloo_advantages",
]

FloatArray = npt.NDArray[np.float64]
AdvantageFn = Callable[[npt.ArrayLike, "npt.ArrayLike | None"], FloatArray]

GRPO_EPS = 1e-6
"""ε added to the group standard deviation in GRPO."""


def group_stats(
    rewards: npt.ArrayLike, group_ids: npt.ArrayLike | None = None
) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray, npt.NDArray[np.int64]]:
    """Per-rollout group statistics (r, n_g, mean_g, std_g, codes), the first four broadcast to each rollout.

    `std_g` is the population standard deviation (ddof = 0) of the rollout's group. Group labels may be
    any integers; they are re-coded to 0..G-1 (returned as the last element).
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if group_ids is None:
        codes = np.zeros(r.shape[0], dtype=np.int64)
    else:
        g = np.asarray(group_ids).reshape(-1)
        if g.shape[0] != r.shape[0]:
            raise ValueError(f"group_ids has {g.shape[0]} entries, rewards {r.shape[0]}")
        _, codes = np.unique(g, return_inverse=True)
        codes = codes.astype(np.int64).reshape(-1)
    if r.shape[0] == 0:
        empty = np.zeros(0, dtype=np.float64)
        return r, empty, empty, empty, codes
    n_groups = int(codes.max()) + 1
    counts = np.bincount(codes, minlength=n_groups).astype(np.float64)
    sums = np.bincount(codes, weights=r, minlength=n_groups)
    mean = sums / counts
    dev = r - mean[codes]
    var = np.bincount(codes, weights=dev * dev, minlength=n_groups) / counts
    return r, counts[codes], mean[codes], np.sqrt(var)[codes], codes


def _exact_zero_for_constant(adv: FloatArray, r: FloatArray, codes: npt.NDArray[np.int64]) -> FloatArray:
    """Force exactly 0 in groups whose rewards are all equal (float rounding of the mean can leave ~1e-17)."""
    if r.shape[0] == 0:
        return adv
    n_groups = int(codes.max()) + 1
    gmax = np.full(n_groups, -np.inf)
    gmin = np.full(n_groups, np.inf)
    np.maximum.at(gmax, codes, r)
    np.minimum.at(gmin, codes, r)
    constant = (gmax == gmin)[codes]
    adv[constant] = 0.0
    return adv


def rloo_advantages(rewards: npt.ArrayLike, group_ids: npt.ArrayLike | None = None) -> FloatArray:
    """RLOO (REINFORCE leave-one-out): each rollout's baseline is the mean reward of the *other* members.

        A_i = r_i - (1/(n-1)) · Σ_{j≠i} r_j  =  n/(n-1) · (r_i - mean(r))      for n ≥ 2
        A_i = 0                                                                 for n = 1

    Example: r = [0, 1, 0] gives A = [-0.5, 1, -0.5]. Sums to zero within each group.

    References:
        Kool, van Hoof, Welling 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!" (ICLR 2019 DeepRLStructPred
        workshop): the leave-one-out baseline.
        Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
        Feedback in LLMs", arXiv:2402.14740: RLOO for LLM RL.
    """
    r, n, mean, _, codes = group_stats(rewards, group_ids)
    with np.errstate(divide="ignore", invalid="ignore"):
        adv = np.where(n > 1, n / np.maximum(n - 1, 1) * (r - mean), 0.0)
    return _exact_zero_for_constant(adv.astype(np.float64), r, codes)


def grpo_advantages(rewards: npt.ArrayLike, group_ids: npt.ArrayLike | None = None) -> FloatArray:
    """GRPO: rewards standardised within the group.

        A_i = (r_i - mean(r)) / (std(r) + ε),   std with ddof = 0, ε = GRPO_EPS (1e-6)

    A group of one (or with equal rewards) gets 0. Sums to zero within each group.

    References:
        Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
        arXiv:2402.03300 (outcome supervision with normalised group rewards).
    """
    r, n, mean, std, codes = group_stats(rewards, group_ids)
    adv = np.where(n > 1, (r - mean) / (std + GRPO_EPS), 0.0)
    return _exact_zero_for_constant(adv.astype(np.float64), r, codes)


def dr_grpo_advantages(rewards: npt.ArrayLike, group_ids: npt.ArrayLike | None = None) -> FloatArray:
    """Dr.GRPO ("GRPO done right"): mean-centred rewards without the std normalisation.

        A_i = r_i - mean(r)

    A group of one gets 0. Sums to zero within each group.

    References:
        Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783
        (Dr.GRPO: no std normalisation of advantages, no per-response length normalisation of the loss).
    """
    r, n, mean, _, codes = group_stats(rewards, group_ids)
    adv = np.where(n > 1, r - mean, 0.0)
    return _exact_zero_for_constant(adv.astype(np.float64), r, codes)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "rloo": rloo_advantages,
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
}
"""Estimators by `TrainParams.advantage_estimator` name."""


def estimator_for(name: str) -> AdvantageFn:
    """The estimator registered under `name`; KeyError naming the known ones otherwise."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise KeyError(f"unknown advantage_estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}") from None
