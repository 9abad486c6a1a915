"""Lease protocol: one holder at a time, LeaseHeldError naming the holder, hand-over after expiry or release."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from pipeline.store import layout
from pipeline.store.lease import Lease, LeaseHeldError, LeaseLostError, lease_dir
from pipeline.store.storage import RunStore


class Clock:
    """A manual clock shared by the leases of one test."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["local", "memory", "gs"])
def lstore(request: pytest.FixtureRequest, store_factory: Any) -> RunStore:
    return store_factory(str(request.param))


def test_one_holder_then_hand_over_after_expiry(lstore: RunStore) -> None:
    clock = Clock()
    a = Lease(lstore, "batchmaker", "maker-a", ttl_s=30, clock=clock)
    b = Lease(lstore, "batchmaker", "maker-b", ttl_s=30, clock=clock)
    assert a.acquire() == 1 and a.epoch == 1
    clock.now += 10
    with pytest.raises(LeaseHeldError) as ei:
        b.acquire()
    assert ei.value.holder == "maker-a" and ei.value.expires_in == pytest.approx(20)
    assert "maker-a" in str(ei.value) and b.epoch == 0
    clock.now += 21  # a's last activity + ttl has passed
    assert b.acquire() == 2
    with pytest.raises(LeaseLostError, match="expired"):
        a.renew()
    clock.now += 1
    with pytest.raises(LeaseHeldError) as ei:
        a.acquire()
    assert ei.value.holder == "maker-b"


def test_renew_keeps_the_lease_and_a_taker_detects_loss(lstore: RunStore) -> None:
    clock = Clock()
    a = Lease(lstore, "learner", "a", ttl_s=10, clock=clock)
    b = Lease(lstore, "learner", "b", ttl_s=10, clock=clock)
    a.acquire()
    for _ in range(5):
        clock.now += 6
        a.renew()
        with pytest.raises(LeaseHeldError):
            b.acquire()
    renewals = [p for p in lstore.list(lease_dir("learner")) if ".renew-" in p]
    assert len(renewals) == 1, renewals  # old renewal records are cleaned up
    clock.now += 11
    assert b.acquire() == 2
    clock.now -= 5  # a believes it is still inside its ttl, but a newer epoch exists
    with pytest.raises(LeaseLostError, match="lost"):
        a.renew()


def test_release_hands_over_at_once(lstore: RunStore) -> None:
    clock = Clock()
    with Lease(lstore, "bm", "a", ttl_s=60, clock=clock) as a:
        assert a.epoch == 1
    assert a.epoch == 0
    b = Lease(lstore, "bm", "b", ttl_s=60, clock=clock)
    assert b.acquire() == 2


def test_same_holder_name_in_a_new_instance_must_wait(local_store: RunStore) -> None:
    clock = Clock()
    Lease(local_store, "bm", "worker-0", ttl_s=60, clock=clock).acquire()
    restarted = Lease(local_store, "bm", "worker-0", ttl_s=60, clock=clock)
    with pytest.raises(LeaseHeldError):
        restarted.acquire()


def test_take_over_own_skips_the_wait_only_for_the_same_holder_name(local_store: RunStore) -> None:
    clock = Clock()
    crashed = Lease(local_store, "bm", "batches@host-42", ttl_s=60, clock=clock)
    assert crashed.acquire() == 1
    other = Lease(local_store, "bm", "batches@host-7", ttl_s=60, clock=clock)
    with pytest.raises(LeaseHeldError):
        other.acquire(take_over_own=True)  # another supervisor's maker: refused as always
    restarted = Lease(local_store, "bm", "batches@host-42", ttl_s=60, clock=clock)
    assert restarted.acquire(take_over_own=True) == 2  # at once, no ttl wait
    clock.now += 1
    with pytest.raises(LeaseLostError, match="lost"):
        crashed.renew()  # had the predecessor lived after all, it learns at its next renewal
    with pytest.raises(LeaseHeldError):
        other.acquire()


def test_reacquire_by_the_holder_renews(local_store: RunStore) -> None:
    clock = Clock()
    a = Lease(local_store, "bm", "a", ttl_s=60, clock=clock)
    assert a.acquire() == 1
    clock.now += 50
    assert a.acquire() == 1
    clock.now += 50
    with pytest.raises(LeaseHeldError):
        Lease(local_store, "bm", "b", ttl_s=60, clock=clock).acquire()


@pytest.mark.parametrize("backend", ["local", "gs"])
def test_concurrent_acquirers_exactly_one_wins(store_factory: Any, backend: str) -> None:
    store = store_factory(backend)
    n = 6
    barrier = threading.Barrier(n)
    won: list[str] = []
    held: list[str] = []

    def contend(i: int) -> None:
        lease = Lease(store, "bm", f"h{i}", ttl_s=60)
        barrier.wait()
        try:
            lease.acquire()
            won.append(lease.holder)
        except LeaseHeldError as e:
            held.append(e.holder)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1, won
    assert set(held) <= set(won) | {"<unknown>"} and len(held) == n - 1


def test_real_time_expiry(local_store: RunStore) -> None:
    # ttl 1.5 s: b's first attempt must come within the ttl even when a loaded machine pauses this process
    a = Lease(local_store, "bm", "a", ttl_s=1.5)
    b = Lease(local_store, "bm", "b", ttl_s=1.5)
    a.acquire()
    with pytest.raises(LeaseHeldError):
        b.acquire()
    time.sleep(1.55)
    assert b.acquire() == 2 and a.expires_in <= 0


def test_layout_and_validation(local_store: RunStore) -> None:
    Lease(local_store, "bm", "a", ttl_s=5).acquire()
    assert local_store.list(layout.LEASES) == ["leases/bm"]
    assert local_store.get_json("leases/bm/epoch-00000001.json")["holder"] == "a"
    with pytest.raises(ValueError):
        Lease(local_store, "../x", "a", ttl_s=5)
    with pytest.raises(ValueError):
        Lease(local_store, "bm", "a", ttl_s=0)
    with pytest.raises(LeaseLostError):
        Lease(local_store, "bm", "a", ttl_s=5).renew()


def test_acquire_waiting_waits_out_a_dead_holder_and_refuses_a_live_one(lstore: RunStore) -> None:
    """A holder that stopped renewing (killed) is waited for until its epoch lapses; one that renews is refused."""
    dead = Lease(lstore, "bm", "dead", ttl_s=1.0)
    dead.acquire()
    t0 = time.monotonic()
    b = Lease(lstore, "bm", "B", ttl_s=2.0)  # longer than any pause of a loaded machine before c's first look
    assert b.acquire_waiting(interval_s=0.05) == 2
    assert 0.5 < time.monotonic() - t0 < 10
    c = Lease(lstore, "bm", "C", ttl_s=2.0)

    def renew_meanwhile(s: float) -> None:
        time.sleep(s)
        b.renew()

    with pytest.raises(LeaseHeldError) as ei:
        c.acquire_waiting(interval_s=0.05, sleep=renew_meanwhile)
    assert ei.value.holder == "B"
