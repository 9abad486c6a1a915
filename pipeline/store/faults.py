"""Storage faults a restart cannot fix, named in one line; and the fault-injection hook that simulates them.

`storage_fault(path, error)` turns an `OSError` of a write under the run root whose errno says the storage itself
refuses it (`FAULT_ERRNOS`: no space, over quota, read-only, permission denied) into a
`pipeline.process.exits.StorageFaultError` naming the path, the cause and, for a full disk, the free space
(`shutil.disk_usage` of the nearest existing folder, on local paths). Every step program reports it as one line,
exit code `Exit.STORAGE_FAULT` (8), and the job runner stops the job instead of restarting the step: the same command
completes the run once the cause is fixed.

Fault injection (tests, drills): `RLPIPE_INJECT_STORAGE_FAULT=<ERRNO>:<prefix>[@<bytes>][,…]` makes every write of
`pipeline.store.storage.RunStore` to a run-root-relative path starting with `<prefix>` (empty: the whole run root)
fail with `OSError(<ERRNO>)` (e.g. `ENOSPC`, `EROFS`), after writing `<bytes>` (default 0) of the object's temp
file, as a disk filling up mid-write would. It goes through the real write path of the real programs, so it also
shows that a half-written temp file is never read. With `ENOSPC` and an empty prefix (or `logs/`), the step logs of
a local run root are opened on `/dev/full` (every write fails with ENOSPC) as on a full disk. Never set it
outside tests.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil

from pipeline.process.exits import StorageFaultError

FAULT_INJECTION_ENV = "RLPIPE_INJECT_STORAGE_FAULT"
"""Environment variable of the fault-injection hook (see the module docstring)."""
FAULT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
"""Errnos of a write that the storage refused for a reason a restart cannot fix."""


@dataclasses.dataclass(frozen=True)
class InjectedFault:
    """One rule of the fault-injection hook: writes under `prefix` fail with `code` after `after_bytes` bytes."""

    code: int
    prefix: str
    after_bytes: int = 0

    def error(self, path: str) -> OSError:
        """The OSError this rule raises for a write of `path`."""
        why = f"{os.strerror(self.code)} (injected by {FAULT_INJECTION_ENV})"
        return OSError(self.code, why, path)


def injected_faults() -> list[InjectedFault]:
    """The rules of `$RLPIPE_INJECT_STORAGE_FAULT` (empty when unset); ValueError naming a bad rule."""
    spec = os.environ.get(FAULT_INJECTION_ENV, "").strip()
    rules = []
    for item in filter(None, (i.strip() for i in spec.split(","))):
        name, sep, rest = item.partition(":")
        code = getattr(errno, name.strip().upper(), None)
        if not sep or not isinstance(code, int):
            raise ValueError(f"{FAULT_INJECTION_ENV}={spec!r}: {item!r} is not <ERRNO>:<prefix>[@<bytes>]")
        prefix, _, after = rest.partition("@")
        rules.append(InjectedFault(code, prefix.strip().lstrip("/"), int(after) if after else 0))
    return rules


def injected_fault(rel: str) -> InjectedFault | None:
    """The first injected fault whose prefix covers run-root-relative `rel`, else None."""
    for rule in injected_faults():
        if rel.startswith(rule.prefix):
            return rule
    return None


def logs_full() -> bool:
    """Whether the hook fills the step logs' folder (ENOSPC on `logs/`): they are then opened on /dev/full."""
    rule = injected_fault("logs/")
    return rule is not None and rule.code == errno.ENOSPC


def free_space(path: str) -> str:
    """`<free> free of <total>` on the file system of local `path` (its nearest existing folder), or ''."""
    folder = path
    while folder and not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            return ""
        folder = parent
    try:
        usage = shutil.disk_usage(folder or ".")
    except OSError:
        return ""
    return f"{_size(usage.free)} free of {_size(usage.total)} at {folder}"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def storage_fault(path: str, error: OSError, *, local: bool = True) -> StorageFaultError | None:
    """A StorageFaultError naming `path` and what `error` says (the free space, for a full local disk), or None
    when `error` is not a storage fault (`FAULT_ERRNOS`)."""
    if error.errno not in FAULT_ERRNOS:
        return None
    name = errno.errorcode.get(error.errno or 0, str(error.errno))
    reason = f"{error.strerror or os.strerror(error.errno or 0)} ({name})"
    if error.errno in (errno.ENOSPC, errno.EDQUOT) and local:
        space = free_space(path)
        if space:
            reason += f"; {space}"
    return StorageFaultError(path, reason)


def not_a_folder(path: str) -> StorageFaultError | None:
    """A StorageFaultError naming the file that stands where a folder of local `path` must be, or None."""
    folder = path
    while folder:
        if os.path.isfile(folder):
            return StorageFaultError(folder, f"is a file, not a folder (writing {path})")
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return None
