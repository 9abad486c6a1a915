"""Ctrl-C and SIGTERM end every program with one line and a documented code, never a traceback.

Each program is started as a user starts it (`rlpipe <command>`, in a process group of its own as a shell runs a
foreground job) in a state where it has work or a wait ahead of it (a learner waiting for its batch, SFT training,
`serve` waiting for its run, a job starting its steps, …), and SIGINT is sent to its process group, as a terminal's
Ctrl-C is, at a random point after its first line of output: `random.Random(SEED)` draws each program's delay, so
a run lands where the machine's speed puts it (imports, JAX compiling, a wait, a training step) and every such
point must end the same way. The code is the program's documented one (docs/reference/exit-codes.md): 130, or 0
for the steps with a clean stop of their own, or the program's own code when it ended before the signal (the
bounded programs). SIGTERM (a scheduler's stop) is sent to an evaluator waiting for a policy and to the recipe's
SFT phase: one line, 143. A Ctrl-C that lands in a garbage-collection callback still stops the program.

Cost: one process per program, most of them ending before they import JAX; the JAX ones (learn, rollout, recipe,
run, demo) are interrupted within a few seconds of their start, SFT within 12 s (its training starts after ~8 s).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipeline.process.exits import Exit

ROOT = Path(__file__).resolve().parents[1]
TEST_CONFIG = ROOT / "configs/test_cats.yaml"
RLPIPE = Path(sys.executable).parent / "rlpipe"
SEED = 20261128
FIRST_LINE_S = 180.0
"""Bound on a program's first line of output (a loaded machine)."""
STOP_S = 180.0
"""Bound on a program's exit after the signal (a job stops its steps: up to 20 s each, `STOP_GRACE_S`)."""

INTERRUPT_LINE = "error: interrupted: stopped by SIGINT (Ctrl-C)"
TERMINATE_LINE = "error: terminated: stopped by SIGTERM"


@dataclass(frozen=True)
class Program:
    """One program in a state with work ahead of it: its `rlpipe` arguments (given the test's folder), what must
    exist first (`prepare`), the longest delay drawn, and the codes it may end with besides 130."""

    name: str
    args: Callable[[Path], list[str]]
    max_delay_s: float
    also: frozenset[int] = frozenset()
    prepare: Callable[[Path], None] = field(default=lambda tmp: None)
    cwd: Callable[[Path], Path] = field(default=lambda tmp: ROOT)


def made_run(tmp: Path) -> None:
    """`tmp/run` with run.json (configs/test_cats.yaml), made by a bounded BatchMaker that finds nothing to do."""
    proc = subprocess.run([str(RLPIPE), "batches", "--config_path", str(TEST_CONFIG), "--run_root", str(tmp / "run"),
                           "--max_batches", "1", "--polling.bounded_wait_s", "0.2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def recipe_folder(tmp: Path) -> None:
    """A folder to run `rlpipe recipe` in: its configs/ (the recipe writes runs/<name>/ here)."""
    (tmp / "configs").symlink_to(ROOT / "configs")


def job(name: str, *flags: str) -> Callable[[Path], list[str]]:
    return lambda tmp: [name, "--config_path", str(TEST_CONFIG), "--run_root", str(tmp / "run"), *flags]


def on_run(name: str, *flags: str) -> Callable[[Path], list[str]]:
    return lambda tmp: [name, "--store.run_root", str(tmp / "run"), *flags]


CLEAN_STOP = frozenset({Exit.OK})
PROGRAMS = [
    Program("run", job("run"), 3.0),  # the job runner: starts its steps, then stops them
    Program("demo", lambda tmp: ["demo", "--config_path", str(TEST_CONFIG), "--run_root", str(tmp / "run")], 3.0),
    Program("learn", job("learn"), 4.0),  # publishes policy 0, then waits for batch slot 1
    Program("rollout", job("rollout"), 4.0, CLEAN_STOP),  # waits for policy 0
    Program("batches", job("batches", "--follow", "true"), 1.0, CLEAN_STOP, made_run),  # waits for rollouts
    Program("evaluate", on_run("evaluate", "--follow", "true"), 2.0, prepare=made_run),  # waits for policy 0
    Program("serve", lambda tmp: ["serve", "--run_root", str(tmp / "run")], 1.0),  # waits for run.json
    Program(
        "sft",
        lambda tmp: [
            "sft",
            "--config_path",
            str(ROOT / "configs/basic_arithmetic_sft.yaml"),
            "--store.run_root",
            str(tmp / "sft"),
            "--num_train_steps",
            "1000",  # the config's 100 steps can end (~60 ms each, compile cached) before the drawn point
        ],
        12.0,  # its training starts ~8 s after its first line (examples, model, compile)
    ),
    Program("recipe", lambda tmp: ["recipe"], 5.0, prepare=recipe_folder, cwd=lambda tmp: tmp),  # its SFT phase
    # bounded programs: the signal may come after their end (their own code then)
    Program("report", lambda tmp: ["report", str(tmp / "run")], 1.0, CLEAN_STOP, made_run),
    Program("gc", on_run("gc"), 1.0, CLEAN_STOP, made_run),
    Program(
        "export",
        on_run("export", "--out", "/nonexistent-never-written"),
        1.0,
        frozenset({Exit.CONFIG}),
        made_run,
    ),
    Program("replay", on_run("replay", "--from_step", "0"), 1.0, frozenset({Exit.CONFIG}), made_run),
    Program("rescore", on_run("rescore"), 1.0, frozenset({Exit.OK, Exit.CONFIG}), made_run),
]


@dataclass
class Output:
    """A started program's output lines as they come; `first` is set at the first line (or the end), `ended` once
    the output is read to its end."""

    lines: list[str] = field(default_factory=list)
    first: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)


def start(program: Program, tmp: Path) -> tuple[subprocess.Popen[str], Output]:
    """`rlpipe <args>` in a session of its own, its output read as it comes."""
    proc = subprocess.Popen([str(RLPIPE), *program.args(tmp)], cwd=program.cwd(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    out = Output()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.lines.append(line.rstrip("\n"))
            out.first.set()
        out.first.set()
        out.ended.set()

    threading.Thread(target=read, daemon=True).start()
    return proc, out


def stop_at_a_random_point(proc: subprocess.Popen[str], out: Output, delay_s: float, sig: int) -> int:
    """Wait for the first line, then `delay_s` (the drawn point), send `sig` to the process group; its exit code,
    once its output is read to the end (the last lines can still be in the pipe when the process has exited)."""
    try:
        assert out.first.wait(FIRST_LINE_S), "no output"
        threading.Event().wait(delay_s)  # the drawn point of the program's life; nothing is waited for
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
        code = proc.wait(timeout=STOP_S)
        # the last lines can still be in the pipe when the process has exited; a descendant still holding the pipe
        # (none should) bounds the wait, and the assertions then read what came
        out.ended.wait(STOP_S)
        return code
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


_DRAW = random.Random(SEED)
DELAYS = {p.name: _DRAW.random() for p in PROGRAMS}
"""Each program's point, as a fraction of its `max_delay_s` after its first line (seeded)."""


@pytest.mark.slow
@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_ctrl_c_at_a_random_point_ends_the_program_in_one_line(program: Program, tmp_path: Path) -> None:
    program.prepare(tmp_path)
    delay = program.max_delay_s * DELAYS[program.name]
    proc, out = start(program, tmp_path)
    started = time.monotonic()
    code = stop_at_a_random_point(proc, out, delay, signal.SIGINT)
    lines = out.lines
    output = "\n".join(lines)
    where = f"{program.name}: SIGINT {delay:.2f} s after its first line ({time.monotonic() - started:.1f} s)"
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, f"{where}:\n{output[-4000:]}"
    assert code in {Exit.INTERRUPTED, *program.also}, f"{where}: exit {code}\n{output[-4000:]}"
    if code == Exit.INTERRUPTED:  # the program's one line, or the job runner's own stop line
        assert INTERRUPT_LINE in lines or any("interrupted (SIGINT): stopping every step" in ln for ln in lines), (
            f"{where}:\n{output[-4000:]}"
        )


@pytest.mark.parametrize("name", ["evaluate", "recipe"])
def test_sigterm_is_one_line_and_143(name: str, tmp_path: Path) -> None:
    """An evaluator waiting for a policy; the recipe in its SFT phase (`rlpipe recipe` passes the SIGTERM on to the
    phase it runs, which ends with the line and 143, and so does the recipe)."""
    (program,) = [p for p in PROGRAMS if p.name == name]
    program.prepare(tmp_path)
    proc, out = start(program, tmp_path)
    code = stop_at_a_random_point(proc, out, 0.5, signal.SIGTERM)
    lines = out.lines
    output = "\n".join(lines)
    assert code == Exit.TERMINATED, output[-4000:]
    assert "Traceback" not in output and lines[-1] == TERMINATE_LINE, output[-4000:]


def test_ctrl_c_in_a_garbage_collection_callback_still_stops_the_program() -> None:
    """A Ctrl-C that lands in a garbage-collection callback (JAX registers one: seen in a learner that then waited
    for its batch with the interrupt lost) is delivered again once the callback returned: one line, 130, no
    "Exception ignored" traceback, long before the program's 60 s wait would end."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "exit_probe", "-1"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"}, timeout=120)  # fmt: skip
    assert proc.returncode == Exit.INTERRUPTED, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [INTERRUPT_LINE], proc.stderr[-3000:]
    assert time.monotonic() - started < 60, "the interrupt was lost: the program waited to its end"


def test_a_signal_after_the_code_is_decided_leaves_the_code() -> None:
    """A program that ended on its own ignores a Ctrl-C or SIGTERM from then on (`ignore_stop_signals`, what `rlpipe`
    does once its program returned): the signal does not replace its exit code. Found by the gc case above under
    load: a SIGINT that landed in Python's teardown, which restores the default action of signals with a Python
    handler, ended gc by the signal (-2, no line) after it had finished."""
    script = (
        "import os, signal, sys\n"
        "from pipeline.process.interrupts import ignore_stop_signals\n"
        "ignore_stop_signals()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (3, "")


def test_a_program_stopped_by_a_signal_skips_the_libraries_exit_functions() -> None:
    """`end_process` leaves JAX's backend clients as they are and waits for none of its effect tokens: JAX's exit
    functions destroy the clients (and collect XLA's garbage) and equinox's waits for JAX's tokens, which can crash a
    process whose computations were interrupted (exit -11 after the stop line, seen under load). Equinox unregisters
    JAX's token wait and registers its own copy, which an earlier `end_process` that unregistered only JAX's own
    still ran: the probes below see whether either ran."""
    script = (
        "import sys\n"
        "import equinox, jax.numpy as jnp\n"
        "from jax._src import xla_bridge\n"
        "import equinox._jit as ej\n"
        "from pipeline.process.interrupts import end_process\n"
        "waited = ej.wait_for_tokens\n"
        "def probe():\n"
        "    sys.stderr.write('tokens waited\\n')\n"
        "    waited()\n"
        "ej.wait_for_tokens = probe  # what equinox's exit function calls\n"
        "(jnp.ones(4) * 2).block_until_ready()\n"
        "import multiprocessing.util  # its exit function still runs (children of multiprocessing end)\n"
        "multiprocessing.util._exit_function = lambda: sys.stderr.write('children ended\\n')\n"
        "assert xla_bridge._backends\n"
        "end_process(130)\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-c", script]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr.strip().splitlines()[-1:]) == (130, ["children ended"]), done.stderr[-2000:]
    assert "tokens waited" not in done.stderr, done.stderr[-2000:]


def test_a_program_stopped_by_a_signal_skips_the_teardown() -> None:
    """After a stop by a signal, `rlpipe`'s process ends with `end_process`: its output flushed, its code kept, and
    neither an atexit function run nor an object finalized by the teardown (finalizing JAX/XLA objects while their
    threads still hold the interrupted work can crash the process: SIGSEGV, -11 instead of 130)."""
    script = (
        "import atexit, sys\n"
        "from pipeline.process.interrupts import end_process\n"
        "class Finalized:\n"
        "    def __del__(self):\n"
        "        sys.stderr.write('finalized\\n')\n"
        "kept = Finalized()\n"
        "atexit.register(lambda: sys.stderr.write('atexit\\n'))\n"
        "sys.stdout.write('buffered')\n"
        "end_process(130)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (130, "buffered", "")
