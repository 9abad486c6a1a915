"""The replay step: prove that the learner is a pure function of (checkpoint, batches).

Reads (never writes): the run root's `run.json` (model, train, optimizer, loss), the committed checkpoint
`checkpoints/step-S/`, the committed batches of slots S+1..T, policy 0 (the reference model, when the loss uses
one) and the committed policy T. Writes: the replayed policy T into a scratch run root (`--scratch`, default a
new temporary folder), never into the run.

Phases: (1) restore checkpoint S exactly as the learner resumes; (2) train slots S+1..T with the learner's own
batch reading and jitted train step (`policy.learner`); (3) publish the result as policy T in the scratch root
and load it back with `policy.policy_format.read_policy`, the way samplers load the run's policy T; (4) compare tensor
by tensor with the run's committed policy T. Prints "bitwise equal" and exits 0, or prints the maximum absolute
difference of every differing tensor and exits 1. A from/to step that is not committed is one line naming the
field and the value, exit code 2.

    python -m steps.replay --store.run_root runs/demo --from_step 4 --to_step 6
    make replay RUN=runs/demo FROM=4 TO=6
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import ConfigError, LearnerStepConfig, StoreConfig
from pipeline.jobs.job import recorded_step_config
from pipeline.process.step_kind import StepKind
from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore, require_run

logger = logging.getLogger("steps.replay")


@dataclass(frozen=True)
class ReplayConfig:
    """`python -m steps.replay`: re-train committed batch slots from a committed checkpoint and compare."""

    store: StoreConfig = field(default_factory=StoreConfig)
    from_step: int = 0
    """The committed checkpoint to start from (FROM): slots from_step+1..to_step are re-trained."""
    to_step: int | None = None
    """The committed policy to compare with (TO); None: the newest committed policy."""
    scratch: str | None = None
    """Scratch run root for the replayed policy (local or fsspec URL); None: a new temporary folder."""


def main(config: ReplayConfig) -> int:
    """Replay and compare (see the module docstring); 0 when bitwise equal, 1 when not."""
    from policy import learner as L
    from policy import policy_format as pf

    store = RunStore(config.store.run_root, config.store.storage_options or None)
    require_run(store)
    learner_config = recorded_learner_config(store)
    to_step = check_steps(store, config.from_step, config.to_step)
    replayed = replay(store, learner_config, config.from_step, to_step)  # 1 + 2
    scratch = RunStore(scratch_root(config, store), config.store.storage_options or None)
    copy_lora_base(store, scratch, learner_config)
    L.publish_policy(scratch, replayed, learner_config)  # 3
    vocab = int(replayed.model.Vocab.size)
    ours = pf.read_policy(scratch, to_step, learner_config.model, vocab)
    theirs = pf.read_policy(store, to_step, learner_config.model, vocab)
    diffs = compare(theirs, ours)  # 4
    print(f"replayed slots {config.from_step + 1}..{to_step} from checkpoint {config.from_step} into {scratch.url}")
    if not diffs:
        print(f"bitwise equal: every parameter of the replay equals the run's committed policy {to_step}")
        return 0
    print(f"NOT equal to the run's committed policy {to_step}: {len(diffs)} tensors differ (max abs difference):")
    for name, diff in diffs.items():
        print(f"  {name}: {diff:.3e}")
    return 1


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


def replay(store: RunStore, config: LearnerStepConfig, from_step: int, to_step: int) -> Any:
    """The learner state after training slots from_step+1..to_step from checkpoint `from_step` (read-only)."""
    from pipeline.environments.tokenizer import load_tokenizer
    from policy import learner as L
    from policy import mesh as mesh_lib
    from policy import model as M
    from policy import policy_format as pf
    from policy.losses import loss_module_from_config

    vocab = M.model_vocab_size(load_tokenizer(config.model.tokenizer))
    optimizer = L.build_optimizer(config.optimizer, config.train.num_train_steps)
    lm = mesh_lib.build_mesh(config.mesh)
    # the learner's own slot step (epochs, minibatches, microbatches) on the same mesh: bitwise the same updates
    state = L.shard_state(pf.read_checkpoint(store, from_step, config.model, vocab, optimizer), lm)
    reference = L.load_reference(store, config, vocab, loss_module_from_config(config.loss))
    if reference is not None:
        reference = mesh_lib.shard_params(reference, lm)
    train_step = L.mesh_train_step(config, lm)
    for slot in range(from_step + 1, to_step + 1):
        batch, data_file = L.read_batch(store, slot, store.read_log_entry(slot), config.train, vocab, lm)
        model, opt_state, _ = train_step(state.model, state.opt_state, reference, batch)
        state = pf.LearnerState(slot, model, opt_state, state.parent)
        logger.info("replayed batch slot %d (%s)", slot, data_file)
    return state


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


def compare(reference: Any, candidate: Any) -> dict[str, float]:
    """{parameter path: max |reference - candidate|} of every tensor that is not bitwise equal."""
    import equinox as eqx
    import jax
    import numpy as np

    ref = jax.tree_util.tree_flatten_with_path(eqx.filter(reference, eqx.is_array))[0]
    cand = jax.tree_util.tree_leaves(eqx.filter(candidate, eqx.is_array))
    out: dict[str, float] = {}
    for (path, a), b in zip(ref, cand, strict=True):
        x, y = np.asarray(a), np.asarray(b)
        if x.shape != y.shape:
            out[jax.tree_util.keystr(path)] = float("inf")
        elif not np.array_equal(x, y):
            out[jax.tree_util.keystr(path)] = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
    return out


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.replay --store.run_root R --from_step S [--to_step T] [--scratch DIR]`; the exit code."""
    from steps.cli import run_program

    return run_program(ReplayConfig, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
