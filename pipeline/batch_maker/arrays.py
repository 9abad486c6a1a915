"""Vectorised helpers over Arrow list columns (list offsets + flat value buffers), shared by the BatchMaker."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa


def ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), vectorised (int64)."""
    lens = np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    excl = np.cumsum(lens) - lens
    return np.repeat(starts - excl, lens) + np.arange(total, dtype=np.int64)


def list_parts(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat values, offsets into them, per-row null flags) of a list column, zero-copy where possible."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    nulls = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else np.zeros(len(arr), dtype=bool)
    return values, offsets, nulls


def column(table: pa.Table, name: str, dtype: Any) -> np.ndarray:
    """A scalar column of `table` as a numpy array of `dtype`."""
    return np.asarray(table.column(name).to_numpy(), dtype=dtype)


def segment_any(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per list row: whether any flag within [offsets[i], offsets[i+1]) is set."""
    n = offsets.shape[0] - 1
    if flags.shape[0] == 0 or n == 0 or not flags.any():
        return np.zeros(n, dtype=bool)
    csum = np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])
    return (csum[offsets[1:]] - csum[offsets[:-1]]) > 0
