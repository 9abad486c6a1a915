"""The run.json contract: written once per run root, compared on every start.

`check_run_config()` writes `run.json` once or refuses a run root whose recorded contract differs, naming every
differing field; `check_step_config()` does the same for one step's config (every step program, started by the
runner, by `steps.run step NAME` or directly). `--allow_config_change true` accepts the change: run.json then
holds the new values and its `history` lists what changed, when and by which step.

Its own module, above both `pipeline.config` and `pipeline.store`: the contract is the job config's fields kept
in a run-root file, so the config package does not import the store for it.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
from typing import TYPE_CHECKING, Any

import draccus

from pipeline.config.base import ConfigError
from pipeline.config.job import RLJobConfig
from pipeline.store import layout
from pipeline.store.run_state import RUN_SCHEMA_VERSION, read_run_record

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore

logger = logging.getLogger(__name__)

CONTRACT_FIELDS = ("model", "train", "optimizer", "loss", "curriculum")
"""The fields of run.json that define the run's data contract: a step started with a different value of one of
these on the same run root would produce incompatible files."""

ALLOW_CHANGE_FLAG = "--allow_config_change"


def encode_config(cfg: Any) -> Any:
    """A JSON-ready dict of a config tree (draccus encoding: choice types carry `type`)."""
    return json.loads(json.dumps(draccus.encode(cfg), default=str))


def run_record(c: RLJobConfig) -> dict[str, Any]:
    """The content of run.json for a job config."""
    from schemas import BATCH, ROLLOUT

    return {
        "run_schema_version": RUN_SCHEMA_VERSION,
        "schemas": {"rollout": ROLLOUT.tag, "batch": BATCH.tag},
        "config": encode_config(c),
        "code_version": _code_version(),
    }


def _code_version() -> str:
    try:
        from importlib.metadata import version

        return version("rlpipe")
    except Exception:
        return "unknown"


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted-key view of nested dicts (lists kept as values)."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def contract_diff(
    recorded: dict[str, Any], current: dict[str, Any], fields: tuple[str, ...] = CONTRACT_FIELDS
) -> list[str]:
    """Human-readable differences of the contract `fields` between two run.json configs."""
    return [f"{k}: run.json has {a!r}, this config has {b!r}" for k, a, b in _changes(recorded, current, fields)]


@functools.cache
def _defaults() -> dict[str, Any]:
    return flatten(encode_config(RLJobConfig()))


def _changes(recorded: dict[str, Any], current: dict[str, Any], fields: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
    """(dotted field, value in run.json, value now) for every differing leaf of the contract `fields`. A field
    run.json does not have (recorded by an rlpipe that predates it) that is at its default now is no change: the
    run ran with what the default does."""
    a = flatten({k: recorded.get(k) for k in fields})
    b = flatten({k: current.get(k) for k in fields})
    defaults = _defaults()
    return [
        (k, a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and not (k not in a and k in defaults and b.get(k) == defaults[k])
    ]


class RunConfigMismatchError(ConfigError):
    """The run root was created with a different config; the message names every differing field and the values."""

    def __init__(self, run_root: str, changes: list[tuple[str, Any, Any]]) -> None:
        field_name, _, value = changes[0]
        listed = "; ".join(f"{k}: run.json has {a!r}, given {b!r}" for k, a, b in changes)
        super().__init__(
            field_name,
            value,
            f"differs from {layout.RUN_CONFIG} of run root {run_root} ({listed}); "
            f"pass {ALLOW_CHANGE_FLAG} true to accept the change (recorded in run.json's history)",
        )
        self.changes = changes


def check_run_config(store: RunStore, c: RLJobConfig, *, allow_change: bool = False, by: str = "job") -> None:
    """Write run.json if absent; otherwise refuse (RunConfigMismatchError) when the contract differs, unless
    `allow_change`: then run.json takes the new values and its `history` records what changed, when, by `by`."""
    record = run_record(c)
    data = json.dumps(record, indent=2, sort_keys=True).encode()
    # an existing run.json is only read: a rerun writes nothing before its steps start (a full disk is then named
    # by the step that hits it, as it would be mid-run)
    if not store.exists(layout.RUN_CONFIG) and store.put_if_absent(layout.RUN_CONFIG, data):
        logger.info("wrote %s", layout.RUN_CONFIG)
        return
    _check_against_run(store, record["config"], CONTRACT_FIELDS, allow_change=allow_change, by=by)


def with_step_contract(c: RLJobConfig, step_config: Any) -> RLJobConfig:
    """The job config `c` with the contract fields `step_config` has (model, train, optimizer, loss, curriculum)
    taken from the step config: what a step started with step-level overrides (`steps.run step learn
    --train.num_train_steps 3`) records in run.json and is then checked against, so a fresh run root records the
    values the step runs with instead of refusing its own overrides."""
    fields = {f: getattr(step_config, f) for f in CONTRACT_FIELDS if getattr(step_config, f, None) is not None}
    return dataclasses.replace(c, **fields) if fields else c


def check_step_config(store: RunStore, step_config: Any, *, by: str, allow_change: bool = False) -> None:
    """Refuse (RunConfigMismatchError) a step config whose contract fields (those it has of model, train,
    optimizer, loss, curriculum) differ from the run root's run.json, unless `allow_change` (then recorded as in
    `check_run_config`). A run root without run.json is not checked."""
    if not store.exists(layout.RUN_CONFIG):
        return
    fields = tuple(f for f in CONTRACT_FIELDS if getattr(step_config, f, None) is not None)
    encoded = encode_config(step_config)  # the whole tree: a choice field's `type` is encoded by its parent
    current = {f: encoded[f] for f in fields}
    _check_against_run(store, current, fields, allow_change=allow_change, by=by)


def _check_against_run(
    store: RunStore, current: dict[str, Any], fields: tuple[str, ...], *, allow_change: bool, by: str
) -> None:
    existing = read_run_record(store)  # DamagedInputError naming run.json and the field when it is damaged
    changes = _changes(existing.get("config", {}), current, fields)
    if not changes:
        return
    if not allow_change:
        raise RunConfigMismatchError(store.url, changes)
    for k, a, b in changes:
        logger.warning("config change accepted (%s): %s: %r -> %r", ALLOW_CHANGE_FLAG, k, a, b)
    existing.setdefault("config", {}).update({f: current[f] for f in fields})
    existing.setdefault("history", []).append(
        {
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "by": by,
            "changes": [{"field": k, "from": a, "to": b} for k, a, b in changes],
        }
    )
    # An atomic overwrite: readers see the old or the new record. Two concurrent accepted changes may lose one
    # history entry, never the file.
    store.put_unique(layout.RUN_CONFIG, json.dumps(existing, indent=2, sort_keys=True).encode())
