"""The BatchMaker: rollout rows in, fixed-shape training batches out; and the BatchMaker process's loop.

The BatchMaker itself (`maker`, `staging`, `chunk`, `packing`, `advantages`) is pure in-memory logic, with no I/O
and no JAX: the process loop reads committed rollout files, feeds their Arrow tables here, asks for batch T, and
writes what comes back. Everything works on Arrow/numpy columns
(list offsets + flat value buffers), never on per-token Python lists.

Fate of every rollout row fed in: it is *admitted* to the reservoir, or *dropped* with a reason
(`schemas.dropped.DROP_REASONS`, collected by `take_dropped`). An admitted row leaves the reservoir
either *used up* (it appeared in `max_samples_per_rollout` batches: the batch lineage records each use)
or dropped later (stale, superseded, evicted). `snapshot()` says which rows are still live and how
often each was used, so a restarted maker can rebuild the reservoir exactly (`restore_file`).

Ingestion (`add_rollouts(table, source_file, slot=T, latest_policy=S)`), in order:
1. malformed rows (list lengths disagree, empty prompt, non-finite reward/logprob/token reward,
   negative or wrong policy step, bad temperature, empty ids) -> `malformed` (the detail says which);
2. policy_step > S (the newest published policy) -> `future_policy`;
   policy_step < T-1-max_lag (too old for slot T and every later slot) -> `stale`, except rows rule 3 drops for
   want of signal: a row of a zero-variance group stays `zero_variance` and a zero-advantage row `zero_advantage`
   however old, also while the slot admits rows without signal (it could not have been trained fresh either, so
   `stale` counts only what the lag cost; `maker.KEPT_BEFORE_STALE`; without `filter_zero_variance` every row has
   signal here);
3. groups = episodes of this file sharing (group_key, policy_step); an episode is the rows sharing a non-empty
   `episode_id` (its segments; one sample whose reward is the episode's, its policy step its oldest segment's),
   else one row; advantages per group of episodes with the configured estimator
   (`pipeline.batch_maker.advantages`), each segment getting its episode's; with `filter_zero_variance`, a group
   whose rewards are all equal -> `zero_variance`, and a row whose own advantage is exactly 0 -> `zero_advantage`
   (unless the call says `admit_no_signal`: then they are admitted with advantage 0, counted in
   `IngestReport.admitted_no_signal`; the step does this when a slot cannot fill otherwise);
4. overlong (prompt + response > seq_len): rule `drop` -> `too_long`; rule `truncate` cuts the response
   to fit and marks the segment truncated (counted in `BatchResult.stats["n_cut_overlong"]`);
   a prompt that alone fills seq_len -> `too_long` under either rule;
5. latest-version retention per problem (env_name, example_id), among live rows: rows of an older
   policy than a live group of the same problem -> `superseded` (whichever arrived first);
6. reservoir capacity: beyond `replay_buffer_capacity` live rows the oldest arrivals -> `evicted`.

Whole episodes: every rule above drops an episode's segments together (the first offending segment's reason,
named in the others' detail; segments disagreeing on group_key or episode_reward -> `malformed`; the oldest
segment decides `stale`, the newest `future_policy`), and a batch takes all of an episode's segments or none
(`packing.keep_whole_episodes`).

Batch T (`make_batch(T)`): live rows with lag `(T-1) - policy_step` outside `[0, max_lag]` are dropped
`stale` first (rows the no-signal fill admitted without signal: `zero_variance` / `zero_advantage`, as in
rule 2). Eligible rows (live, used fewer than `max_samples_per_rollout` times) are ordered rows with signal first
(rows the no-signal fill admitted at advantage 0 only top a batch up), then by
policy step, oldest first (slow, long rollouts are not starved), and within one policy step by a seeded
weighted random key (Efraimidis-Spirakis, RNG seeded by (seed, T), so a rebuilt batch is the same):
weight `(1 + rank/n)^alpha`, rank 0 = oldest arrival, so alpha > 0 favours recent arrivals. Unpacked,
each of the first `batch_size` rows fills one batch row. Packed (`pack=True`), candidates are laid
next-fit into `batch_size` rows of `seq_len` tokens in priority order (each row takes as many as fit, always
leaving one candidate for every later row, so no row is all padding when enough candidates exist), then the
rows' leftover room is topped up first-fit from the next candidates. Segments of a row are contiguous from
position 0. A row is used at most once per batch. Not enough eligible rows -> `None` (the step waits for more files).

Batch row layout (schemas.BatchRow): segment k of a row holds `prompt ++ response`:
- `tokens`: the token ids; `segment_ids`: k on the segment, -1 on padding; `position_ids`: 0, 1, … from
  each segment's start (0 on padding). Attention must never cross segments (the learner masks by segment).
- `loss_mask`: 0 on prompt tokens and padding; on response tokens the rollout's `response_loss_mask`
  (1: the policy produced it; 0: tool output / environment turn).
- `advantages`: the rollout's advantage on every response token, 0 on prompt and padding.
- `generator_logprobs` **alignment convention**: `generator_logprobs[i]` is the sampler's log-probability
  of `tokens[i]` (the token *at* position i, predicted from position i-1), i.e. the rollout's
  `response_logprobs[j]` is put at the position of `response_tokens[j]`; 0 on prompt and padding. The
  learner computes logp(tokens[i] | tokens[<i]) from the logits at position i-1 and compares at i.
- per-segment lists indexed by segment id: `truncated` (the rollout hit its token limit, or was cut
  here), `temperatures`, `policy_steps`, `rollout_ids`, `source_files` (the lineage).
- every row is exactly `seq_len` tokens (one static shape for the learner's jit); `seq_len` must be a
  multiple of `pad_multiple` (checked when the BatchMaker is built: ConfigError naming the field).
- `reference_logprobs` is null: the learner computes reference logprobs on demand.

Modules: `staging` (per-file validation, grouping, advantages, overlong rule), `chunk` (the reservoir's per-file
buffers), `packing` (placement into rows and the batch table), `maker` (the `BatchMaker`: reservoir, drops,
staleness, batch selection).

The process loop around it lives here too and does the run root's I/O (no JAX); `steps/make_batches.py` runs its
phases: `loop` (`BatchMakerLoop`: one BatchMaker process's lease, pacing, gathering of committed rollout files,
commit of batch slots, curriculum and metrics), `loop_state` (its state between slots: `LoopState`, the slot log entry,
`SlotLost`, `StopRequested`, the cursor a restart recovers from), `scan` (`ScanWindow`: which policy folders are
listed for each slot, their seals and the late sweep), `slot_metrics` (the metrics record of each committed slot),
`step` (the step's phases around the loop: the lease, the slot loop and its stop conditions, signals, progress).
"""

from pipeline.batch_maker.maker import BatchMaker, IngestReport
from pipeline.batch_maker.packing import BatchResult

__all__ = ["BatchMaker", "BatchResult", "IngestReport"]
