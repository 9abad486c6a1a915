"""The learner's curves: one small plot per term of its per-step metrics record (`metrics/learner/*.jsonl`).

A term no record carries is listed in a note (older runs and other loss modules log fewer terms); the rest
are still drawn.
"""

from __future__ import annotations

import html

from pipeline.process.step_kind import StepKind
from pipeline.report.data import RunData, last_per, series
from pipeline.report.plots import Plot, Section, new_figure, to_png

LEARNER_TERMS: tuple[tuple[str, str, str], ...] = (
    ("loss", "loss", "Total loss (policy gradient + KL)"),
    ("kl", "kl", "KL to the reference policy"),
    ("entropy", "entropy", "Entropy of the policy on response tokens"),
    ("clip_fraction", "clip_fraction", "Clip fraction (share of clipped tokens)"),
    ("ratio", "ratio_mean", "Importance ratio π_θ / π_old (mean)"),
    ("grad_norm", "grad_norm", "Gradient norm (before clipping)"),
    ("mismatch_kl", "mismatch_kl", "Mismatch KL, learner vs sampler logprobs"),
    ("mismatch_seq_max", "mismatch_seq_abs_logp_max", "Mismatch per sequence: max |log π_θ − log π_sampler| (mean)"),
    ("mismatch_seq_ratio", "mismatch_seq_abs_log_ratio", "Mismatch per sequence: |Σ log π_θ/π_sampler| (mean)"),
    ("mis_masked_fraction", "mis_masked_fraction", "Masked IS: share of loss tokens rejected"),
    ("clamped_fraction", "clamped_fraction", "Clamped fraction (log-ratio clamp)"),
    ("skipped_nonfinite", "skipped_nonfinite", "Skipped non-finite updates (1 = skipped)"),
)
"""(plot name suffix, metrics field, title) of every learner curve, in page order; plot names are
`learner_<suffix>`."""


def learner_section(data: RunData) -> Section:
    """One plot per learner term vs learner step; missing terms named in a note."""
    sec = Section("Learner")
    learner = last_per(data.metrics.get(StepKind.LEARNER, []), "step")
    if not learner:
        return sec.no_data("metrics/learner/*.jsonl records with a step")
    missing = []
    for suffix, field, title in LEARNER_TERMS:
        xs, ys = series(learner, field)
        if not xs:
            missing.append(field)
            continue
        fig, (ax,) = new_figure(1, width=4.2, height=2.8)
        ax.plot(xs, ys, marker=".", lw=1.2, color="tab:blue")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("learner step", fontsize=8)
        ax.tick_params(labelsize=7)
        sec.plots.append(Plot(f"learner_{suffix}", to_png(fig), f"{field} per learner step"))
    if missing:
        names = ", ".join(missing)
        sec.body.append(f'<p class="nodata">not in the learner records (not drawn): {html.escape(names)}</p>')
    sec.grid = True
    return sec
