"""The TRL comparison's CPU accounting (`bench.common.TreeCpu`, `bench.bench_trl._spawn` / `cpu_breakdown`): real
processes burning real CPU, the whole tree's exact figure against what each process used."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.bench_trl import _spawn, cpu_breakdown, cpu_by_phase, rlpipe_phases
from bench.common import TreeCpu, process_role

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
"""A program that uses `s` CPU seconds (its own process time, whatever the machine's load)."""


def test_roles_from_command_lines() -> None:
    py = sys.executable
    assert process_role([py, "-m", "steps.learn", "--config_path", "x.yaml"]) == "learner"
    assert process_role([py, "-m", "steps.rollout", "--config_path", "w0.yaml"]) == "rollout"
    assert process_role([py, "-m", "steps.make_batches", "--config_path", "b.yaml"]) == "batchmaker"
    assert process_role([py, "-m", "steps.evaluate", "--config_path", "e.yaml"]) == "evaluator"
    assert process_role([py, "-m", "steps.run", "--config_path", "configs/demo_cats.yaml"]) == "runner"
    assert process_role([py, "-m", "steps.forkserver", "--fd", "4", "--preload", "steps.learn"]) == "fork server"
    # a title set by setproctitle comes back as one string
    assert process_role([f"{py} -m steps.learn --config_path x.yaml"]) == "learner"
    # `steps.run step learn` is the runner's program, whatever its arguments name
    assert process_role([py, "-m", "steps.run", "step", "learn"]) == "runner"
    assert process_role([py, "-c", "pass"]) == "other"


def test_whole_tree_cpu_is_exact_and_split_by_process() -> None:
    """A parent using 0.2 CPU s that starts and waits for a child using 0.4: the tree's exact CPU (rusage of the
    reaped root) holds both; the sampled per-process figure sees both processes, within a sampling period."""
    child = BURN.format(s=0.4)
    parent = (
        BURN.format(s=0.2) + f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {child!r}], check=True)\n"
    )
    run = _spawn([sys.executable, "-c", parent], 120)
    assert run["cpu_s"] >= 0.6
    sampled = run["tree"].by_role()
    assert set(sampled) == {"other"}
    assert 0.3 <= sampled["other"] <= run["cpu_s"] + 0.05
    assert len(run["tree"].roles) == 2  # both pids were seen


def test_steady_state_is_the_cpu_between_the_third_step_and_the_last() -> None:
    """A process that burns 0.2 CPU s per 'step' after a 0.5 CPU s 'start-up', printing each step's end time: the
    steady-state figure is the CPU between the third step and the last over the steps between them."""
    prog = (
        BURN.format(s=0.5)
        + "import sys\n"
        + "".join(BURN.format(s=0.2) + "print(time.time(), flush=True)\n" for _ in range(6))
    )
    t0 = time.time()
    with subprocess.Popen([sys.executable, "-c", prog], stdout=subprocess.PIPE, text=True) as proc:
        tree = TreeCpu(proc.pid, period_s=0.1)
        out, _ = proc.communicate(timeout=120)
        tree.stop()
    times = [float(line) for line in out.split()]
    assert len(times) == 6 and times[0] > t0
    figs = cpu_breakdown(tree, tree.cpu_s, times, 6)
    assert figs["steady_steps"] == 3
    # each step is 0.2 CPU s; a sample may lag a step's end by a period (longer on a loaded machine)
    assert figs["cpu_s_per_step_steady"] == pytest.approx(0.2, abs=0.07)
    assert figs["cpu_s_per_step"] > figs["cpu_s_per_step_steady"]  # the whole run includes the start-up


def test_steady_cpu_is_split_by_the_phases_intervals() -> None:
    """A process alternating 0.2 CPU s of work (its start and end times printed) with 0.2 s idle: cut at the work
    intervals, the steady-state CPU per step is the work's, and what falls outside them is near nothing."""
    step = (
        "t0 = time.time()\n" + BURN.format(s=0.2) + "print(t0, time.time(), flush=True)\n"
        "time.sleep(0.2)\n"  # idle between steps (the phase's complement), not a wait on anything
    )
    prog = BURN.format(s=0.1) + "".join(step for _ in range(5))
    with subprocess.Popen([sys.executable, "-c", prog], stdout=subprocess.PIPE, text=True) as proc:
        tree = TreeCpu(proc.pid, period_s=0.05)
        out, _ = proc.communicate(timeout=120)
        tree.stop()
    spans = [(float(a), float(b)) for a, b in (line.split() for line in out.splitlines())]
    assert len(spans) == 5
    ends = [b for _, b in spans]
    split = cpu_by_phase(tree, ends[2], ends[-1], 2, {"other": [("work", spans)]})
    assert set(split) == {"work", "other: other"}
    # each step's work is 0.2 CPU s; a sample period straddling an interval's edge is shared by time
    assert split["work"] == pytest.approx(0.2, abs=0.06)
    assert split["other: other"] < 0.06


def test_the_rollout_workers_sampling_intervals_are_pooled_without_overlap() -> None:
    """Two workers sampling at overlapping times: their intervals are one union (no second counted twice)."""
    writes = [
        {"event": "write", "generate_started_at": 1.0, "generated_at": 3.0, "rollout_committed_at": 3.5},
        {"event": "write", "generate_started_at": 2.0, "generated_at": 4.0, "rollout_committed_at": 4.2},
        {"event": "write", "generate_started_at": 5.0, "generated_at": 6.0, "rollout_committed_at": 6.1},
    ]
    phases = dict(rlpipe_phases({"rollout": writes})["rollout"])
    assert phases["rollout: sampling"] == [(1.0, 4.0), (5.0, 6.0)]
