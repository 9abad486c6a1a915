"""Leases on a run root, built only on create-if-absent objects (no compare-and-swap needed).

A lease keeps a second instance of a single-writer role (the BatchMaker, the learner) from wasting
work. It is NOT what makes commits safe: the commits themselves are create-if-absent. Callers stamp
`lease.epoch` into what they commit so that a reader can tell which holder wrote it.

Protocol for lease `name` (all objects under `leases/<name>/`, written with `put_if_absent`):

    epoch-00000003.json                 claim of epoch 3: {holder, epoch, ttl_s, time, attempt_id, host, pid}
    epoch-00000003.renew-00000007.json  7th renewal by the epoch-3 holder: {holder, epoch, time}
    epoch-00000003.released.json        the epoch-3 holder let go: {holder, epoch, time}

- Last activity of epoch k = the newest `time` among its claim and renewal records.
  Epoch k is *live* while `now < last activity + ttl_s` and it has no release record.
- acquire(): list the folder (fresh). No epoch yet: create epoch 1. Newest epoch k live: raise
  `LeaseHeldError(holder, expires_in)`. Epoch k expired or released: create epoch k+1 with
  create-if-absent; exactly one contender wins, the others get `LeaseHeldError` naming the winner.
- Holding is per instance (the claim's attempt_id), not per holder name: a restarted process with
  the same holder name waits for its predecessor's epoch to expire like anybody else, unless it
  calls `acquire(take_over_own=True)`: a supervisor that restarts its own crashed step knows the
  previous instance is dead, so a live epoch claimed under the same holder name is taken over at
  once (epoch k+1, create-if-absent as always; if the predecessor lived after all, its next
  renew() raises LeaseLostError).
- A live epoch whose claim names this host (`socket.gethostname()`) and a process id that no longer runs here is
  taken over at once by acquire() (its holder is dead: a killed step, a step that died on a full disk before it
  could write its release record), so a rerun is never blocked by a dead step's lease. A process id reused by
  another live process only makes the taker wait for the epoch to lapse, as before.
- renew(): raise `LeaseLostError` if a newer epoch exists or our own epoch already expired (someone
  may have taken over); otherwise create the next renewal record and delete the previous one
  (renewals are not commit objects). Renew well inside ttl_s (e.g. every ttl_s / 3).
- release(): create the release record; the next acquire() needs no wait.
- Times are the writers' wall clocks (`time.time()`): machines sharing a run root need clocks in sync
  to well within ttl_s. A taker that claims just as a slow holder renews leaves a short window in
  which both believe they hold the lease; the holder learns at its next renew(). That is why commits
  never rely on the lease alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

from pipeline.store import layout
from pipeline.store.storage import CorruptFileError, RunStore, new_attempt_id

__all__ = ["Lease", "LeaseError", "LeaseHeldError", "LeaseLostError", "lease_dir"]

logger = logging.getLogger(__name__)

_EPOCH_RE = re.compile(r"^epoch-(\d{8})\.json$")
_RENEW_RE = re.compile(r"^epoch-(\d{8})\.renew-(\d{8})\.json$")
_RELEASE_RE = re.compile(r"^epoch-(\d{8})\.released\.json$")


class LeaseError(Exception):
    """Base of lease errors."""


class LeaseHeldError(LeaseError):
    """Another instance holds the lease; `holder` is its name, `expires_in` seconds until it lapses."""

    def __init__(
        self, holder: str, expires_in: float, name: str = "", epoch: int = 0, *, host: str = "", pid: int = 0,
        claimed_at: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__(f"lease {name!r} epoch {epoch} is held by {holder!r} for another {expires_in:.1f}s")
        self.holder = holder
        self.expires_in = expires_in
        self.name = name
        self.epoch = epoch
        self.host = host
        """The holder's host, as its claim records it ('' when unknown)."""
        self.pid = pid
        """The holder's process id on that host (0 when unknown)."""
        self.claimed_at = claimed_at
        """When the holder claimed this epoch (its wall clock; 0 when unknown)."""


class LeaseLostError(LeaseError):
    """The lease we held expired or was taken over (a newer epoch exists)."""


def lease_dir(name: str) -> str:
    """Folder of lease `name`: `leases/<name>`."""
    return layout.join(layout.LEASES, layout.check_component(name, "lease name"))


def _epoch_file(name: str, epoch: int) -> str:
    return layout.join(lease_dir(name), f"epoch-{epoch:08d}.json")


def _renew_file(name: str, epoch: int, seq: int) -> str:
    return layout.join(lease_dir(name), f"epoch-{epoch:08d}.renew-{seq:08d}.json")


def _release_file(name: str, epoch: int) -> str:
    return layout.join(lease_dir(name), f"epoch-{epoch:08d}.released.json")


@dataclasses.dataclass
class _EpochState:
    epoch: int
    holder: str
    attempt_id: str
    ttl_s: float
    last_activity: float
    released: bool
    host: str = ""
    pid: int = 0
    claimed_at: float = 0.0

    def holder_dead(self) -> bool:
        """Whether the claim names a process of this host that no longer runs."""
        return self.host == socket.gethostname() and self.pid > 0 and not _pid_alive(self.pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


class Lease:
    """A time-limited exclusive claim on role `name` by `holder` (see the module docstring for the protocol).

    `epoch` is 0 until acquire() succeeds, then the epoch this instance holds.
    """

    def __init__(
        self, store: RunStore, name: str, holder: str, ttl_s: float, *, clock: Callable[[], float] = time.time
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease {name!r}: ttl_s must be > 0, got {ttl_s}")
        layout.check_component(name, "lease name")
        if not holder:
            raise ValueError(f"lease {name!r}: holder must be a non-empty string")
        self.store = store
        self.name = str(name)  # a StrEnum name (StepKind) would show as <StepKind…> in messages
        self.holder = holder
        self.ttl_s = float(ttl_s)
        self.epoch = 0
        self._clock = clock
        self._attempt_id = ""
        self._renew_seq = 0
        self._last_renewal = 0.0

    def __repr__(self) -> str:
        return f"Lease({self.name!r}, holder={self.holder!r}, epoch={self.epoch})"

    # reading state -------------------------------------------------------------------
    def _latest(self) -> _EpochState | None:
        """The newest epoch's state from a fresh listing, or None if the lease was never claimed."""
        names = [p.rsplit("/", 1)[-1] for p in self.store.list(lease_dir(self.name))]
        epochs = [int(m.group(1)) for n in names if (m := _EPOCH_RE.match(n))]
        if not epochs:
            return None
        k = max(epochs)
        claim = self._read(_epoch_file(self.name, k))
        if claim is None:  # listed but unreadable/vanished: treat as freshly active
            return _EpochState(k, "<unknown>", "", self.ttl_s, self._clock(), False)
        last = float(claim.get("time", 0.0))
        renewals = [int(m.group(2)) for n in names if (m := _RENEW_RE.match(n)) and int(m.group(1)) == k]
        if renewals:
            rec = self._read(_renew_file(self.name, k, max(renewals)))
            # A renewal deleted between list and read means the holder renewed again just now.
            last = max(last, float(rec["time"]) if rec is not None else self._clock())
        released = any((m := _RELEASE_RE.match(n)) and int(m.group(1)) == k for n in names)
        return _EpochState(
            epoch=k,
            holder=str(claim.get("holder", "<unknown>")),
            attempt_id=str(claim.get("attempt_id", "")),
            ttl_s=float(claim.get("ttl_s", self.ttl_s)),
            last_activity=last,
            released=released,
            host=str(claim.get("host", "")),
            pid=int(claim.get("pid", 0) or 0),
            claimed_at=float(claim.get("time", 0.0)),
        )

    def _read(self, rel: str) -> dict[str, Any] | None:
        try:
            obj = self.store.get_json(rel)
        except FileNotFoundError:
            return None
        except CorruptFileError as e:
            logger.warning("lease %s: unreadable record %s (%s)", self.name, rel, e)
            return None
        return obj if isinstance(obj, dict) else None

    def live_holder(self) -> LeaseHeldError | None:
        """The refusal acquire() would give now, without claiming anything: a LeaseHeldError naming the live
        holder, or None when the lease is free (never claimed, released, lapsed, or its holder dead on this
        host)."""
        state = self._latest()
        if state is None or state.released or state.holder_dead():
            return None
        expires_in = state.last_activity + state.ttl_s - self._clock()
        if expires_in <= 0:
            return None
        return LeaseHeldError(state.holder, expires_in, self.name, state.epoch, host=state.host, pid=state.pid,
                              claimed_at=state.claimed_at)  # fmt: skip

    # operations ----------------------------------------------------------------------
    def acquire(self, *, take_over_own: bool = False) -> int:
        """Claim the lease; return the epoch now held. Raises LeaseHeldError naming the current holder.

        `take_over_own`: a live epoch whose holder name is this instance's is taken over without waiting
        for it to expire (for a caller that knows that instance is dead, e.g. a supervisor restarting it).
        """
        state = self._latest()
        now = self._clock()
        if state is not None and self.epoch == state.epoch and state.attempt_id == self._attempt_id:
            self.renew()
            return self.epoch
        if state is not None and not state.released:
            expires_in = state.last_activity + state.ttl_s - now
            own = take_over_own and state.holder == self.holder
            if expires_in > 0 and not own and not state.holder_dead():
                raise LeaseHeldError(state.holder, expires_in, self.name, state.epoch, host=state.host,
                                     pid=state.pid, claimed_at=state.claimed_at)  # fmt: skip
            if expires_in > 0 and not own:
                logger.info("lease %s: epoch %d's holder %r (pid %d on this host) is dead; taking over at once",
                            self.name, state.epoch, state.holder, state.pid)  # fmt: skip
        epoch = 1 if state is None else state.epoch + 1
        attempt_id = new_attempt_id()
        claim = {"holder": self.holder, "epoch": epoch, "ttl_s": self.ttl_s, "time": now, "attempt_id": attempt_id,
                 "host": socket.gethostname(), "pid": os.getpid()}  # fmt: skip
        if not self.store.put_json_if_absent(_epoch_file(self.name, epoch), claim):
            winner = self._read(_epoch_file(self.name, epoch)) or {}
            raise LeaseHeldError(str(winner.get("holder", "<unknown>")), self.ttl_s, self.name, epoch)
        self.epoch, self._attempt_id, self._renew_seq, self._last_renewal = epoch, attempt_id, 0, now
        if state is not None and state.holder == self.holder and not state.released:
            logger.info("lease %s: %s took epoch %d over from its own previous instance", self.name, self.holder, epoch)
        elif state is not None:
            logger.info("lease %s: %s took epoch %d over from %s", self.name, self.holder, epoch, state.holder)
        else:
            logger.info("lease %s: %s holds epoch %d", self.name, self.holder, epoch)
        return epoch

    def acquire_waiting(
        self, *, take_over_own: bool = False, interval_s: float = 0.5, sleep: Callable[[float], None] = time.sleep
    ) -> int:
        """acquire(), but a lease whose holder has stopped renewing (a killed process) is waited for until it
        lapses (at most its ttl_s), with one log line saying so, instead of raising at once.

        A live holder renews every ttl_s / 3 or so: as soon as the held epoch shows newer activity (or another
        instance claims a newer epoch), LeaseHeldError is raised naming it, as acquire() would. Waiting never
        weakens exclusivity: every claim is still create-if-absent.
        """
        try:
            return self.acquire(take_over_own=take_over_own)
        except LeaseHeldError as held:
            first = self._latest()
            if first is None or first.epoch != held.epoch:
                return self.acquire(take_over_own=take_over_own)
            logger.warning(
                "lease %s: epoch %d is held by %r for another %.1fs (a stopped or killed holder does not renew it); "
                "waiting up to that long for it to lapse",
                self.name, held.epoch, held.holder, held.expires_in,
            )  # fmt: skip
        while True:
            sleep(max(0.01, min(interval_s, first.last_activity + first.ttl_s - self._clock())))
            state = self._latest()
            if state is not None and state.epoch == first.epoch and not state.released:
                if state.last_activity > first.last_activity:  # renewed: a live holder
                    raise LeaseHeldError(
                        state.holder, state.last_activity + state.ttl_s - self._clock(), self.name, state.epoch
                    )
                if self._clock() < state.last_activity + state.ttl_s:
                    continue
            return self.acquire(take_over_own=take_over_own)

    def renew(self) -> None:
        """Extend the lease by ttl_s from now. Raises LeaseLostError if it expired or was taken over."""
        if self.epoch == 0:
            raise LeaseLostError(f"lease {self.name!r}: renew() before acquire() by {self.holder!r}")
        now = self._clock()
        if now >= self._last_renewal + self.ttl_s:
            raise LeaseLostError(
                f"lease {self.name!r} epoch {self.epoch} held by {self.holder!r} expired "
                f"{now - self._last_renewal - self.ttl_s:.1f}s ago"
            )
        state = self._latest()
        if state is None or state.epoch != self.epoch or state.attempt_id != self._attempt_id or state.released:
            who = "nobody" if state is None else f"{state.holder!r} (epoch {state.epoch})"
            raise LeaseLostError(f"lease {self.name!r} epoch {self.epoch} of {self.holder!r} lost; now {who}")
        seq = self._renew_seq + 1
        record = {"holder": self.holder, "epoch": self.epoch, "time": now, "attempt_id": self._attempt_id}
        if not self.store.put_json_if_absent(_renew_file(self.name, self.epoch, seq), record):
            raise LeaseLostError(f"lease {self.name!r} epoch {self.epoch}: renewal {seq} written by someone else")
        if self._renew_seq > 0:
            self.store.delete(_renew_file(self.name, self.epoch, self._renew_seq))
        self._renew_seq, self._last_renewal = seq, now

    def release(self) -> None:
        """Let go of the lease so the next acquire() needs no wait. A no-op if not held."""
        if self.epoch == 0:
            return
        record = {"holder": self.holder, "epoch": self.epoch, "time": self._clock(), "attempt_id": self._attempt_id}
        self.store.put_json_if_absent(_release_file(self.name, self.epoch), record)
        logger.info("lease %s: %s released epoch %d", self.name, self.holder, self.epoch)
        self.epoch = 0
        self._attempt_id = ""

    @property
    def expires_in(self) -> float:
        """Seconds until the lease lapses unless renewed (<= 0: expired or not held)."""
        if self.epoch == 0:
            return 0.0
        return self._last_renewal + self.ttl_s - self._clock()

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
