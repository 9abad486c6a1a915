"""The `BatchMaker`: the reservoir of admitted rollout rows, every drop with its reason, and batch selection.

The rules it applies are stated in the package docstring (`pipeline.batch_maker`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.batch_maker.advantages import estimator_for
from pipeline.batch_maker.chunk import NO_SIGNAL_DETAILS, NO_SIGNAL_REASONS, Chunk
from pipeline.batch_maker.packing import BatchResult, build_batch, keep_whole_episodes, place
from pipeline.batch_maker.staging import Staged, spread_over_episodes, stage
from pipeline.config import TrainParams
from pipeline.store import staleness
from schemas.dropped import DROP_REASONS, DROPPED

logger = logging.getLogger(__name__)

KEPT_BEFORE_STALE = ("malformed", "future_policy", "zero_variance", "zero_advantage")
"""Drop reasons a row keeps when it is also too old for the slot: a malformed row or a row of a future policy is
that first, and a row without learning signal (`zero_variance`, `zero_advantage`) could not have been trained even
when fresh, so counting it `stale` would blame the lag for rows the task's difficulty cost."""


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
    fresh_zero_variance_groups: int = 0
    """Groups of `filtered_groups["zero_variance"]` young enough for the slot: a file whose groups were all
    filtered for want of signal *within* the lag window is what `train.no_signal_fill_after` counts (a file too
    old for the slot could not fill it either way)."""

    @property
    def without_signal(self) -> bool:
        """Whether this file counts toward the slot's no-signal fill (`train.no_signal_fill_after`): nothing admitted,
        and groups young enough for the slot filtered for want of signal. The live BatchMaker and its rebuild count
        files by this one rule, so a rebuilt slot starts its fill where the live one did."""
        return self.admitted == 0 and self.fresh_zero_variance_groups > 0


def recency_weights(n: int, alpha: float) -> np.ndarray:
    """The sampling weight of each of `n` candidates by arrival rank (0 = oldest): `(1 + rank / n) ** alpha`
    (`train.replay_buffer_alpha`; 0: every weight 1, uniform)."""
    rank = np.arange(n, dtype=np.float64)
    return np.asarray((1.0 + rank / max(n, 1)) ** alpha, dtype=np.float64)


def selection_keys(n: int, alpha: float, seed: int, slot: int) -> np.ndarray:
    """The seeded random key of each of `n` candidates (arrival rank order) for batch `slot`: candidates are taken
    larger key first (Efraimidis-Spirakis weighted sampling without replacement), so the first one taken is
    candidate i with probability `recency_weights(n, alpha)[i] / sum(weights)`. The RNG is seeded by
    (`seed`, `slot`), so a rebuilt batch draws the same keys."""
    weight = recency_weights(n, alpha)
    u = np.random.default_rng([seed, slot]).random(n)
    return np.asarray(np.log(np.maximum(u, 1e-300)) / weight, dtype=np.float64)


class BatchMaker:
    """The in-memory BatchMaker (see the package docstring for every rule it applies).

    Deterministic: the same sequence of calls gives the same batches and drops. Not thread-safe.
    `params` are taken as validated (`pipeline.config.validate.validate_train`, run at program start and job build).
    """

    def __init__(self, params: TrainParams) -> None:
        self.params = params
        self._estimator = estimator_for(params.advantage_estimator)
        self._chunks: list[Chunk] = []
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
            if not staleness.allowed(slot, c.policy_step, self.params.max_lag):
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

    # ------------------------------------------------------------------ ingestion
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
        Every row is admitted or dropped with a reason (see the package docstring).
        """
        st = stage(
            table, source_file, dir_policy_step, self.params, self._estimator, filter_no_signal=not admit_no_signal
        )
        too_old = self._refuse_for_slot(st, slot, latest_policy)
        spread_over_episodes(st.reason, st.detail, st.chunk.episode)  # the oldest (newest) segment decides
        if (st.reason == "").any():
            self._retain_latest(st)
            spread_over_episodes(st.reason, st.detail, st.chunk.episode)
        admit = st.reason == ""
        counts = self._record_drops(st, ~admit)
        chunk = st.chunk
        n_groups = len(np.unique(chunk.group[admit])) if admit.any() else 0
        zv = st.reason == "zero_variance"
        filtered = {"zero_variance": len(np.unique(chunk.group[zv]))} if zv.any() else {}
        fresh_zv = zv & ~too_old
        if admit.any():
            chunk.alive = admit.copy()
            chunk.seq = self._next_seq
            self._next_seq += 1
            keep = np.flatnonzero(admit)
            self._chunks.append(chunk.take(keep) if len(keep) < table.num_rows else chunk)
            self._evict_over_capacity()
        finite = np.isfinite(chunk.reward)
        return IngestReport(
            source_file=source_file,
            rows=table.num_rows,
            admitted=int(admit.sum()),
            dropped=counts,
            rewards_sum=float(chunk.reward[finite].sum()),
            n_groups=n_groups,
            filtered_groups=filtered,
            admitted_no_signal=int((admit & (chunk.advantage == 0.0)).sum()),
            fresh_zero_variance_groups=len(np.unique(chunk.group[fresh_zv])) if fresh_zv.any() else 0,
        )

    def _refuse_for_slot(self, st: Staged, slot: int, latest_policy: int) -> np.ndarray:
        """Mark rows of a policy newer than `latest_policy` (`future_policy`) or too old for `slot` (`stale`, unless
        staging gave them a reason in `KEPT_BEFORE_STALE`), whole episodes at a time; return which rows are too old
        for `slot` (whatever their reason)."""
        reason, detail = st.reason, st.detail
        # an episode's segments share one verdict: its newest segment decides `future_policy`, its oldest `stale`
        episode = st.chunk.episode
        n_ep = int(episode.max()) + 1 if len(episode) else 0
        newest = np.full(n_ep, np.iinfo(np.int64).min, dtype=np.int64)
        oldest = np.full(n_ep, np.iinfo(np.int64).max, dtype=np.int64)
        np.maximum.at(newest, episode, st.policy)
        np.minimum.at(oldest, episode, st.policy)
        policy = oldest[episode]
        future = (reason == "") & (newest[episode] > latest_policy)
        reason[future] = "future_policy"
        detail[future] = f"newest published policy is {latest_policy}"
        low = staleness.oldest_allowed_policy(slot, self.params.max_lag)
        old = policy < low
        # a row without learning signal (its group's rewards all equal, or its own advantage 0) could never have
        # been trained, fresh or not: its verdict stays `zero_variance` / `zero_advantage` (also when the no-signal
        # fill would have admitted it), so `stale` counts only rows that the lag alone cost
        lag = f"lag > max_lag {self.params.max_lag} for batch {slot}"
        for code in (1, 2):
            sel = old & (reason == "") & (st.chunk.no_signal == code)
            reason[sel] = NO_SIGNAL_REASONS[code]
            detail[sel] = f"{NO_SIGNAL_DETAILS[code]}; too old for the no-signal fill ({lag})"
        stale = ~np.isin(reason, KEPT_BEFORE_STALE) & old
        reason[stale] = "stale"
        detail[stale] = lag
        return old

    def _retain_latest(self, st: Staged) -> None:
        """Latest-version retention per problem among live rows: the older policy's rows are `superseded`
        (live reservoir rows are killed; rows of this file are marked). A file's admitted rows share one policy."""
        reason, detail, policy, chunk = st.reason, st.detail, st.policy, st.chunk
        admit_idx = np.flatnonzero(reason == "")
        for p in np.unique(policy[admit_idx]).tolist():
            sel = admit_idx[policy[admit_idx] == p]
            mine_probs = chunk.problems.take(pa.array(sel))
            probs = mine_probs.unique()
            for c in self._chunks:
                if c.policy_step == p:
                    continue
                if c.policy_step < p:
                    hit = c.alive & np.asarray(pc.is_in(c.problems, value_set=probs).to_numpy(zero_copy_only=False))
                    if hit.any():
                        self._kill(c, hit, "superseded", f"a group of policy {p} for the same problem arrived")
                else:
                    live_probs = c.problems.filter(pa.array(c.alive)).unique()
                    mine = np.asarray(pc.is_in(mine_probs, value_set=live_probs).to_numpy(zero_copy_only=False))
                    reason[sel[mine]] = "superseded"
                    detail[sel[mine]] = f"a live group of newer policy {c.policy_step} exists for the problem"
        self._chunks = [c for c in self._chunks if c.alive.any()]

    def _record_drops(self, st: Staged, dropped: np.ndarray) -> dict[str, int]:
        """Record the drops of one staged file (rows `dropped`), per reason; return the counts."""
        counts: dict[str, int] = {}
        for r in np.unique(st.reason[dropped]).tolist() if dropped.any() else []:
            sel = np.flatnonzero(st.reason == r)
            counts[str(r)] = len(sel)
            self._drop(
                str(r),
                st.chunk.source_file,
                st.chunk.rollout_ids.take(pa.array(sel)),
                sel,
                st.policy[sel],
                st.detail[sel].astype(str).astype(object),
            )
        return counts

    def restore_file(self, table: pa.Table, source_file: str, *, seq: int, policy_step: int,
                     rows: Iterable[int], uses: Iterable[int]) -> None:  # fmt: skip
        """Rebuild one live file of a `snapshot()`: re-derive its rows and keep exactly `rows` with their `uses`."""
        chunk = stage(table, source_file, policy_step, self.params, self._estimator).chunk
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

    def _kill(self, c: Chunk, mask: np.ndarray, reason: str, detail: str) -> None:
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
            # whole episodes: the episodes of the oldest rows go with all their segments
            mask = c.alive & np.isin(c.episode, c.episode[idx])
            self._kill(c, mask, "evicted", f"reservoir over capacity {self.params.replay_buffer_capacity}")
            excess -= int(mask.sum())
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
        """Drop live rows too old for batch `slot` (and hence every later slot); return how many. Rows the no-signal
        fill admitted without learning signal go as `zero_variance` / `zero_advantage`, the rest as `stale`."""
        low = staleness.oldest_allowed_policy(slot, self.params.max_lag)
        lag = f"lag > max_lag {self.params.max_lag} for batch {slot}"
        n = 0
        for c in self._chunks:
            if c.policy_step < low:
                n += c.n_alive
                for code in (1, 2):
                    why = f"{NO_SIGNAL_DETAILS[code]}; admitted by the no-signal fill, then too old ({lag})"
                    self._kill(c, c.no_signal == code, NO_SIGNAL_REASONS[code], why)
                self._kill(c, c.alive, "stale", lag)
        self._compact()
        return n

    # ------------------------------------------------------------------ batches
    def make_batch(self, slot: int) -> BatchResult | None:
        """Build batch `slot` from the reservoir, or None if too few eligible rows (nothing is changed then,
        except that stale rows are dropped). Marks one use on every row it puts in the batch."""
        params = self.params
        self.drop_stale(slot)
        cands = [(ci, c) for ci, c in enumerate(self._chunks) if staleness.allowed(slot, c.policy_step, params.max_lag)]
        if not cands:
            return None
        c_idx = np.concatenate([np.full(len(c.alive), ci, dtype=np.int64) for ci, c in cands])
        r_idx = np.concatenate([np.arange(len(c.alive), dtype=np.int64) for _, c in cands])
        ok = np.concatenate([c.alive & (c.uses < params.max_samples_per_rollout) for _, c in cands])
        if int(ok.sum()) < params.batch_size:
            return None
        c_idx, r_idx = c_idx[ok], r_idx[ok]
        pstep = np.concatenate([np.full(len(c.alive), c.policy_step, dtype=np.int64) for _, c in cands])[ok]
        # rows the no-signal fill admitted (advantage 0) only top a batch up: rows with signal go first, whatever
        # their policy step, so a slot that fills without signal trains every row with signal it has
        idle = np.concatenate([c.no_signal != 0 for _, c in cands])[ok]
        length = np.concatenate([c.prompt_len + c.resp_len for _, c in cands])[ok]
        n = len(c_idx)
        # arrival order is (chunk seq, row): chunks are kept in seq order, so position = rank from oldest
        key = selection_keys(n, params.replay_buffer_alpha, params.seed, slot)
        episode = np.concatenate([c.episode for _, c in cands])[ok] + (c_idx << 32)
        _, ep_first, ep_code = np.unique(episode, return_index=True, return_inverse=True)
        whole = len(ep_first) == n  # every candidate is an episode of its own (no split episodes)
        if whole:
            order = np.lexsort((-key, pstep, idle))
        else:
            # an episode is one candidate: its segments share its first segment's key and stay adjacent, in file order
            ep_code = ep_code.reshape(-1)
            key = key[ep_first][ep_code]
            order = np.lexsort((r_idx, ep_code, -key, pstep, idle))
        rows_of, offs_of = place(length[order], params.batch_size, params.seq_len, params.pack)
        if not whole:
            keep_whole_episodes(length[order], episode[order], rows_of, offs_of, params.batch_size, params.seq_len,
                                params.pack)  # fmt: skip
        placed = rows_of >= 0
        if not placed.any():
            return None
        chosen = order[placed]
        result = build_batch(slot, cands, c_idx[chosen], r_idx[chosen], rows_of[placed], offs_of[placed], params)
        self._compact()
        return result
