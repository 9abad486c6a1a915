"""The host allocator setting for XLA on CPU (`policy._host_malloc`): where it applies, and that it removes the
page faults of a jitted program whose temporaries are freed and allocated again every call.

The fault test runs one JAX program in two fresh processes, tuned (as every process that imports `policy` on a
CPU-only machine) and with `RLPIPE_HOST_MALLOC=default`, and compares the minor page faults of the calls after the
first five (compile and the heap's growth excluded), 20 calls each with 64 MiB temporaries. Measured on the 2-core
VM: 164,000 faults untuned (a fresh `mmap` per temporary), 1-2 tuned (once 32,773: the heap grew by 128 MiB more
inside the counted calls). A smaller program (16 MiB temporaries, under glibc's dynamic mmap threshold) faulted
about as often either way: the setting is for programs with buffers above 32 MiB, as the SFT and learner steps'
logits are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policy import _host_malloc as hm

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import json, resource, sys
import policy  # the setting is applied here, before JAX starts its threads
from policy import _host_malloc
import jax, jax.numpy as jnp

@jax.jit
def f(x):
    y = jnp.tanh(x @ x.T)  # 4096 x 4096 float32: 64 MiB temporaries (above glibc's largest mmap threshold)
    return (y @ x).sum() + jnp.exp(y).sum()

x = jnp.ones((4096, 64), jnp.float32) / 64
for _ in range(5):  # compile, then let the heap grow to the program's peak
    f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    f(x).block_until_ready()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"tuned": _host_malloc.install(), "faults": faults}))
"""


def _untuned_env(**extra: str) -> dict[str, str]:
    """This process's environment without any malloc tuning or opt-out, JAX on the CPU, then `extra`."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", hm.OPT_OUT)
    }
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


def _run(extra_env: dict[str, str]) -> dict[str, object]:
    env = _untuned_env(**extra_env)
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hm.wanted({"JAX_PLATFORMS": "cpu"})[0], reason="not glibc: the setting does not apply")
def test_tuned_malloc_removes_the_page_faults_of_freed_xla_buffers() -> None:
    tuned = _run({})
    default = _run({hm.OPT_OUT: "default"})
    assert tuned["tuned"] is True and default["tuned"] is False
    assert default["faults"] >= 100_000, default  # the untuned allocator faults on every call's temporaries
    # tuned: none once the heap has grown to the program's peak; once in a few runs it grew by 128 MiB more (32,768
    # faults) inside the counted calls, and 20-call runs saw 49,000-66,000 against 328,000-345,000: the bar is 2x fewer
    assert tuned["faults"] * 2 <= default["faults"], (tuned, default)


@pytest.mark.parametrize(
    ("env", "applies", "why"),
    [
        ({"JAX_PLATFORMS": "cpu"}, True, "XLA on CPU"),
        ({"JAX_PLATFORMS": "cpu", hm.OPT_OUT: "default"}, False, "RLPIPE_HOST_MALLOC=default"),
        ({"JAX_PLATFORMS": "cuda"}, False, "JAX_PLATFORMS=cuda"),
        ({"JAX_PLATFORMS": "tpu,cpu"}, False, "JAX_PLATFORMS=tpu,cpu"),
        ({"JAX_PLATFORMS": "cpu", "MALLOC_ARENA_MAX": "4"}, False, "malloc is tuned by the environment already"),
        ({"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, False, "tuned by the environment"),
    ],
)
def test_the_setting_applies_only_to_untuned_cpu_processes(env: dict[str, str], applies: bool, why: str) -> None:
    if not hm.wanted({"JAX_PLATFORMS": "cpu"})[0]:
        pytest.skip("not glibc: the setting never applies")
    ok, reason = hm.wanted(env)
    assert ok is applies and why in reason, (ok, reason)


@pytest.mark.parametrize(
    ("default", "applies"), [("cpu", True), ("cuda,cpu", False), ("rocm,cpu", False), (None, False)]
)
def test_unset_platforms_follow_the_step_default(
    monkeypatch: pytest.MonkeyPatch, default: str | None, applies: bool
) -> None:
    """JAX_PLATFORMS unset or empty: the machine's step default decides (None: libtpu installed, JAX takes the TPU)."""
    if not hm.wanted({"JAX_PLATFORMS": "cpu"})[0]:
        pytest.skip("not glibc: the setting never applies")
    monkeypatch.setattr(hm, "default_jax_platforms", lambda: default)
    assert hm.wanted({})[0] is applies
    assert hm.wanted({"JAX_PLATFORMS": ""})[0] is applies


ARENAS_AT_EXIT = """
import atexit


def _report() -> None:
    from policy import _host_malloc

    print("arenas at exit:", _host_malloc.arena_count(), flush=True)


atexit.register(_report)
"""


@pytest.mark.skipif(not hm.wanted({"JAX_PLATFORMS": "cpu"})[0], reason="not glibc: the setting does not apply")
def test_a_step_process_tied_to_its_starter_keeps_one_arena(tmp_path: Path) -> None:
    """A step started by a job runner (tied to it: its parent watch starts a thread at once) has its threads on the
    main heap: the setting comes before that thread. With the thread first it had an arena of its own, which XLA's
    threads later shared, mapping a fresh buffer above 64 MiB every train step (docstring of `policy._host_malloc`).
    A `sitecustomize` on the path reports the arenas when the process exits (`--help`: it exits at once)."""
    from pipeline.process.parent_watch import starter_env

    (tmp_path / "sitecustomize.py").write_text(ARENAS_AT_EXIT)
    env = _untuned_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), **starter_env())
    proc = subprocess.run(
        [sys.executable, "-m", "steps.gc", "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "arenas at exit: 1" in proc.stdout, (proc.stdout[-500:], proc.stderr[-2000:])
    assert "allocator arenas existed" not in proc.stderr


@pytest.mark.skipif(not hm.wanted({"JAX_PLATFORMS": "cpu"})[0], reason="not glibc: the setting does not apply")
def test_install_reports_arenas_made_by_threads_that_started_first() -> None:
    """A process whose thread allocated before the setting: `install()` says so (one warning line)."""
    program = (
        "import threading\n"
        "allocated, go = threading.Event(), threading.Event()\n"
        "def work():\n"
        "    _ = [bytearray(100) for _ in range(1000)]\n"
        "    allocated.set(); go.wait()\n"
        "t = threading.Thread(target=work); t.start()\n"
        "allocated.wait()\n"
        "import policy\n"
        "from policy import _host_malloc\n"
        "print('arenas', _host_malloc.arena_count()); go.set(); t.join()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=_untuned_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "arenas 2" in proc.stdout, proc.stdout
    assert "2 allocator arenas existed before the setting" in proc.stderr, proc.stderr[-2000:]
