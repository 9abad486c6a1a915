"""The replay step: prove that the learner is a pure function of (checkpoint, batches).

Reads (never writes): the run root's `run.json` (model, train, optimizer, loss), the committed checkpoint
`checkpoints/step-S/`, the committed batches of slots S+1..T, policy 0 (the reference model, when the loss uses
one) and the committed policy T. Writes: the replayed policy T into a scratch run root (`--scratch`, default a
new temporary folder, named at the start and removed at the end unless `--keep_scratch true`), never into the run.

Phases: (1) restore checkpoint S exactly as the learner resumes; (2) train slots S+1..T with the learner's own
batch reading and jitted train step (`policy.learner`); (3) publish the result as policy T in the scratch root
and load it back with `policy.policy_format.read_policy`, the way samplers load the run's policy T; (4) compare tensor
by tensor with the run's committed policy T. Prints "bitwise equal" and exits 0, or prints the maximum absolute
difference of every differing tensor and ends with one line `error: replay mismatch: …` naming the first one, exit
code 10 (`Exit.REPLAY_MISMATCH`). A from/to step that is not committed is one line naming the field and the value,
exit code 2.
`main` runs these phases; the machinery (the recorded topology, the replay group, the scratch root, the comparison)
lives in `policy.replay`, and the slots are retrained by `policy.learner.replay_slots`.

Replay runs on the learner's recorded mesh (`recorded_topology`): the job's `learner.mesh` and
`learner.num_processes` (run.json; also the shard files of checkpoint S), with an axis of -1 resolved from
checkpoint S's blocks (one per device that holds a distinct piece of a sharded tensor). On CPU the simulated
devices are made before JAX starts (`jax_num_cpu_devices`); on accelerators the devices present must match.
A run whose learner ran as N > 1 processes is replayed by N processes (`run_group`): this process starts N copies
of itself on this host, wired to one coordinator on loopback (its port reserved by this process until the group
has ended: `pipeline.process.ports.reserve_port`) through `RLPIPE_COORDINATOR`,
`RLPIPE_NUM_PROCESSES` and `RLPIPE_PROCESS_ID` (as the job runners start a learner group; each with the recorded
devices per process, simulated on CPU through XLA_FLAGS) and sharing one scratch run root. Each starts
`jax.distributed`, reads its own rows of every batch and takes part in the policy's gather; process 0 alone writes
the policy, compares and prints, and its exit code is replay's. A process that fails stops the group: one line
names it, and the exit code is non-zero. A process started with those variables already set (by replay, or by a
cluster launcher on each host) is one member of such a group.

    python -m steps.replay --store.run_root runs/demo --from_step 4 --to_step 6
    make replay RUN=runs/demo FROM=4 TO=6
"""

from __future__ import annotations

import shutil
import sys

from pipeline.config import ReplayConfig
from pipeline.process.exits import ReplayMismatchError
from pipeline.store.storage import RunStore, require_run
from policy.replay import (
    check_steps,
    compare,
    copy_lora_base,
    group_member,
    recorded_learner_config,
    recorded_topology,
    run_group,
    scratch_root,
    use_recorded_devices,
)
from steps.cli import run_program, step_main

HEAVY_MODULES = ("policy.learner", "policy.mesh", "policy.policy_format")
"""What `main` imports (JAX, levanter, the model): loaded once the config is checked (`steps.cli.step_main`)."""


def main(config: ReplayConfig) -> int:
    """Replay and compare (see the module docstring); 0 when bitwise equal, else ReplayMismatchError (exit code
    `Exit.REPLAY_MISMATCH`, one line naming the first differing tensor)."""
    from policy import learner as L
    from policy import mesh as mesh_lib
    from policy import policy_format as pf

    store = RunStore(config.store.run_root, config.store.storage_options or None)
    require_run(store)
    learner_config = recorded_learner_config(store)
    to_step = check_steps(store, config.from_step, config.to_step)
    member = group_member()
    if member is not None:  # one process of a replay group: jax.distributed before any device is touched
        mesh_lib.initialize_distributed(member)
    topology = recorded_topology(store, learner_config, config.from_step)
    if member is None and topology.processes > 1:
        return run_group(config, store, topology, "steps.replay")
    refusal = use_recorded_devices(topology)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    replayed = L.replay_slots(store, learner_config, config.from_step, to_step)  # 1 + 2
    writer = mesh_lib.is_writer()  # process 0 of a group (or the only process) writes, reads back and compares
    scratch = RunStore(scratch_root(config, store), config.store.storage_options or None)
    temporary = config.scratch is None and not config.keep_scratch  # made here: removed once compared
    if writer and (member is None or temporary):  # in a group replay started, its starter named the scratch root
        print(f"scratch run root: {scratch.url}" + (" (temporary: removed at the end; --keep_scratch true keeps it)"
              if temporary else ""), flush=True)  # fmt: skip
    try:
        if writer:
            copy_lora_base(store, scratch, learner_config)
        L.publish_policy(scratch, replayed, learner_config)  # 3: every process gathers, process 0 writes
        if not writer:
            return 0
        vocab = int(replayed.model.Vocab.size)
        ours = pf.read_policy(scratch, to_step, learner_config.model, vocab)
        theirs = pf.read_policy(store, to_step, learner_config.model, vocab)
        diffs = compare(theirs, ours)  # 4
    finally:
        if temporary:
            shutil.rmtree(scratch.root, ignore_errors=True)
    where = f"{scratch.url} (removed)" if temporary else scratch.url
    procs = f" on {topology.processes} processes" if topology.processes > 1 else ""
    print(f"replayed slots {config.from_step + 1}..{to_step} from checkpoint {config.from_step}{procs} into {where}")
    if not diffs:
        print(f"bitwise equal: every parameter of the replay equals the run's committed policy {to_step}")
        return 0
    print(f"NOT equal to the run's committed policy {to_step}: {len(diffs)} tensors differ:")
    for name, diff in diffs.items():
        print(f"  {name}: {diff}", flush=True)
    name, diff = next(iter(diffs.items()))
    raise ReplayMismatchError(
        f"policy {to_step} replayed from checkpoint {config.from_step} differs from the run's committed policy in "
        f"{len(diffs)} tensors; first {name}: {diff}"
    )


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.replay --store.run_root R --from_step S [--to_step T] [--scratch DIR]
    [--keep_scratch true]`; the exit code."""
    return run_program(ReplayConfig, step_main(main, HEAVY_MODULES), argv)


if __name__ == "__main__":
    sys.exit(cli())
