"""glibc's allocator tuned for XLA on CPU: freed buffers stay in the process instead of going back to the kernel.

XLA's CPU runtime allocates each step's temporary buffers with `malloc` and frees them at the step's end. Under
glibc's defaults the large ones (above the dynamic mmap threshold, at most 32 MiB) are fresh `mmap`s, and the rest
live in per-thread arenas whose heaps are unmapped once empty, so every step touches new pages again: one minor
page fault per 4 KiB. Measured on a 2-core VM (2026-11-29): the tool-use recipe's SFT step
(`configs/tool_calculator_sft.yaml`, 100 steps) took 5.5M minor faults and 14.4 s of system time in 53.6 CPU-s;
with one arena, no `mmap` for allocations and a 1 GiB trim threshold, 0.13M faults and 0.5 s, 33.2 CPU-s (-38%,
wall 35.6 -> 22.5 s). The TRL comparison's ~50M RL job (`bench.bench_trl`): learner CPU per step at steady state
3.14 / 2.78 -> 2.62 / 2.39 s, the whole job 7.79 / 7.36 -> 6.86 / 6.96 CPU-s per learner step (two runs each).

`install()` applies that setting (`mallopt`: `M_ARENA_MAX` 1, `M_MMAP_MAX` 0, `M_TRIM_THRESHOLD` 1 GiB) to this
process, before JAX starts its threads, when all of these hold: the C library is glibc; JAX will compute on the CPU
(`JAX_PLATFORMS` starts with `cpu`, or is unset and a step process's default here would be `cpu`:
`pipeline.process.platforms`; on an accelerator XLA's buffers are device memory, and a host heap that never returns
large blocks would hold the host copies of checkpoints); the user has not tuned malloc already (no `MALLOC_*`
variable, no `glibc.malloc` tunable); and `RLPIPE_HOST_MALLOC` is not `default` (the opt-out). The cost: up to
1 GiB of freed memory kept per process for reuse (peak RSS of that SFT run: 683 -> 643 MB), and one arena lock
shared by the threads (XLA's few threads allocate large, rarely).

The setting holds only for threads that first allocate after it: a thread that allocated before `install()` has an
arena of its own, which threads started later may share (glibc hands out existing arenas round-robin), and in such
an arena every allocation over 64 MiB is a fresh `mmap` whatever `M_MMAP_MAX` says. A step process therefore
installs it before it starts any thread (`steps/__init__.py`, ahead of its parent watch); `install()` logs a warning
when more than one arena exists already. Measured on the TRL comparison's ~50M job (AMD EPYC 2-core VM,
2026-11-30), where the parent watch's thread had started first: the learner's XLA threads mapped a fresh 557 MiB
buffer every step (140,000 minor faults per step); installed first, none after the first steps.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

from pipeline.process.platforms import default_jax_platforms

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD = 1 << 30
"""Freed memory above this at the heap's top goes back to the kernel (1 GiB: a few steps' temporaries of a ~50M
model on CPU stay, a checkpoint's worth does not)."""
OPT_OUT = "RLPIPE_HOST_MALLOC"
"""Environment variable: `default` leaves glibc's allocator as it is."""

_installed: bool | None = None


def wanted(environ: dict[str, str] | os._Environ[str] | None = None) -> tuple[bool, str]:
    """(whether `install` would tune malloc here, why) for the environment `environ` (default: this process's)."""
    env = os.environ if environ is None else environ
    if env.get(OPT_OUT, "").strip().lower() == "default":
        return False, f"{OPT_OUT}=default"
    if platform.libc_ver()[0] != "glibc":
        return False, "the C library is not glibc"
    if any(k.startswith("MALLOC_") for k in env) or "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return False, "malloc is tuned by the environment already"
    platforms = env.get("JAX_PLATFORMS", "").strip().lower()
    if not platforms:  # unset or empty: what a step process would default to (libtpu installed: None, the TPU)
        platforms = default_jax_platforms() or "tpu"
        if platforms.split(",")[0] != "cpu":
            return False, f"JAX_PLATFORMS unset and this machine's default is {platforms}"
    if platforms.split(",")[0] != "cpu":
        return False, f"JAX_PLATFORMS={platforms}"
    return True, "XLA on CPU"


def install() -> bool:
    """Tune this process's glibc malloc for XLA on CPU where `wanted` says so (once; later calls return the first
    result). True if tuned. Never raises: a C library without `mallopt` leaves the defaults."""
    global _installed
    if _installed is not None:
        return _installed
    ok, why = wanted()
    if ok:
        try:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = all(
                mallopt(p, v) == 1 for p, v in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
            )
            why = "XLA on CPU" if ok else "mallopt refused a setting"
        except (OSError, AttributeError) as e:
            ok, why = False, f"no mallopt ({e})"
    logger.debug("host malloc %s: %s", "tuned" if ok else "left as is", why)
    if ok and (arenas := arena_count()) > 1:
        logger.warning(
            "host malloc: %d allocator arenas existed before the setting (threads started first); allocations over "
            "64 MiB in the threads that share them still map fresh pages",
            arenas,
        )
    _installed = ok
    return ok


def arena_count() -> int:
    """How many glibc malloc arenas this process has (1: every thread allocates from the main heap); 0 where it
    cannot be read (not glibc, or no `malloc_info`)."""
    try:
        libc = ctypes.CDLL(None)
        open_memstream, malloc_info, fclose, free = libc.open_memstream, libc.malloc_info, libc.fclose, libc.free
    except (OSError, AttributeError):
        return 0
    open_memstream.restype = ctypes.c_void_p
    open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    malloc_info.argtypes, fclose.argtypes, free.argtypes = (
        [ctypes.c_int, ctypes.c_void_p],
        [ctypes.c_void_p],
        [ctypes.c_void_p],
    )
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return 0
    failed = malloc_info(0, stream) != 0
    fclose(stream)  # sets buf and size
    text = ctypes.string_at(buf, size.value).decode(errors="replace") if buf.value is not None else ""
    free(ctypes.cast(buf, ctypes.c_void_p))
    return 0 if failed else text.count("<heap nr=")
