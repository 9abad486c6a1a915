"""Where one learner step's wall time goes: the per-hop breakdown recorded in every learner metrics record.

A learner step T spans from the end of step T-1 (`step_started_at`) to the end of step T (`step_ended_at`).
Inside it, batch slot T reached the learner through one chain of events, each a timestamp (unix seconds)
recorded by the step that saw it:

  policy_published_at   the learner committed the policy that sampled the slot's last rollout file
  worker_noticed_at     a rollout worker saw that policy committed (before loading it)
  generate_started_at   the worker started generating the file (weights loaded, pacing let it)
  generated_at          generation done
  rollout_committed_at  the file's ready marker was written (ready marker `time`)
  batch_noticed_at      the BatchMaker had all it needed for the slot (that file read, the learner's policy seen)
  batch_committed_at    the slot's log entry was written (log entry `time`)
  learner_noticed_at    the learner saw the log entry
  train_started_at      the batch was read and converted; the optimizer step started
  trained_at            the optimizer step finished (metrics on the host)
  step_ended_at         policy (and checkpoint) handed off: the learner is free for step T+1

`HOPS[i]` is the time between consecutive events, each clamped into the step's span and made monotone: an
event before the step started (the rollout was generated while step T-1 trained: overlap) contributes 0, so
the hops of a step add up to its wall time exactly, and each hop is the part of the step spent waiting on
that link of the chain. A missing event (an older producer, a file ingested for an earlier slot) merges its
hop into the next one.
"""

from __future__ import annotations

from collections.abc import Mapping

EVENTS = (
    "policy_published_at",
    "worker_noticed_at",
    "generate_started_at",
    "generated_at",
    "rollout_committed_at",
    "batch_noticed_at",
    "batch_committed_at",
    "learner_noticed_at",
    "train_started_at",
    "trained_at",
)
"""The chain's events in order (between `step_started_at` and `step_ended_at`)."""

HOPS = (
    "publish",
    "worker_notice",
    "load_and_pace",
    "generate",
    "rollout_commit",
    "batch_notice",
    "batch_commit",
    "learner_notice",
    "read_batch",
    "train",
    "handoff",
)
"""Hop i ends at event i (`EVENTS`, then `step_ended_at` for the last one)."""

HOP_HELP = {
    "publish": "the previous policy being committed (background publish still running)",
    "worker_notice": "a rollout worker noticing the new policy",
    "load_and_pace": "loading the policy, and pacing, before generation started",
    "generate": "generating the rollout file that completed the batch",
    "rollout_commit": "writing that rollout file and its ready marker",
    "batch_notice": "the BatchMaker noticing and reading that file (or the learner's policy, when paced)",
    "batch_commit": "building and writing the batch slot and its log entry",
    "learner_notice": "the learner noticing the log entry",
    "read_batch": "reading and converting the batch",
    "train": "the optimizer step",
    "handoff": "publishing / checkpointing / metrics before the next step",
}


def step_hops(started_at: float, ended_at: float, events: Mapping[str, float | None]) -> dict[str, float]:
    """The step's hops (`HOPS` -> seconds), adding up to `ended_at - started_at` (see the module docstring)."""
    hops: dict[str, float] = {}
    t = started_at
    for hop, event in zip(HOPS, (*EVENTS, "step_ended_at"), strict=True):
        at = ended_at if event == "step_ended_at" else events.get(event)
        if at is None:
            hops[hop] = 0.0
            continue
        at = min(max(float(at), t), ended_at)
        hops[hop] = at - t
        t = at
    return hops
