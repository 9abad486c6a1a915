"""read_ahead: order, exceptions through the future, bounded look-ahead, early close."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.store.prefetch import read_ahead


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_results_in_order(depth: int) -> None:
    items = list(range(20))
    got = [(x, f.result()) for x, f in read_ahead(lambda x: x * x, items, depth)]
    assert got == [(x, x * x) for x in items]


def test_exception_is_raised_at_consumption_and_later_items_still_come() -> None:
    def fn(x: int) -> int:
        if x == 3:
            raise ValueError("bad 3")
        return x

    out = []
    for _x, f in read_ahead(fn, range(6), 2):
        try:
            out.append(f.result())
        except ValueError as e:
            out.append(str(e))
    assert out == [0, 1, 2, "bad 3", 4, 5]


def test_look_ahead_is_bounded_and_early_close_stops_calls() -> None:
    started: list[int] = []
    lock = threading.Lock()

    def fn(x: int) -> int:
        with lock:
            started.append(x)
        time.sleep(0.01)
        return x

    gen = read_ahead(fn, range(100), 2)
    first, fut = next(gen)
    assert fut.result() == first == 0
    time.sleep(0.1)
    assert len(started) <= 3  # the consumed one plus at most `depth` ahead
    gen.close()
    n = len(started)
    time.sleep(0.1)
    assert len(started) == n <= 3
    # no read-ahead thread outlives the generator (other tests of this worker may leave their own threads)
    assert [t.name for t in threading.enumerate() if t.name.startswith("read-ahead")] == []
