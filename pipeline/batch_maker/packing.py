"""Placing chosen rollouts into batch rows and building the batch table (schemas.BATCH) with its statistics.

`place` decides row and offset per candidate (unpacked: one candidate per row; packed: next-fit then a first-fit
top-up); `build_batch` lays the segments out contiguously from position 0 of each row, marks one use on every
row it takes from the reservoir, and returns a `BatchResult`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.batch_maker.arrays import ranges
from pipeline.batch_maker.chunk import Chunk
from pipeline.config import TrainParams
from pipeline.store import staleness
from schemas.batch import BATCH

TOP_UP_FACTOR = 2
"""Packing: how many leftover candidates per batch row the first-fit top-up tries."""


@dataclasses.dataclass
class BatchResult:
    """One built batch: the Arrow table (schemas.BATCH), its lineage and its statistics."""

    slot: int
    table: pa.Table
    rollout_ids: list[str]
    source_files: list[str]
    stats: dict[str, Any]


def place(lengths: np.ndarray, batch_size: int, seq_len: int, pack: bool) -> tuple[np.ndarray, np.ndarray]:
    """Row and offset for each candidate (in priority order); row -1 = not placed."""
    B, S = batch_size, seq_len
    k = len(lengths)
    rows = np.full(k, -1, dtype=np.int64)
    offs = np.zeros(k, dtype=np.int64)
    if not pack:
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
        _top_up(lens, i, (S - fill).tolist(), rows, offs, B, S)
    return rows, offs


def _top_up(lens: np.ndarray, start: int, room: list[int], rows: np.ndarray, offs: np.ndarray, B: int, S: int) -> None:
    """First-fit of candidates `start`, `start+1`, ... into the rows' leftover `room` (rows/offs updated in place)."""
    k = len(lens)
    shortest = int(lens[start:].min())
    open_rows = [r for r in range(B) if room[r] >= shortest]
    for c in range(start, min(k, start + TOP_UP_FACTOR * B)):
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


def keep_whole_episodes(
    lengths: np.ndarray, episode: np.ndarray, rows: np.ndarray, offs: np.ndarray, B: int, S: int, pack: bool
) -> None:
    """Make a `place` result whole-episode, in place: an episode (candidates sharing `episode`, adjacent in
    priority order) is in the batch with all its segments or not at all.

    An episode `place` took only part of is taken out; then the room left (free rows unpacked; leftover tokens per
    row packed) is topped up first-fit with episodes not placed, in priority order, each only if all its segments
    fit (at most TOP_UP_FACTOR * B episodes are tried). Segments of one episode may sit in different rows.
    """
    placed = rows >= 0
    _, first, inv, n_seg = np.unique(episode, return_index=True, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    n_placed = np.bincount(inv, weights=placed.astype(np.float64), minlength=len(first)).astype(np.int64)
    partial = (n_placed > 0) & (n_placed < n_seg)
    if partial.any():
        cut = partial[inv]
        rows[cut] = -1
        offs[cut] = 0
        placed &= ~cut
    lens = lengths.astype(np.int64)
    if pack:
        room = S - np.bincount(rows[placed], weights=lens[placed], minlength=B).astype(np.int64)
        end = np.zeros(B, dtype=np.int64)
        np.maximum.at(end, rows[placed], offs[placed] + lens[placed])
    else:
        room = 1 - np.bincount(rows[placed], minlength=B).astype(np.int64)  # one segment per row
        end = np.zeros(B, dtype=np.int64)
    size = lens if pack else np.ones_like(lens)
    todo = [int(e) for e in np.argsort(first, kind="stable") if n_placed[e] == 0 or partial[e]]
    for e in todo[: TOP_UP_FACTOR * B]:
        if not (room > 0).any():
            break
        segs = np.arange(first[e], first[e] + n_seg[e])  # adjacent in priority order
        trial = room.copy()
        where = []
        for c in segs.tolist():
            fits = np.flatnonzero(trial >= size[c])
            if fits.size == 0:
                break
            r = int(fits[0])
            trial[r] -= size[c]
            where.append((c, r))
        if len(where) < len(segs):
            continue
        for c, r in where:
            rows[c] = r
            offs[c] = end[r]
            end[r] += lens[c]
        room = trial


@dataclasses.dataclass
class _Segments:
    """The batch's segments in (row, offset) order: per-segment values and the concatenated token content."""

    row: np.ndarray
    seg_id: np.ndarray
    seg_count: np.ndarray
    seg_len: np.ndarray
    seg_start: np.ndarray  # start of each segment in the content arrays
    tok: np.ndarray
    mask: np.ndarray
    logprob: np.ndarray
    rewards: np.ndarray  # per-token rewards (token_rewards), 0 on prompt tokens
    adv: np.ndarray
    seg_adv: np.ndarray
    seg_reward: np.ndarray
    seg_temp: np.ndarray
    seg_trunc: np.ndarray
    seg_cut: np.ndarray
    seg_pol: np.ndarray
    seg_group: np.ndarray
    files: np.ndarray  # object: source file per segment
    ids: pa.Array  # rollout id per segment


def _empty_segments(row: np.ndarray, seg_id: np.ndarray, seg_count: np.ndarray, seg_len: np.ndarray) -> _Segments:
    k, n_content = len(row), int(seg_len.sum())
    return _Segments(
        row=row,
        seg_id=seg_id,
        seg_count=seg_count,
        seg_len=seg_len,
        seg_start=np.cumsum(seg_len) - seg_len,
        tok=np.empty(n_content, dtype=np.int32),
        mask=np.zeros(n_content, dtype=np.int8),
        logprob=np.zeros(n_content, dtype=np.float32),
        rewards=np.zeros(n_content, dtype=np.float32),
        adv=np.zeros(n_content, dtype=np.float32),
        seg_adv=np.empty(k, dtype=np.float32),
        seg_reward=np.empty(k, dtype=np.float64),
        seg_temp=np.empty(k, dtype=np.float32),
        seg_trunc=np.empty(k, dtype=bool),
        seg_cut=np.empty(k, dtype=bool),
        seg_pol=np.empty(k, dtype=np.int64),
        seg_group=np.empty(k, dtype=np.int64),
        files=np.empty(k, dtype=object),
        ids=pa.array([], type=pa.string()),
    )


def _gather(
    cands: list[tuple[int, Chunk]], c_idx: np.ndarray, r_idx: np.ndarray, row: np.ndarray, off: np.ndarray, B: int,
    max_uses: int,
) -> _Segments:  # fmt: skip
    """Copy the chosen rows' tokens and values into segment order, and mark one use on each chosen row."""
    # segment order: by (row, offset); segment id = rank within its row
    seg_order = np.lexsort((off, row))
    c_idx, r_idx, row = c_idx[seg_order], r_idx[seg_order], row[seg_order]
    k = len(c_idx)
    seg_count = np.bincount(row, minlength=B)
    seg_id = np.arange(k, dtype=np.int64) - (np.cumsum(seg_count) - seg_count)[row]
    chunk_of = dict(cands)
    p_len = np.empty(k, dtype=np.int64)
    r_len = np.empty(k, dtype=np.int64)
    for ci in np.unique(c_idx).tolist():
        sel = c_idx == ci
        p_len[sel] = chunk_of[ci].prompt_len[r_idx[sel]]
        r_len[sel] = chunk_of[ci].resp_len[r_idx[sel]]
    s = _empty_segments(row, seg_id, seg_count, p_len + r_len)
    ids_parts: list[tuple[np.ndarray, pa.Array]] = []
    for ci in np.unique(c_idx).tolist():
        sel = np.flatnonzero(c_idx == ci)
        c = chunk_of[ci]
        ri = r_idx[sel]
        d, pl, rl = s.seg_start[sel], p_len[sel], r_len[sel]
        s.tok[ranges(d, pl)] = c.prompt_vals[ranges(c.prompt_off[ri], pl)]
        r_src = ranges(c.resp_off[ri], rl)
        r_dst = ranges(d + pl, rl)
        s.tok[r_dst] = c.resp_vals[r_src]
        s.mask[r_dst] = c.mask_vals[r_src]
        s.logprob[r_dst] = c.logprob_vals[r_src]
        s.rewards[r_dst] = c.reward_vals[r_src]
        s.adv[r_dst] = np.repeat(c.advantage[ri], rl)
        s.seg_adv[sel] = c.advantage[ri]
        s.seg_reward[sel] = c.reward[ri]
        s.seg_temp[sel] = c.temperature[ri]
        s.seg_trunc[sel] = c.truncated[ri]
        s.seg_cut[sel] = c.cut[ri]
        s.seg_pol[sel] = c.policy_step
        s.seg_group[sel] = ci * (1 << 32) + c.group[ri]
        s.files[sel] = c.source_file
        ids_parts.append((sel, c.rollout_ids.take(pa.array(ri))))
        c.uses[ri] += 1
        c.alive[ri] = c.uses[ri] < max_uses
    order = np.concatenate([sel for sel, _ in ids_parts])
    s.ids = pa.concat_arrays([arr for _, arr in ids_parts]).take(pa.array(np.argsort(order)))
    return s


def _table(s: _Segments, B: int, L: int) -> pa.Table:
    """The batch table: rows filled contiguously from position 0, padding after."""
    # Rows are filled contiguously from position 0 (segments sorted by (row, offset), no gaps), so the
    # non-padding positions in row-major order are exactly the concatenation of the segments: the content
    # arrays are scattered with one boolean mask per column.
    row_len = np.bincount(s.row, weights=s.seg_len, minlength=B).astype(np.int64)
    filled = (np.arange(L, dtype=np.int64)[None, :] < row_len[:, None]).reshape(-1)

    def spread(content: np.ndarray, fill: float | int, dtype: Any) -> np.ndarray:
        out = np.zeros(B * L, dtype=dtype) if fill == 0 else np.full(B * L, fill, dtype=dtype)
        out[filled] = content
        return out

    n_content = int(s.seg_len.sum())
    pos = np.arange(n_content, dtype=np.int32) - np.repeat(s.seg_start.astype(np.int32), s.seg_len)
    tok_offsets = pa.array(np.arange(B + 1, dtype=np.int32) * L, type=pa.int32())
    seg_offsets = pa.array(np.concatenate([[0], np.cumsum(s.seg_count)]).astype(np.int32), type=pa.int32())

    def fixed(values: np.ndarray, typ: pa.DataType) -> pa.Array:
        return pa.ListArray.from_arrays(tok_offsets, pa.array(values, type=typ))

    def per_seg(values: Any, typ: pa.DataType) -> pa.Array:
        if isinstance(values, np.ndarray) and values.dtype == object:
            values = values.tolist()  # an object ndarray would make pyarrow import pandas
        return pa.ListArray.from_arrays(seg_offsets, pa.array(values, type=typ))

    return pa.Table.from_arrays(
        [
            fixed(spread(s.tok, 0, np.int32), pa.int32()),
            fixed(spread(s.mask, 0, np.int8), pa.int8()),
            fixed(spread(np.repeat(s.seg_id.astype(np.int32), s.seg_len), -1, np.int32), pa.int32()),
            fixed(spread(pos, 0, np.int32), pa.int32()),
            fixed(spread(s.adv, 0.0, np.float32), pa.float32()),
            fixed(spread(s.logprob, 0.0, np.float32), pa.float32()),
            pa.nulls(B, type=pa.list_(pa.float32())),
            per_seg(s.seg_trunc, pa.bool_()),
            per_seg(s.seg_temp, pa.float32()),
            per_seg(s.seg_pol, pa.int64()),
            pa.ListArray.from_arrays(seg_offsets, s.ids),
            per_seg(s.files, pa.string()),
            fixed(spread(s.rewards, 0.0, np.float32), pa.float32()),
        ],
        schema=BATCH.arrow_schema(),
    )


def _stats(slot: int, s: _Segments, params: TrainParams) -> dict[str, Any]:
    B, L = params.batch_size, params.seq_len
    k = len(s.row)
    lag = staleness.lags(slot, s.seg_pol)
    n_tokens = int(s.seg_len.sum())
    return {
        "slot": slot,
        "rows": B,
        "row_len": L,
        "n_rollouts": k,
        "n_groups": len(np.unique(s.seg_group)),
        "lag_min": int(lag.min()),
        "lag_mean": float(lag.mean()),
        "lag_max": int(lag.max()),
        "policy_step_min": int(s.seg_pol.min()),
        "policy_step_max": int(s.seg_pol.max()),
        "reward_mean": float(s.seg_reward.mean()),
        "advantage_mean": float(s.seg_adv.mean()),
        "advantage_std": float(s.seg_adv.std()),
        "advantage_abs_mean": float(np.abs(s.seg_adv).mean()),
        "advantage_min": float(s.seg_adv.min()),
        "advantage_max": float(s.seg_adv.max()),
        "tokens": n_tokens,
        "loss_tokens": int(s.mask.sum()),
        "padding_fraction": 1.0 - n_tokens / float(B * L),
        "segments_per_row": k / float(B),
        "n_truncated": int(s.seg_trunc.sum()),
        "n_cut_overlong": int(s.seg_cut.sum()),
        "max_uses": int(params.max_samples_per_rollout),
    }


def build_batch(
    slot: int,
    cands: list[tuple[int, Chunk]],
    c_idx: np.ndarray,
    r_idx: np.ndarray,
    row: np.ndarray,
    off: np.ndarray,
    params: TrainParams,
) -> BatchResult:
    """Batch `slot` from the placed candidates (chunk index, row in chunk, batch row, offset); marks one use on
    each (a row reaching `max_samples_per_rollout` uses is no longer alive)."""
    s = _gather(cands, c_idx, r_idx, row, off, params.batch_size, params.max_samples_per_rollout)
    table = _table(s, params.batch_size, params.seq_len)
    return BatchResult(
        slot=slot,
        table=table,
        rollout_ids=s.ids.to_pylist(),
        source_files=s.files.tolist(),
        stats=_stats(slot, s, params),
    )
