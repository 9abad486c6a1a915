"""The BatchMaker: rollout rows in, fixed-shape training batches out. Pure in-memory logic.

No I/O and no JAX: the step `steps/make_batches.py` reads committed rollout files, feeds their Arrow
tables here, asks for batch T, and writes what comes back. Everything works on Arrow/numpy columns
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
   policy_step < T-1-max_lag (too old for slot T and every later slot) -> `stale`;
3. groups = rows of this file sharing (group_key, policy_step); advantages per group with the
   configured estimator (`pipeline.advantages`); with `filter_zero_variance`, a group whose rewards
   are all equal -> `zero_variance`, and a row whose own advantage is exactly 0 -> `zero_advantage`
   (unless the call says `admit_no_signal`: then they are admitted with advantage 0, counted in
   `IngestReport.admitted_no_signal`; the step does this when a slot cannot fill otherwise);
4. overlong (prompt + response > seq_len): rule `drop` -> `too_long`; rule `truncate` cuts the response
   to fit and marks the segment truncated (counted in `BatchResult.stats["n_cut_overlong"]`);
   a prompt that alone fills seq_len -> `too_long` under either rule;
5. latest-version retention per problem (env_name, example_id), among live rows: rows of an older
   policy than a live group of the same problem -> `superseded` (whichever arrived first);
6. reservoir capacity: beyond `replay_buffer_capacity` live rows the oldest arrivals -> `evicted`.

Batch T (`make_batch(T)`): live rows with lag `(T-1) - policy_step` outside `[0, max_lag]` are dropped
`stale` first. Eligible rows (live, used fewer than `max_samples_per_rollout` times) are ordered by
policy step, oldest first (slow, long rollouts are not starved), and within one policy step by a seeded
weighted random key (Efraimidis-Spirakis, RNG seeded by (seed, T), so a rebuilt batch is the same):
weight `(1 + rank/n)^alpha`, rank 0 = oldest arrival, so alpha > 0 favours recent arrivals. Unpacked,
each of the first `batch_size` rows fills one batch row. Packed (`pack=True`), candidates are laid
next-fit into `batch_size` rows of `seq_len` tokens in priority order (each row takes as many as fit, always
leaving one candidate for every later row, so no row is all padding when enough candidates exist), then the
rows' leftover room is topped up first-fit from the next candidates. Segments of a row are contiguous from
position 0. A row
is used at most once per batch. Not enough eligible rows -> `None` (the step waits for more files).

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
- `reference_logprobs` is null: the learner computes reference logprobs itself, on demand.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import staleness
from pipeline.advantages import estimator_for
from pipeline.config import ConfigError, TrainParams
from schemas.batch import BATCH
from schemas.dropped import DROP_REASONS, DROPPED

__all__ = ["BatchMaker", "BatchResult", "IngestReport", "lag_allowed"]

logger = logging.getLogger(__name__)

_TOP_UP_FACTOR = 2
"""Packing: how many leftover candidates per batch row the first-fit top-up tries."""
_LIST_COLUMNS = ("response_tokens", "response_logprobs", "token_rewards", "response_loss_mask")


def lag_allowed(slot: int, policy_step: int, max_lag: int) -> bool:
    """A rollout of policy P may be in batch T iff 0 <= (T-1) - P <= max_lag (`pipeline.staleness`)."""
    return staleness.allowed(slot, policy_step, max_lag)


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), vectorised (int64)."""
    lens = np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    excl = np.cumsum(lens) - lens
    return np.repeat(starts - excl, lens) + np.arange(total, dtype=np.int64)


def _list_parts(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat values, offsets into them, per-row null flags) of a list column, zero-copy where possible."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    nulls = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else np.zeros(len(arr), dtype=bool)
    return values, offsets, nulls


def _col(table: pa.Table, name: str, dtype: Any) -> np.ndarray:
    return np.asarray(table.column(name).to_numpy(), dtype=dtype)


def _segment_any(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per list row: whether any flag within [offsets[i], offsets[i+1]) is set."""
    n = offsets.shape[0] - 1
    if flags.shape[0] == 0 or n == 0 or not flags.any():
        return np.zeros(n, dtype=bool)
    csum = np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])
    return (csum[offsets[1:]] - csum[offsets[:-1]]) > 0


@dataclasses.dataclass
class IngestReport:
    """What `add_rollouts` did with one table: rows seen, admitted, and dropped per reason."""

    source_file: str
    rows: int
    admitted: int
    dropped: dict[str, int]
    rewards_sum: float
    n_groups: int
    filtered_groups: dict[str, int] = dataclasses.field(default_factory=dict)
    """Groups dropped whole, per reason (zero_variance)."""
    admitted_no_signal: int = 0
    """Admitted rows whose advantage is exactly 0 (only under `admit_no_signal`, or without filtering)."""


@dataclasses.dataclass
class BatchResult:
    """One built batch: the Arrow table (schemas.BATCH), its lineage and its statistics."""

    slot: int
    table: pa.Table
    rollout_ids: list[str]
    source_files: list[str]
    stats: dict[str, Any]


@dataclasses.dataclass
class _Chunk:
    """Live rows of one source file: metadata arrays plus compact flat token buffers."""

    source_file: str
    seq: int
    policy_step: int
    rows: np.ndarray  # int64 row index in the source file
    rollout_ids: pa.Array  # string
    problems: pa.Array  # string: env_name + '\x1f' + example_id
    group: np.ndarray  # int64 group code within the file
    reward: np.ndarray  # float64
    advantage: np.ndarray  # float32
    temperature: np.ndarray  # float32
    truncated: np.ndarray  # bool (rollout hit its limit, or cut to fit)
    cut: np.ndarray  # bool (cut to fit seq_len here)
    prompt_len: np.ndarray  # int64
    resp_len: np.ndarray  # int64 (after cutting)
    prompt_off: np.ndarray  # int64 starts into prompt_vals
    resp_off: np.ndarray  # int64 starts into resp_* values
    prompt_vals: np.ndarray  # int32
    resp_vals: np.ndarray  # int32
    logprob_vals: np.ndarray  # float32
    mask_vals: np.ndarray  # int8
    uses: np.ndarray  # int64
    alive: np.ndarray  # bool

    @property
    def n_alive(self) -> int:
        return int(self.alive.sum())

    def nbytes(self) -> int:
        """Bytes held by this chunk's arrays."""
        arrays = (self.rows, self.group, self.reward, self.advantage, self.temperature, self.truncated, self.cut,
                  self.prompt_len, self.resp_len, self.prompt_off, self.resp_off, self.prompt_vals, self.resp_vals,
                  self.logprob_vals, self.mask_vals, self.uses, self.alive)  # fmt: skip
        return sum(a.nbytes for a in arrays) + self.rollout_ids.nbytes + self.problems.nbytes

    def take(self, keep: np.ndarray) -> _Chunk:
        """A compact copy holding only rows `keep` (indices), token buffers re-gathered."""
        p_idx = _ranges(self.prompt_off[keep], self.prompt_len[keep])
        r_idx = _ranges(self.resp_off[keep], self.resp_len[keep])
        p_len, r_len = self.prompt_len[keep], self.resp_len[keep]
        keep_arr = pa.array(keep, type=pa.int64())
        return _Chunk(
            source_file=self.source_file,
            seq=self.seq,
            policy_step=self.policy_step,
            rows=self.rows[keep],
            rollout_ids=self.rollout_ids.take(keep_arr),
            problems=self.problems.take(keep_arr),
            group=self.group[keep],
            reward=self.reward[keep],
            advantage=self.advantage[keep],
            temperature=self.temperature[keep],
            truncated=self.truncated[keep],
            cut=self.cut[keep],
            prompt_len=p_len,
            resp_len=r_len,
            prompt_off=np.cumsum(p_len) - p_len,
            resp_off=np.cumsum(r_len) - r_len,
            prompt_vals=np.ascontiguousarray(self.prompt_vals[p_idx]),
            resp_vals=np.ascontiguousarray(self.resp_vals[r_idx]),
            logprob_vals=np.ascontiguousarray(self.logprob_vals[r_idx]),
            mask_vals=np.ascontiguousarray(self.mask_vals[r_idx]),
            uses=self.uses[keep],
            alive=self.alive[keep],
        )


class BatchMaker:
    """The in-memory BatchMaker (see the module docstring for every rule it applies).

    Deterministic: the same sequence of calls gives the same batches and drops. Not thread-safe.
    """

    def __init__(self, params: TrainParams) -> None:
        if params.seq_len % params.pad_multiple:
            raise ConfigError(
                "train.pad_multiple",
                params.pad_multiple,
                f"must divide train.seq_len={params.seq_len} (rows are seq_len long)",
            )
        self.params = params
        self._estimator = estimator_for(params.advantage_estimator)
        self._chunks: list[_Chunk] = []
        self._next_seq = 0
        self._drops: list[pa.Table] = []
        self._drop_counts: dict[str, int] = {}

    # ------------------------------------------------------------------ state
    @property
    def n_live(self) -> int:
        """Rollouts held in the reservoir (admitted, not used up, not dropped)."""
        return sum(c.n_alive for c in self._chunks)

    def nbytes(self) -> int:
        """Bytes held by the reservoir's arrays (what stays bounded by the window)."""
        return sum(c.nbytes() for c in self._chunks)

    def live_files(self) -> list[str]:
        """Source files that still have live rows, in arrival order."""
        return [c.source_file for c in self._chunks]

    def eligible(self, slot: int) -> tuple[int, int]:
        """(rows, tokens) usable in batch `slot` right now: live, within the lag window, uses left."""
        n = 0
        tokens = 0
        for c in self._chunks:
            if not lag_allowed(slot, c.policy_step, self.params.max_lag):
                continue
            ok = c.alive & (c.uses < self.params.max_samples_per_rollout)
            n += int(ok.sum())
            tokens += int((c.prompt_len[ok] + c.resp_len[ok]).sum())
        return n, tokens

    def ready(self, slot: int) -> bool:
        """Whether `make_batch(slot)` would return a batch now (enough eligible rows)."""
        return self.eligible(slot)[0] >= self.params.batch_size

    def wants_more(self, slot: int) -> bool:
        """Whether more rollouts would help batch `slot`: too few rows, or (packing) too few tokens to fill rows."""
        n, tokens = self.eligible(slot)
        if n < self.params.batch_size:
            return True
        return self.params.pack and tokens < self.params.batch_size * self.params.seq_len

    def snapshot(self) -> dict[str, Any]:
        """The reservoir as JSON: per live file its arrival seq, policy step, live row indices and use counts."""
        files = []
        for c in self._chunks:
            live = np.flatnonzero(c.alive)
            files.append(
                {
                    "path": c.source_file,
                    "seq": c.seq,
                    "policy_step": c.policy_step,
                    "rows": c.rows[live].tolist(),
                    "uses": c.uses[live].tolist(),
                }
            )
        return {"next_seq": self._next_seq, "files": files}

    # ------------------------------------------------------------------ drops
    def _drop(
        self,
        reason: str,
        source_file: str,
        rollout_ids: pa.Array,
        rows: np.ndarray,
        policy_steps: np.ndarray | int,
        detail: np.ndarray | str = "",
    ) -> None:
        n = len(rows)
        if n == 0:
            return
        assert reason in DROP_REASONS, reason
        ps = np.broadcast_to(np.asarray(policy_steps, dtype=np.int64), (n,))
        # lists, not object ndarrays: pa.array on an object ndarray imports pandas (seconds of process start)
        det = pa.array(detail.tolist() if isinstance(detail, np.ndarray) else [detail] * n, type=pa.string())
        self._drops.append(
            pa.table(
                {
                    "rollout_id": rollout_ids,
                    "source_file": pa.array([source_file] * n, type=pa.string()),
                    "row_index": pa.array(rows, type=pa.int64()),
                    "policy_step": pa.array(ps, type=pa.int64()),
                    "reason": pa.array([reason] * n, type=pa.string()),
                    "detail": det,
                }
            )
        )
        self._drop_counts[reason] = self._drop_counts.get(reason, 0) + n

    def take_dropped(self, slot: int) -> pa.Table:
        """Every drop since the last call, as a schemas.dropped.DROPPED table stamped with `slot`; then forget them."""
        if self._drops:
            t = pa.concat_tables(self._drops)
        else:
            t = DROPPED.arrow_schema().empty_table().drop_columns(["slot"])
        t = t.append_column("slot", pa.array(np.full(t.num_rows, slot, dtype=np.int64)))
        self._drops = []
        self._drop_counts = {}
        return DROPPED.conform(t, "<dropped>")

    @property
    def pending_drop_counts(self) -> dict[str, int]:
        """Drops per reason since the last `take_dropped`."""
        return dict(self._drop_counts)

    # ------------------------------------------------------------------ ingestion
    def _prepare(
        self, table: pa.Table, source_file: str, dir_policy_step: int | None, *, filter_no_signal: bool = True
    ) -> tuple[_Chunk, np.ndarray, np.ndarray, np.ndarray]:
        """Validate, group, score and measure all rows of one file (a pure function of the file and config).

        Returns the chunk over *all* rows, `reason` (object array, '' = admissible), `detail` and the rows'
        policy steps.
        Stale/future are not decided here (they depend on the slot).
        """
        n = table.num_rows
        reason = np.full(n, "", dtype=object)
        detail = np.full(n, "", dtype=object)

        def mark(mask: np.ndarray, why: str) -> None:
            sel = mask & (reason == "")
            reason[sel] = "malformed"
            detail[sel] = why

        p_vals, p_off, p_null = _list_parts(table.column("prompt_tokens"))
        parts = {name: _list_parts(table.column(name)) for name in _LIST_COLUMNS}
        r_vals, r_off, _ = parts["response_tokens"]
        lp_vals, lp_off, _ = parts["response_logprobs"]
        tr_vals, tr_off, _ = parts["token_rewards"]
        m_vals, _m_off, _ = parts["response_loss_mask"]
        any_null = p_null.copy()
        for name in _LIST_COLUMNS:
            any_null |= parts[name][2]
        mark(any_null, "a token list is null")
        lens = {name: np.diff(parts[name][1]) for name in _LIST_COLUMNS}
        same = np.ones(n, dtype=bool)
        for name in _LIST_COLUMNS[1:]:
            same &= lens[name] == lens["response_tokens"]
        bad_len = np.flatnonzero(~same & (reason == ""))
        for i in bad_len.tolist():
            reason[i] = "malformed"
            detail[i] = "lengths disagree: " + ", ".join(f"{k}={int(lens[k][i])}" for k in _LIST_COLUMNS)
        p_len = np.diff(p_off)
        mark(p_len <= 0, "prompt_tokens is empty")
        reward = _col(table, "episode_reward", np.float64)
        mark(~np.isfinite(reward), "episode_reward is not finite")
        mark(_segment_any(~np.isfinite(lp_vals), lp_off), "response_logprobs holds a non-finite value")
        mark(_segment_any(~np.isfinite(tr_vals), tr_off), "token_rewards holds a non-finite value")
        mark(_segment_any(p_vals < 0, p_off) | _segment_any(r_vals < 0, r_off), "negative token id")
        policy = _col(table, "policy_step", np.int64)
        mark(policy < 0, "policy_step is negative")
        if dir_policy_step is not None:
            mark(policy != dir_policy_step, f"policy_step differs from its folder's step {dir_policy_step}")
        temperature = _col(table, "temperature", np.float32)
        mark(~np.isfinite(temperature) | (temperature < 0), "temperature is not a finite value >= 0")
        rollout_ids = table.column("rollout_id").combine_chunks()
        group_keys = table.column("group_key").combine_chunks()
        mark(np.asarray(pc.equal(pc.utf8_length(rollout_ids), 0).to_numpy(zero_copy_only=False)), "empty rollout_id")
        mark(np.asarray(pc.equal(pc.utf8_length(group_keys), 0).to_numpy(zero_copy_only=False)), "empty group_key")

        # groups: (group_key, policy_step) among well-formed rows of this file
        ok = reason == ""
        codes = np.full(n, -1, dtype=np.int64)
        advantage = np.zeros(n, dtype=np.float64)
        if ok.any():
            gk = np.asarray(group_keys.dictionary_encode().indices.to_numpy(zero_copy_only=False), dtype=np.int64)
            p_rel = np.where(ok, policy, 0) - int(policy[ok].min())
            _, codes_all = np.unique(gk * (int(p_rel.max()) + 1) + p_rel, return_inverse=True)
            codes_all = codes_all.reshape(-1).astype(np.int64)
            codes[ok] = codes_all[ok]
            advantage[ok] = self._estimator(reward[ok], codes[ok])
            if self.params.filter_zero_variance and filter_no_signal:
                n_codes = int(codes_all.max()) + 1
                gmax = np.full(n_codes, -np.inf)
                gmin = np.full(n_codes, np.inf)
                np.maximum.at(gmax, codes[ok], reward[ok])
                np.minimum.at(gmin, codes[ok], reward[ok])
                zero_var = ok & (gmax == gmin)[np.maximum(codes, 0)]
                reason[zero_var] = "zero_variance"
                detail[zero_var] = "all rewards of the group are equal"
                zero_adv = (reason == "") & (advantage == 0.0)
                reason[zero_adv] = "zero_advantage"
                detail[zero_adv] = "advantage is exactly 0"

        # overlong
        r_len = np.diff(r_off)
        seq_len = self.params.seq_len
        total = p_len + r_len
        over = (reason == "") & (total > seq_len)
        cut = np.zeros(n, dtype=bool)
        if over.any():
            prompt_full = over & (p_len >= seq_len)
            reason[prompt_full] = "too_long"
            detail[prompt_full] = "the prompt alone fills seq_len"
            rest = over & ~prompt_full
            if self.params.overlong == "drop":
                reason[rest] = "too_long"
                detail[rest] = f"prompt + response exceed seq_len {seq_len} (overlong rule: drop)"
            else:
                cut = rest
                r_len = np.where(cut, seq_len - p_len, r_len)

        # problem key env_name + '\x1f' + example_id (pc.binary_join_element_wise costs seconds on first use)
        problems = pa.array(
            [
                f"{e}\x1f{x}"
                for e, x in zip(
                    table.column("env_name").to_pylist(), table.column("example_id").to_pylist(), strict=True
                )
            ],
            type=pa.string(),
        )
        truncated = np.asarray(table.column("truncated").to_numpy(), dtype=bool) | cut
        chunk = _Chunk(
            source_file=source_file,
            seq=-1,
            policy_step=int(dir_policy_step if dir_policy_step is not None else (policy.max() if n else 0)),
            rows=np.arange(n, dtype=np.int64),
            rollout_ids=rollout_ids,
            problems=problems,
            group=codes,
            reward=reward,
            advantage=advantage.astype(np.float32),
            temperature=temperature,
            truncated=truncated,
            cut=cut,
            prompt_len=p_len.astype(np.int64),
            resp_len=r_len.astype(np.int64),
            prompt_off=p_off[:-1],
            resp_off=r_off[:-1],
            prompt_vals=np.asarray(p_vals, dtype=np.int32),
            resp_vals=np.asarray(r_vals, dtype=np.int32),
            logprob_vals=np.asarray(lp_vals, dtype=np.float32),
            mask_vals=np.asarray(m_vals, dtype=np.int8),
            uses=np.zeros(n, dtype=np.int64),
            alive=np.zeros(n, dtype=bool),
        )
        return chunk, reason, detail, policy

    def add_rollouts(
        self,
        table: pa.Table,
        source_file: str,
        *,
        slot: int,
        latest_policy: int,
        dir_policy_step: int | None = None,
        admit_no_signal: bool = False,
    ) -> IngestReport:
        """Feed one rollout file's table (schemas.ROLLOUT columns) while building batch `slot`.

        `latest_policy`: the newest policy the learner has published (newer claims are `future_policy`).
        `dir_policy_step`: the policy step of the folder the file came from (rows must agree), if known.
        `admit_no_signal`: admit zero-variance groups and zero-advantage rows (advantage 0) instead of dropping them.
        Every row is admitted or dropped with a reason (see the module docstring).
        """
        chunk, reason, detail, policy = self._prepare(
            table, source_file, dir_policy_step, filter_no_signal=not admit_no_signal
        )
        n = table.num_rows
        ok = reason == ""
        future = ok & (policy > latest_policy)
        reason[future] = "future_policy"
        detail[future] = f"newest published policy is {latest_policy}"
        low = staleness.oldest_allowed_policy(slot, self.params.max_lag)
        stale = (reason != "malformed") & (reason != "future_policy") & (policy < low)
        reason[stale] = "stale"
        detail[stale] = f"lag > max_lag {self.params.max_lag} for batch {slot}"
        admit = reason == ""

        # latest-version retention among live rows (policy is one value per admitted file: the folder's)
        if admit.any():
            admit_idx = np.flatnonzero(admit)
            pols = np.unique(policy[admit_idx])
            for p in pols.tolist():
                sel = admit_idx[policy[admit_idx] == p]
                probs = chunk.problems.take(pa.array(sel)).unique()
                for c in self._chunks:
                    if c.policy_step == p:
                        continue
                    if c.policy_step < p:
                        hit = c.alive & np.asarray(pc.is_in(c.problems, value_set=probs).to_numpy(zero_copy_only=False))
                        if hit.any():
                            self._kill(c, hit, "superseded", f"a group of policy {p} for the same problem arrived")
                    else:
                        live_probs = c.problems.filter(pa.array(c.alive)).unique()
                        mine = np.asarray(
                            pc.is_in(chunk.problems.take(pa.array(sel)), value_set=live_probs).to_numpy(
                                zero_copy_only=False
                            )
                        )
                        reason[sel[mine]] = "superseded"
                        detail[sel[mine]] = f"a live group of newer policy {c.policy_step} exists for the problem"
            self._chunks = [c for c in self._chunks if c.alive.any()]
            admit = reason == ""

        counts: dict[str, int] = {}
        for r in np.unique(reason[~admit]).tolist() if (~admit).any() else []:
            sel = np.flatnonzero(reason == r)
            counts[str(r)] = len(sel)
            self._drop(
                str(r),
                source_file,
                chunk.rollout_ids.take(pa.array(sel)),
                sel,
                policy[sel],
                detail[sel].astype(str).astype(object),
            )
        n_groups = len(np.unique(chunk.group[admit])) if admit.any() else 0
        zv = reason == "zero_variance"
        filtered = {"zero_variance": len(np.unique(chunk.group[zv]))} if zv.any() else {}
        if admit.any():
            chunk.alive = admit.copy()
            chunk.seq = self._next_seq
            self._next_seq += 1
            keep = np.flatnonzero(admit)
            self._chunks.append(chunk.take(keep) if len(keep) < n else chunk)
            self._evict_over_capacity()
        finite = np.isfinite(chunk.reward)
        return IngestReport(
            source_file=source_file,
            rows=n,
            admitted=int(admit.sum()),
            dropped=counts,
            rewards_sum=float(chunk.reward[finite].sum()),
            n_groups=n_groups,
            filtered_groups=filtered,
            admitted_no_signal=int((admit & (chunk.advantage == 0.0)).sum()),
        )

    def restore_file(self, table: pa.Table, source_file: str, *, seq: int, policy_step: int,
                     rows: Iterable[int], uses: Iterable[int]) -> None:  # fmt: skip
        """Rebuild one live file of a `snapshot()`: re-derive its rows and keep exactly `rows` with their `uses`."""
        chunk, _, _, _ = self._prepare(table, source_file, policy_step)
        keep = np.asarray(list(rows), dtype=np.int64)
        use = np.asarray(list(uses), dtype=np.int64)
        if keep.shape != use.shape:
            raise ValueError(f"snapshot of {source_file}: {keep.shape[0]} rows but {use.shape[0]} use counts")
        if keep.size and (keep.min() < 0 or keep.max() >= table.num_rows):
            raise ValueError(f"snapshot of {source_file} names rows outside 0..{table.num_rows - 1}")
        chunk.seq = seq
        chunk.policy_step = policy_step
        restored = chunk.take(keep)
        restored.uses = use
        restored.alive = use < self.params.max_samples_per_rollout
        if restored.alive.any():
            self._chunks.append(restored)
            self._chunks.sort(key=lambda c: c.seq)
        self._next_seq = max(self._next_seq, seq + 1)

    def set_next_seq(self, next_seq: int) -> None:
        """Continue arrival numbering after a restore (from `snapshot()['next_seq']`)."""
        self._next_seq = max(self._next_seq, next_seq)

    def _kill(self, c: _Chunk, mask: np.ndarray, reason: str, detail: str) -> None:
        idx = np.flatnonzero(mask & c.alive)
        if idx.size == 0:
            return
        self._drop(reason, c.source_file, c.rollout_ids.take(pa.array(idx)), c.rows[idx], c.policy_step, detail)
        c.alive[idx] = False

    def _evict_over_capacity(self) -> None:
        excess = self.n_live - self.params.replay_buffer_capacity
        for c in self._chunks:  # arrival order: oldest first
            if excess <= 0:
                break
            idx = np.flatnonzero(c.alive)[:excess]
            mask = np.zeros(len(c.alive), dtype=bool)
            mask[idx] = True
            self._kill(c, mask, "evicted", f"reservoir over capacity {self.params.replay_buffer_capacity}")
            excess -= len(idx)
        self._compact()

    def _compact(self) -> None:
        """Forget chunks without live rows; shrink chunks that are mostly dead."""
        out = []
        for c in self._chunks:
            alive = int(c.alive.sum())
            if alive == 0:
                continue
            if alive * 2 < len(c.alive) and len(c.alive) >= 16:
                c = c.take(np.flatnonzero(c.alive))
            out.append(c)
        self._chunks = out

    def drop_stale(self, slot: int) -> int:
        """Drop live rows too old for batch `slot` (and hence every later slot); return how many."""
        low = staleness.oldest_allowed_policy(slot, self.params.max_lag)
        n = 0
        for c in self._chunks:
            if c.policy_step < low:
                n += c.n_alive
                self._kill(c, c.alive, "stale", f"lag > max_lag {self.params.max_lag} for batch {slot}")
        self._compact()
        return n

    # ------------------------------------------------------------------ batches
    def make_batch(self, slot: int) -> BatchResult | None:
        """Build batch `slot` from the reservoir, or None if too few eligible rows (nothing is changed then,
        except that stale rows are dropped). Marks one use on every row it puts in the batch."""
        params = self.params
        self.drop_stale(slot)
        cands = [(ci, c) for ci, c in enumerate(self._chunks) if lag_allowed(slot, c.policy_step, params.max_lag)]
        if not cands:
            return None
        c_idx = np.concatenate([np.full(len(c.alive), ci, dtype=np.int64) for ci, c in cands])
        r_idx = np.concatenate([np.arange(len(c.alive), dtype=np.int64) for _, c in cands])
        ok = np.concatenate([c.alive & (c.uses < params.max_samples_per_rollout) for _, c in cands])
        if int(ok.sum()) < params.batch_size:
            return None
        c_idx, r_idx = c_idx[ok], r_idx[ok]
        pstep = np.concatenate([np.full(len(c.alive), c.policy_step, dtype=np.int64) for _, c in cands])[ok]
        length = np.concatenate([c.prompt_len + c.resp_len for _, c in cands])[ok]
        n = len(c_idx)
        # arrival order is (chunk seq, row): chunks are kept in seq order, so position = rank from oldest
        rank = np.arange(n, dtype=np.float64)
        weight = (1.0 + rank / n) ** params.replay_buffer_alpha
        rng = np.random.default_rng([params.seed, slot])
        u = rng.random(n)
        key = np.log(np.maximum(u, 1e-300)) / weight  # Efraimidis-Spirakis: larger key first
        order = np.lexsort((-key, pstep))
        rows_of, offs_of = self._place(length[order])
        chosen = order[rows_of >= 0]
        row = rows_of[rows_of >= 0]
        off = offs_of[rows_of >= 0]
        return self._build(slot, cands, c_idx[chosen], r_idx[chosen], row, off)

    def _place(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row and offset for each candidate (in priority order); row -1 = not placed."""
        B, S = self.params.batch_size, self.params.seq_len
        k = len(lengths)
        rows = np.full(k, -1, dtype=np.int64)
        offs = np.zeros(k, dtype=np.int64)
        if not self.params.pack:
            m = min(B, k)
            rows[:m] = np.arange(m)
            return rows, offs
        # Next-fit in priority order, vectorised per row (searchsorted on the running length), leaving at
        # least one candidate for every later row; then a first-fit top-up of the rows' leftover room from
        # the next candidates in priority order (at most TOP_UP_FACTOR * B of them are tried).
        lens = lengths.astype(np.int64)
        cs = np.concatenate([[0], np.cumsum(lens)])
        fill = np.zeros(B, dtype=np.int64)
        i = 0
        for r in range(B):
            if i >= k:
                break
            limit = k - (B - r - 1)
            j = int(np.searchsorted(cs, cs[i] + S, side="right")) - 1
            j = max(min(j, limit), i + 1)
            rows[i:j] = r
            offs[i:j] = cs[i:j] - cs[i]
            fill[r] = cs[j] - cs[i]
            i = j
        if i < k:
            room = (S - fill).tolist()
            shortest = int(lens[i:].min())
            open_rows = [r for r in range(B) if room[r] >= shortest]
            for c in range(i, min(k, i + _TOP_UP_FACTOR * B)):
                if not open_rows:
                    break
                ln = int(lens[c])
                for pos, r in enumerate(open_rows):
                    if ln <= room[r]:
                        rows[c] = r
                        offs[c] = S - room[r]
                        room[r] -= ln
                        if room[r] < shortest:
                            del open_rows[pos]
                        break
        return rows, offs

    def _build(
        self,
        slot: int,
        cands: list[tuple[int, _Chunk]],
        c_idx: np.ndarray,
        r_idx: np.ndarray,
        row: np.ndarray,
        off: np.ndarray,
    ) -> BatchResult:
        params = self.params
        B = params.batch_size
        # segment order: by (row, offset); segment id = rank within its row
        seg_order = np.lexsort((off, row))
        c_idx, r_idx, row, off = c_idx[seg_order], r_idx[seg_order], row[seg_order], off[seg_order]
        k = len(c_idx)
        seg_count = np.bincount(row, minlength=B)
        seg_start = np.cumsum(seg_count) - seg_count
        seg_id = np.arange(k, dtype=np.int64) - seg_start[row]

        chunk_of = dict(cands)
        p_len = np.empty(k, dtype=np.int64)
        r_len = np.empty(k, dtype=np.int64)
        for ci in np.unique(c_idx).tolist():
            sel = c_idx == ci
            c = chunk_of[ci]
            p_len[sel] = c.prompt_len[r_idx[sel]]
            r_len[sel] = c.resp_len[r_idx[sel]]
        seg_len = p_len + r_len
        L = params.seq_len

        # Rows are filled contiguously from position 0 (segments sorted by (row, offset), no gaps), so the
        # non-padding positions in row-major order are exactly the concatenation of the segments: build that
        # "content" once (n_content = real tokens), then scatter it with one boolean mask per column.
        n_content = int(seg_len.sum())
        seg_start = np.cumsum(seg_len) - seg_len
        c_tok = np.empty(n_content, dtype=np.int32)
        c_mask = np.zeros(n_content, dtype=np.int8)
        c_lp = np.zeros(n_content, dtype=np.float32)
        c_adv = np.zeros(n_content, dtype=np.float32)
        seg_adv = np.empty(k, dtype=np.float32)
        seg_reward = np.empty(k, dtype=np.float64)
        seg_temp = np.empty(k, dtype=np.float32)
        seg_trunc = np.empty(k, dtype=bool)
        seg_cut = np.empty(k, dtype=bool)
        seg_pol = np.empty(k, dtype=np.int64)
        seg_group = np.empty(k, dtype=np.int64)
        ids_parts: list[tuple[np.ndarray, pa.Array]] = []
        files = np.empty(k, dtype=object)

        for ci in np.unique(c_idx).tolist():
            sel = np.flatnonzero(c_idx == ci)
            c = chunk_of[ci]
            ri = r_idx[sel]
            d, pl, rl = seg_start[sel], p_len[sel], r_len[sel]
            c_tok[_ranges(d, pl)] = c.prompt_vals[_ranges(c.prompt_off[ri], pl)]
            r_src = _ranges(c.resp_off[ri], rl)
            r_dst = _ranges(d + pl, rl)
            c_tok[r_dst] = c.resp_vals[r_src]
            c_mask[r_dst] = c.mask_vals[r_src]
            c_lp[r_dst] = c.logprob_vals[r_src]
            c_adv[r_dst] = np.repeat(c.advantage[ri], rl)
            seg_adv[sel] = c.advantage[ri]
            seg_reward[sel] = c.reward[ri]
            seg_temp[sel] = c.temperature[ri]
            seg_trunc[sel] = c.truncated[ri]
            seg_cut[sel] = c.cut[ri]
            seg_pol[sel] = c.policy_step
            seg_group[sel] = ci * (1 << 32) + c.group[ri]
            files[sel] = c.source_file
            ids_parts.append((sel, c.rollout_ids.take(pa.array(ri))))
            c.uses[ri] += 1
            c.alive[ri] = c.uses[ri] < params.max_samples_per_rollout
        row_len = np.bincount(row, weights=seg_len, minlength=B).astype(np.int64)
        filled = (np.arange(L, dtype=np.int64)[None, :] < row_len[:, None]).reshape(-1)

        def spread(content: np.ndarray, fill: float | int, dtype: Any) -> np.ndarray:
            out = np.zeros(B * L, dtype=dtype) if fill == 0 else np.full(B * L, fill, dtype=dtype)
            out[filled] = content
            return out

        tokens = spread(c_tok, 0, np.int32)
        loss_mask = spread(c_mask, 0, np.int8)
        gen_lp = spread(c_lp, 0.0, np.float32)
        advantages = spread(c_adv, 0.0, np.float32)
        segment_ids = spread(np.repeat(seg_id.astype(np.int32), seg_len), -1, np.int32)
        pos = np.arange(n_content, dtype=np.int32) - np.repeat(seg_start.astype(np.int32), seg_len)
        position_ids = spread(pos, 0, np.int32)
        order = np.concatenate([sel for sel, _ in ids_parts])
        ids_arr = pa.concat_arrays([arr for _, arr in ids_parts]).take(pa.array(np.argsort(order)))
        self._compact()

        tok_offsets = pa.array(np.arange(B + 1, dtype=np.int32) * L, type=pa.int32())
        seg_offsets = pa.array(np.concatenate([[0], np.cumsum(seg_count)]).astype(np.int32), type=pa.int32())

        def fixed(values: np.ndarray, typ: pa.DataType) -> pa.Array:
            return pa.ListArray.from_arrays(tok_offsets, pa.array(values, type=typ))

        def per_seg(values: Any, typ: pa.DataType) -> pa.Array:
            if isinstance(values, np.ndarray) and values.dtype == object:
                values = values.tolist()  # an object ndarray would make pyarrow import pandas
            return pa.ListArray.from_arrays(seg_offsets, pa.array(values, type=typ))

        table = pa.Table.from_arrays(
            [
                fixed(tokens, pa.int32()),
                fixed(loss_mask, pa.int8()),
                fixed(segment_ids, pa.int32()),
                fixed(position_ids, pa.int32()),
                fixed(advantages, pa.float32()),
                fixed(gen_lp, pa.float32()),
                pa.nulls(B, type=pa.list_(pa.float32())),
                per_seg(seg_trunc, pa.bool_()),
                per_seg(seg_temp, pa.float32()),
                per_seg(seg_pol, pa.int64()),
                pa.ListArray.from_arrays(seg_offsets, ids_arr),
                per_seg(files, pa.string()),
            ],
            schema=BATCH.arrow_schema(),
        )
        lag = staleness.lags(slot, seg_pol)
        n_tokens = int(seg_len.sum())
        n_loss = int(loss_mask.sum())
        stats: dict[str, Any] = {
            "slot": slot,
            "rows": B,
            "row_len": L,
            "n_rollouts": k,
            "n_groups": len(np.unique(seg_group)),
            "lag_min": int(lag.min()),
            "lag_mean": float(lag.mean()),
            "lag_max": int(lag.max()),
            "policy_step_min": int(seg_pol.min()),
            "policy_step_max": int(seg_pol.max()),
            "reward_mean": float(seg_reward.mean()),
            "advantage_mean": float(seg_adv.mean()),
            "advantage_std": float(seg_adv.std()),
            "advantage_abs_mean": float(np.abs(seg_adv).mean()),
            "advantage_min": float(seg_adv.min()),
            "advantage_max": float(seg_adv.max()),
            "tokens": n_tokens,
            "loss_tokens": n_loss,
            "padding_fraction": 1.0 - n_tokens / float(B * L),
            "segments_per_row": k / float(B),
            "n_truncated": int(seg_trunc.sum()),
            "n_cut_overlong": int(seg_cut.sum()),
            "max_uses": int(params.max_samples_per_rollout),
        }
        return BatchResult(
            slot=slot, table=table, rollout_ids=ids_arr.to_pylist(), source_files=files.tolist(), stats=stats
        )
