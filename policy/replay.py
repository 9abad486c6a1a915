"""Replay's machinery (`python -m steps.replay`, whose `main` runs it as phases): the learner's recorded topology,
the replay group, the scratch run root and the tensor-by-tensor comparison. The slots themselves are retrained by
`policy.learner.replay_slots`.

The learner's recorded mesh (`recorded_topology`): the job's `learner.mesh` and `learner.num_processes` (run.json;
also the shard files of checkpoint S), with an axis of -1 resolved from checkpoint S's blocks (one per device that
holds a distinct piece of a sharded tensor). On CPU the simulated devices are made before JAX starts
(`use_recorded_devices`: `jax_num_cpu_devices`); on accelerators the devices present must match. A run whose learner
ran as N > 1 processes is replayed by N processes (`run_group`): N copies of the replay program on this host, wired
to one coordinator on loopback (its port reserved until the group has ended: `pipeline.process.ports.reserve_port`)
through `RLPIPE_COORDINATOR`, `RLPIPE_NUM_PROCESSES` and `RLPIPE_PROCESS_ID` (`group_member`), sharing one scratch
run root; a process that fails stops the group (`wait_group`).

JAX-free at import (JAX is imported by the functions that use it), so the replay program checks its config first.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from pipeline.config import ConfigError, DistributedConfig, LearnerStepConfig, ReplayConfig
from pipeline.jobs.job import recorded_step_config
from pipeline.process.step_kind import StepKind
from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore

GROUP_EXIT_GRACE_S = 60.0
"""How long the other processes of a replay group may take to end once process 0 has ended (they only leave
`jax.distributed`); past it they are killed and replay fails."""


def group_member() -> DistributedConfig | None:
    """This process's place in a replay group when `RLPIPE_PROCESS_ID` and `RLPIPE_NUM_PROCESSES` > 1 say it is
    one (set by `run_group`, or by a launcher on each host); else None (replay starts the group itself)."""
    pid, num = os.environ.get("RLPIPE_PROCESS_ID"), os.environ.get("RLPIPE_NUM_PROCESSES")
    if pid is None or num is None or int(num) <= 1:
        return None
    return DistributedConfig(
        coordinator_address=os.environ.get("RLPIPE_COORDINATOR"), num_processes=int(num), process_id=int(pid)
    )


def run_group(config: ReplayConfig, store: RunStore, topology: Topology, program: str) -> int:
    """Replay as `topology.processes` copies of `python -m <program>` (the replay program, `steps.replay`) on this
    host (see the module docstring); process 0's exit code, or (one line on stderr naming the process) a non-zero
    one when another process failed or did not end within GROUP_EXIT_GRACE_S of process 0."""
    import dataclasses
    import subprocess

    import draccus

    from pipeline.process.parent_watch import starter_env
    from pipeline.process.ports import reserve_port

    n = topology.processes
    root = scratch_root(config, store)
    temporary = config.scratch is None and not config.keep_scratch
    print(f"scratch run root: {RunStore(root, config.store.storage_options or None).url}"
          + (" (temporary: removed at the end; --keep_scratch true keeps it)" if temporary else "")
          + f"; replaying as {n} processes ({topology.describe()})", flush=True)  # fmt: skip
    folder = tempfile.mkdtemp(prefix="rlpipe-replay-group-")
    path = os.path.join(folder, "replay.yaml")
    with open(path, "w", encoding="utf-8") as f:  # every process: the same config and the same scratch root
        draccus.dump(dataclasses.replace(config, scratch=root), f)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={topology.devices_per_process}")  # CPU only
    port = reserve_port()  # held until the group has ended: nobody else can take the coordinator's port
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(n):
            # each ends with this process (a SIGKILLed replay included), not waiting in a collective forever
            env = {**os.environ, "XLA_FLAGS": " ".join(flags), "RLPIPE_COORDINATOR": port.address,
                   "RLPIPE_NUM_PROCESSES": str(n), "RLPIPE_PROCESS_ID": str(i), **starter_env()}  # fmt: skip
            procs.append(subprocess.Popen([sys.executable, "-m", program, "--config_path", path], env=env))
        return wait_group(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        port.close()
        shutil.rmtree(folder, ignore_errors=True)
        if temporary:
            shutil.rmtree(root, ignore_errors=True)


def wait_group(procs: list[Any]) -> int:
    """Process 0's exit code once every process of the group has ended; a failing process (any, before process 0
    ends) stops the group at once, since the others would wait for it in a collective."""
    import time

    n = len(procs)
    while procs[0].poll() is None:
        failed = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed:
            i, code = failed[0]
            print(f"replay process {i} of {n} failed (exit code {code}); the other processes were stopped",
                  file=sys.stderr)  # fmt: skip
            return code if code > 0 else 1
        time.sleep(0.1)
    code = int(procs[0].returncode)
    if code != 0:  # the others may wait for it in a collective: stop them now
        return code if code > 0 else 1
    deadline = time.monotonic() + GROUP_EXIT_GRACE_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for i, p in enumerate(procs):
        if p.poll() is None or p.returncode != 0:
            why = (
                f"exit code {p.returncode}"
                if p.poll() is not None
                else f"still running {GROUP_EXIT_GRACE_S:.0f} s after process 0"
            )
            print(f"replay process {i} of {n} failed ({why})", file=sys.stderr)
            return p.returncode if p.poll() is not None and p.returncode > 0 else 1
    return code


@dataclass(frozen=True)
class Topology:
    """The learner's devices as a run recorded them: `processes` × `devices_per_process` on `mesh`."""

    processes: int
    devices: int
    """All devices of all processes (the mesh's size)."""
    mesh: Any

    @property
    def devices_per_process(self) -> int:
        return max(self.devices // self.processes, 1)

    def describe(self) -> str:
        data, fsdp, model = self.mesh.resolve(self.devices)
        axes = " ".join(f"{k}={v}" for k, v in (("data", data), ("fsdp", fsdp), ("model", model)) if v > 1)
        procs = f"{self.processes} process{'es' if self.processes > 1 else ''}"
        return f"{procs} × {self.devices_per_process} devices (mesh {axes or 'of one device'})"


def recorded_topology(store: RunStore, config: LearnerStepConfig, step: int) -> Topology:
    """The learner's process count and mesh size: the config's `distributed.num_processes` (also the number of
    shard files of checkpoint `step`) and `mesh`; an axis of -1 is resolved from the checkpoint's blocks (each
    sharded tensor is cut into fsdp × model blocks; data replicas write none), else the devices present now."""
    import json

    mesh = config.mesh
    processes = config.distributed.num_processes
    blocks: int | None = None
    try:
        marker = json.loads(store.get(layout.checkpoint_marker(step)))
        processes = max(processes, len(marker.get("files") or {}))
        if marker.get("tensors"):
            blocks = max(len(t.get("blocks", [])) for t in marker["tensors"].values())
    except (FileNotFoundError, ValueError, AttributeError):  # an older whole-pytree checkpoint: no blocks
        pass
    if -1 not in (mesh.data, mesh.fsdp, mesh.model):
        devices = mesh.data * mesh.fsdp * mesh.model
    elif mesh.data != -1 and blocks is not None:  # fsdp or model is -1: each sharded tensor has fsdp × model blocks
        devices = mesh.data * blocks
    else:  # data replicas leave no trace in the blocks: the devices present decide (each process's, N processes)
        import jax

        devices = jax.device_count() * max(processes // jax.process_count(), 1)
    return Topology(processes=processes, devices=max(devices, 1), mesh=mesh)


def use_recorded_devices(topology: Topology) -> str | None:
    """Make the recorded number of devices where that is still possible (one process on CPU, before JAX's backend
    starts); None when this process (with the other processes of its group) now has the recorded mesh's devices
    and process count, else the one-line refusal saying what is needed."""
    import jax
    from jax._src import xla_bridge

    needs = f"this run's learner ran on {topology.describe()}; replay needs the same"
    if topology.processes > 1:  # a member of a replay group: jax.distributed is started, the devices are made
        running = jax.process_count()
        if running != topology.processes:
            return (
                f"{needs}: {topology.processes} processes, this replay has {running} (RLPIPE_NUM_PROCESSES; "
                "unset, replay starts the recorded processes itself)"
            )
    elif not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", topology.devices)  # CPU only; accelerators have what they have
    have = jax.device_count()
    if have != topology.devices:
        return f"{needs}: {topology.devices} devices, this process has {have} {jax.default_backend()} devices"
    return None


def copy_lora_base(store: RunStore, scratch: RunStore, config: LearnerStepConfig) -> None:
    """Copy policy 0 (the base weights) into `scratch` when policies are published as LoRA adapters: a policy
    of adapters is read together with policy 0 of its own run root."""
    lora = config.model.lora
    if lora is None or lora.publish != "adapters" or scratch.exists(layout.policy_marker(0)):
        return
    for rel in store.list(layout.policy_dir(0)):
        if not rel.endswith(layout.COMMIT_MARKER):
            scratch.put_unique(rel, store.get(rel))
    scratch.put_if_absent(layout.policy_marker(0), store.get(layout.policy_marker(0)))  # the marker last


def recorded_learner_config(store: RunStore) -> LearnerStepConfig:
    """The learner's config as the run's run.json gives it (model, train, optimizer, loss)."""
    learner: LearnerStepConfig = recorded_step_config(store, StepKind.LEARNER)
    return learner


def check_steps(store: RunStore, from_step: int, to_step: int | None) -> int:
    """The step to compare with; ConfigError naming `from_step` / `to_step` when either is not committed."""
    from policy import policy_format as pf

    checkpoints = pf.committed_checkpoints(store)
    if from_step not in checkpoints:
        raise ConfigError("from_step", from_step, f"not a committed checkpoint of {store.url} (have {checkpoints})")
    if to_step is None:
        to_step = run_state.latest_policy_step(store)
    if to_step is None or to_step <= from_step or not store.exists(layout.policy_marker(to_step)):
        raise ConfigError("to_step", to_step, f"must be a committed policy of {store.url} after from_step={from_step}")
    for slot in range(from_step + 1, to_step + 1):
        if not store.exists(layout.batch_log_entry(slot)):
            raise ConfigError("to_step", to_step, f"batch slot {slot} is not committed in {store.url}")
    return to_step


def scratch_root(config: ReplayConfig, store: RunStore) -> str:
    """The scratch run root: `config.scratch`, or a new temporary folder; ConfigError if it lies in the run root."""
    if config.scratch is None:
        return tempfile.mkdtemp(prefix="rlpipe-replay-")
    scratch = RunStore(config.scratch, config.store.storage_options or None)
    inside = scratch.protocol == store.protocol and (
        scratch.root == store.root or scratch.root.startswith(store.root.rstrip(os.sep + "/") + "/")
    )
    if inside:
        raise ConfigError("scratch", config.scratch, f"must lie outside the run root {store.url}")
    return config.scratch


@dataclass(frozen=True)
class Difference:
    """How one tensor differs: the largest absolute difference and the first differing element (its index in
    the tensor, the run's value and the replay's)."""

    max_abs: float
    index: tuple[int, ...] = ()
    theirs: float = 0.0
    ours: float = 0.0
    shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def __str__(self) -> str:
        if self.shapes is not None:
            return f"shape {self.shapes[0]} in the run, {self.shapes[1]} in the replay"
        at = "[" + ", ".join(map(str, self.index)) + "]"
        return f"max abs difference {self.max_abs:.3e}; first at {at}: run {self.theirs!r}, replay {self.ours!r}"

    def __float__(self) -> float:
        return self.max_abs

    def __gt__(self, other: object) -> bool:
        return self.max_abs > float(other)  # type: ignore[arg-type]

    def __lt__(self, other: object) -> bool:
        return self.max_abs < float(other)  # type: ignore[arg-type]


def compare(reference: Any, candidate: Any) -> dict[str, Difference]:
    """{parameter path: how it differs} of every tensor that is not bitwise equal (see `Difference`)."""
    import equinox as eqx
    import jax
    import numpy as np

    ref = jax.tree_util.tree_flatten_with_path(eqx.filter(reference, eqx.is_array))[0]
    cand = jax.tree_util.tree_leaves(eqx.filter(candidate, eqx.is_array))
    out: dict[str, Difference] = {}
    for (path, a), b in zip(ref, cand, strict=True):
        x, y = np.asarray(a), np.asarray(b)
        name = jax.tree_util.keystr(path)
        if x.shape != y.shape:
            out[name] = Difference(float("inf"), shapes=(tuple(x.shape), tuple(y.shape)))
        elif not np.array_equal(x, y):
            differs = x != y
            index = tuple(int(i) for i in np.unravel_index(int(np.argmax(differs)), x.shape))
            out[name] = Difference(
                float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))),
                index,
                x[index].item(),
                y[index].item(),
            )
    return out
