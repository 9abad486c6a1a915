"""Read ahead: run a function on the next items in worker threads while the caller works on the current one.

Parquet parsing, zstd, checksums and object-store reads release the GIL, so on a machine with a couple of
cores reading file i+1 overlaps with the numpy work on file i.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def read_ahead(fn: Callable[[T], R], items: Iterable[T], depth: int = 2) -> Iterator[tuple[T, Future[R]]]:
    """Yield `(item, future of fn(item))` in order, with up to `depth` calls started ahead of the consumer.

    The consumer may ignore a future (the call still ran: `fn` must be safe to run for an item that is then
    not used). `future.result()` re-raises what `fn` raised. Closing the iterator early cancels calls not
    yet started and waits for the running ones, so no thread outlives the loop. `depth` 0 calls `fn` lazily in
    the caller's thread.
    """
    if depth <= 0:
        for x in items:
            f: Future[R] = Future()
            try:
                f.set_result(fn(x))
            except Exception as e:  # handed to the consumer through the future
                f.set_exception(e)
            yield x, f
        return
    it = iter(items)
    pending: deque[tuple[T, Future[R]]] = deque()
    pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="read-ahead")
    try:
        for x in it:
            pending.append((x, pool.submit(fn, x)))
            if len(pending) >= depth:
                break
        while pending:
            x, f = pending.popleft()
            for nxt in it:
                pending.append((nxt, pool.submit(fn, nxt)))
                break
            yield x, f
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
