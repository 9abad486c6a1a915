"""Typed, versioned JSON commit records: what one step commits to the run root and another reads.

Six records, each a frozen dataclass with a `VERSION`:

- `BatchLogEntry`  `batches/log/step-T.json`, the commit object of batch slot T (BatchMaker): the data file
  and its digest, lineage, which rollout files were ingested / quarantined / late, the sealed scan folders,
  the cursor (seen files and a reservoir snapshot) a restarted BatchMaker resumes from, and, with a curriculum,
  which eval summaries it folds at T and the values it read.
- `ReadyMarker`    `<data>.ready.json`, the commit object of one parquet data file (size, sha256, rows, schema,
  plus producer fields such as the rollout worker's `signal_rows`).
- `CommitMarker`   `policies/step-S/COMMITTED` and `checkpoints/step-S/COMMITTED`: the files of the folder
  with sizes and checksums (sha256; crc32c for policy files since version 2), the step, and what the learner
  records (batch slot, tokenizer, slots consumed, ...).
- `HfFolderMarker` `policies/step-S/hf/COMMITTED`: commits the Hugging Face folder of policy S (its files with
  sizes and sha256), written last, create-if-absent.
- `LatestPointer`  `policies/LATEST`, a hint naming the newest published policy step.
- `GcPlan`         `gc/plan-N.json`: what garbage-collection run N deletes (lineage file, data files, folders),
  written create-if-absent before its first deletion.

Contract of every record:

- `from_json(data, *, path)` accepts bytes, str or an already parsed dict and returns the record, or raises
  `RecordError` naming `path` and the offending field (dotted, e.g. `cursor.reservoir.files[2].seq`): not JSON,
  not an object, a missing field, a field of the wrong type, an unknown field (records without an `extra`
  bucket), or a version this reader cannot read.
- A record without a `version` field is version 1 (the format written before records carried versions).
  An older version this reader still knows is upgraded by a method named `_upgrade_from_v<N>` (dict of
  version N -> dict of version N+1); any other version, newer ones included, is refused by name.
- `to_json()` writes the current version: sorted keys, NaN refused, one trailing newline.
  `from_json(r.to_json(), path=...) == r` for every valid record.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar, Union

__all__ = [
    "CHECKPOINT_FORMAT",
    "SHARDED_CHECKPOINT_FORMAT",
    "BatchLogEntry",
    "CommitFile",
    "CommitMarker",
    "Cursor",
    "GcPlan",
    "HfFolderMarker",
    "LatestPointer",
    "Lineage",
    "ReadyMarker",
    "RecordError",
    "Reservoir",
    "ReservoirFile",
    "ShardBlock",
    "TensorIndex",
]

R = TypeVar("R", bound="_Fields")

CHECKPOINT_FORMAT = "rlpipe-tree-safetensors-v1"
"""The file format a `CommitMarker` names: one safetensors file per pytree, listed with size and sha256."""

SHARDED_CHECKPOINT_FORMAT = "rlpipe-sharded-safetensors-v2"
"""Checkpoints written by every learner process: one safetensors file of blocks per process (each listed with
size and sha256) and, in the marker's `tensors`, each tensor's global shape, dtype and where its blocks lie."""


class RecordError(ValueError):
    """A JSON commit record does not match its declared class; names the file and the field."""

    def __init__(self, path: str, field: str, why: str) -> None:
        super().__init__(f"{path}: field {field!r}: {why}")
        self.path = path
        self.field = field
        self.why = why


# ---------------------------------------------------------------------------------------------- machinery
def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def _convert(value: Any, tp: Any, path: str, field: str) -> Any:
    """`value` checked against the annotation `tp` (nested records built); RecordError naming `field` if not."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path, field)
            except RecordError as e:
                errors.append(e.why)
        raise RecordError(path, field, " or ".join(errors) or f"must not be null (got {value!r})")
    if origin is list:
        if not isinstance(value, list):
            raise RecordError(path, field, f"must be a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_convert(v, item, path, f"{field}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecordError(path, field, f"must be an object, got {type(value).__name__}")
        key_tp, val_tp = typing.get_args(tp)
        if key_tp is not str:  # JSON keys are strings; declared non-str keys are not supported
            raise TypeError(f"record field {field}: only str keys are supported")
        return {k: _convert(v, val_tp, path, f"{field}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, _Fields):
        return tp._from_dict(value, path, field)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RecordError(path, field, f"must be a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(path, field, f"must be an integer, got {value!r}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise RecordError(path, field, f"must be a {_type_name(tp)}, got {value!r}")
        return value
    raise TypeError(f"record field {field}: unsupported annotation {tp!r}")


def _plain(value: Any) -> Any:
    """JSON-ready form of a field value (nested records as dicts)."""
    if isinstance(value, _Fields):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _Fields:
    """A frozen dataclass whose fields are checked against their annotations when read from JSON.

    A field with a default may be absent; every other field must be present. Keys the class does not declare
    are refused, unless the class has an `extra` field (a dict): then they are collected there and written back
    at the top level.
    """

    @classmethod
    def _from_dict(cls: type[R], data: Any, path: str, prefix: str = "") -> R:
        where = prefix or "<record>"
        if not isinstance(data, dict):
            raise RecordError(path, where, f"must be a JSON object, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
        names = {f.name for f in fields}
        has_extra = "extra" in names
        kwargs: dict[str, Any] = {}
        for f in fields:
            if f.name == "extra" and has_extra:
                continue
            dotted = f"{prefix}.{f.name}" if prefix else f.name
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise RecordError(path, dotted, "missing")
                continue
            kwargs[f.name] = _convert(data[f.name], hints[f.name], path, dotted)
        unknown = sorted(k for k in data if k not in names or (has_extra and k == "extra"))
        if has_extra:
            kwargs["extra"] = {k: data[k] for k in unknown}
        elif unknown:
            raise RecordError(path, f"{prefix}.{unknown[0]}" if prefix else unknown[0], "unknown field")
        record = cls(**kwargs)
        record._check(path, prefix)
        return record

    def _check(self, path: str, prefix: str) -> None:
        """Cross-field or value checks beyond types (raise RecordError); none by default."""

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (`extra` fields flattened to the top level)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name == "extra":
                out.update({k: _plain(v) for k, v in value.items()})
            else:
                out[f.name] = _plain(value)
        return out


class _Record(_Fields):
    """A top-level record: versioned, parsed from and written as JSON."""

    VERSION: ClassVar[int] = 1

    @classmethod
    def from_json(cls: type[R], data: bytes | str | Mapping[str, Any], *, path: str) -> R:
        """The record in `data` (JSON bytes/str or a parsed object), upgraded to `VERSION`; RecordError if invalid."""
        if isinstance(data, bytes | str):
            try:
                obj = json.loads(data)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise RecordError(path, "<json>", f"not valid JSON ({e})") from None
        else:
            obj = data
        if not isinstance(obj, dict):
            raise RecordError(path, "<record>", f"must be a JSON object, got {type(obj).__name__}")
        obj = dict(obj)
        version = obj.pop("version", 1)
        current = cls.VERSION  # type: ignore[attr-defined]
        if isinstance(version, bool) or not isinstance(version, int):
            raise RecordError(path, "version", f"must be an integer, got {version!r}")
        while version < current:
            upgrade = getattr(cls, f"_upgrade_from_v{version}", None)
            if upgrade is None:
                raise RecordError(
                    path, "version", f"{cls.__name__} version {version} can no longer be read (current: {current})"
                )
            obj, version = upgrade(obj), version + 1
        if version != current:
            raise RecordError(
                path, "version", f"{cls.__name__} version {version} is newer than this reader's {current}"
            )
        return cls._from_dict(obj, path)

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict, with its `version`."""
        return {**super().to_dict(), "version": self.VERSION}

    def to_json(self) -> bytes:
        """The record as JSON bytes: sorted keys, NaN refused, trailing newline."""
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False).encode() + b"\n"


# ---------------------------------------------------------------------------------------------- batch log
@dataclasses.dataclass(frozen=True)
class ReservoirFile(_Fields):
    """One rollout file with live rows in the BatchMaker's reservoir."""

    path: str
    seq: int
    """Arrival order of the file in the reservoir."""
    policy_step: int
    rows: list[int]
    """Indices of the file's rows still live (not yet used up or dropped)."""
    uses: list[int]
    """How many batches each live row has been in (parallel to `rows`)."""


@dataclasses.dataclass(frozen=True)
class Reservoir(_Fields):
    """The BatchMaker's replay reservoir after a slot: enough to rebuild it by re-reading the files."""

    next_seq: int
    files: list[ReservoirFile]


@dataclasses.dataclass(frozen=True)
class Cursor(_Fields):
    """Where a restarted BatchMaker resumes after this slot."""

    VERSION: ClassVar[int] = 1

    version: int
    seen: list[str]
    """Rollout files already ingested, of folders still in the scan window."""
    reservoir: Reservoir
    late: list[str] = dataclasses.field(default_factory=list)
    """Files found late (after their folder was sealed) and already recorded as dropped (absent in cursors
    written before late sweeps existed: none)."""
    sweep_next: int = 0
    """Round-robin position of the late-file sweep over old folders."""

    def _check(self, path: str, prefix: str) -> None:
        if self.version != self.VERSION:
            raise RecordError(path, f"{prefix}.version", f"unknown cursor version {self.version!r}")


@dataclasses.dataclass(frozen=True)
class Lineage(_Fields):
    """Where the rows of a batch came from."""

    n_rollouts: int
    n_groups: int
    policy_steps: list[int]
    """[min, max] policy step of the batch's rollouts."""
    staleness: list[float]
    """[min, mean, max] lag of the batch's rollouts."""
    source_files: list[str]


@dataclasses.dataclass(frozen=True)
class BatchLogEntry(_Record):
    """`batches/log/step-T.json`: the commit object of batch slot T (created only if absent)."""

    VERSION: ClassVar[int] = 1

    slot: int
    attempt_id: str
    seq_len: int
    schema: str
    """Tag of the batch data file's table schema (`name@vN`)."""
    holder: str
    lease_epoch: int
    config_hash: str
    """Hash of the batch-shaping train config the slot was built with."""
    learner_step: int
    """Newest committed policy when the slot was built."""
    ingested_files: list[str]
    quarantined_files: list[str]
    late_files: list[str]
    filled_no_signal: int
    lineage: Lineage
    cursor: Cursor
    data_file: str
    data_size: int
    data_sha256: str
    rows: int
    time: float
    dropped_file: str | None
    dropped: dict[str, int]
    """Dropped rows of this slot by reason."""
    sealed: dict[str, list[str]] | None = None
    """Policy folders (as str) that left the scan window with this slot -> the files seen in each (None in
    entries written before seals existed: late files of those folders cannot be told and are not swept)."""
    curriculum_evals: list[str] | None = None
    """With a curriculum: the eval summaries folded at this slot (None: no curriculum)."""
    curriculum_eval_values: dict[str, list[float] | None] | None = None
    """With a curriculum: per folded summary, the success rates read (None: it was unreadable)."""
    timing: dict[str, Any] | None = None
    """Unix times for the learner's per-hop breakdown (`pipeline.telemetry.hops`): `batch_noticed_at`,
    `batch_committed_at`, `last_file` (the rollout file read last among the batch's sources) and
    `last_file_noticed_at`."""
    no_signal_fill_from_start: bool = False
    """The slot admitted groups without signal (advantage 0) from its first rollout file on, the run being saturated
    (`pipeline.batch_maker.slot_metrics.fills_at_once`); a rebuild of the slot does the same."""


# ---------------------------------------------------------------------------------------------- markers
@dataclasses.dataclass(frozen=True)
class ReadyMarker(_Record):
    """`<data>.ready.json`: commits one parquet data file. Producer fields not declared here go to `extra`."""

    VERSION: ClassVar[int] = 1

    file: str
    size: int
    sha256: str
    rows: int
    schema: str
    attempt_id: str
    time: float
    signal_rows: int | None = None
    """Rollout files: rows in groups with reward variance (None: not recorded)."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CommitFile(_Fields):
    """One file of a committed folder."""

    path: str
    """Name inside the folder."""
    size: int
    sha256: str | None = None
    """Hex sha256 of the file (every file of a version-1 `CommitMarker`; still written for checkpoints)."""
    crc32c: str | None = None
    """Hex CRC-32C (Castagnoli) of the file: published policy files since `CommitMarker` version 2 (hashing 185 MB
    costs ~0.014 CPU s against sha256's ~0.10, on the writer and on every reader). A reader verifies what is there."""

    def _check(self, path: str, prefix: str) -> None:
        if self.sha256 is None and self.crc32c is None:
            raise RecordError(path, f"{prefix}.sha256" if prefix else "sha256", "missing (nor a crc32c)")

    def to_dict(self) -> dict[str, Any]:
        """As `_Fields.to_dict`, without the checksum this file does not carry (a sha256-only file is written as
        before version 2, so an `HfFolderMarker` keeps its version-1 form)."""
        return {k: v for k, v in super().to_dict().items() if v is not None or k not in ("sha256", "crc32c")}


@dataclasses.dataclass(frozen=True)
class ShardBlock(_Fields):
    """One block of a sharded tensor: the half-open box [start, stop) of the global array."""

    file: str
    """Key of the file in the marker's `files`."""
    name: str
    """Tensor name inside that safetensors file."""
    start: list[int]
    stop: list[int]


@dataclasses.dataclass(frozen=True)
class TensorIndex(_Fields):
    """A sharded checkpoint's tensor: global shape, dtype (numpy name) and disjoint blocks covering it."""

    shape: list[int]
    dtype: str
    blocks: list[ShardBlock]


@dataclasses.dataclass(frozen=True)
class CommitMarker(_Record):
    """`policies/step-S/COMMITTED` or `checkpoints/step-S/COMMITTED`, written last, create-if-absent.

    Version 2: a file may carry a `crc32c` instead of a `sha256` (`CommitFile`); version 1 markers (sha256 only)
    still read."""

    VERSION: ClassVar[int] = 2

    @staticmethod
    def _upgrade_from_v1(obj: dict[str, Any]) -> dict[str, Any]:
        return obj  # every v1 file has its sha256, which version 2 still reads

    format: str
    attempt_id: str
    files: dict[str, CommitFile]
    kind: str
    """`policy` or `checkpoint`."""
    step: int
    vocab_size: int
    batch_slot: int | None = None
    """Batch slots 1..batch_slot were consumed to produce these weights."""
    tokenizer: str | None = None
    seq_len: int | None = None
    parent: int | None = None
    """Checkpoints: the checkpoint the writing process resumed from (None: initialised)."""
    slots: list[int] | None = None
    """Checkpoints: [first, last] slot consumed by the writing process."""
    loss: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    tensors: dict[str, TensorIndex] | None = None
    """Sharded checkpoints and policies (format `SHARDED_CHECKPOINT_FORMAT`): `<pytree>/<key path>` -> its blocks."""

    def _check(self, path: str, prefix: str) -> None:
        if self.format not in (CHECKPOINT_FORMAT, SHARDED_CHECKPOINT_FORMAT):
            raise RecordError(
                path, "format", f"{self.format!r}, expected {CHECKPOINT_FORMAT!r} or {SHARDED_CHECKPOINT_FORMAT!r}"
            )
        if self.kind not in ("policy", "checkpoint"):
            raise RecordError(path, "kind", f"must be 'policy' or 'checkpoint', got {self.kind!r}")
        if self.format == SHARDED_CHECKPOINT_FORMAT and self.tensors is None:
            raise RecordError(path, "tensors", "a sharded marker must have a tensor index")
        for name, t in (self.tensors or {}).items():
            for b in t.blocks:
                if b.file not in self.files or len(b.start) != len(t.shape) or len(b.stop) != len(t.shape):
                    raise RecordError(path, f"tensors.{name}", f"block {b.name!r} names no file or has the wrong rank")


@dataclasses.dataclass(frozen=True)
class HfFolderMarker(_Record):
    """`policies/step-S/hf/COMMITTED`: commits the Hugging Face folder of policy S (config, safetensors,
    tokenizer), written last, create-if-absent. Every writer of a step writes the same bytes, so racing
    workers agree."""

    VERSION: ClassVar[int] = 1

    step: int
    files: dict[str, CommitFile]
    """Every file of the folder by name, with its size and sha256."""

    def _check(self, path: str, prefix: str) -> None:
        if self.step < 0:
            raise RecordError(path, "step", f"must be >= 0, got {self.step}")
        for name, f in self.files.items():
            if f.path != name:
                raise RecordError(path, f"files.{name}.path", f"{f.path!r} differs from its key {name!r}")


@dataclasses.dataclass(frozen=True)
class LatestPointer(_Record):
    """`policies/LATEST`: a hint naming the newest published policy (listing markers is the truth)."""

    VERSION: ClassVar[int] = 1

    step: int


# ---------------------------------------------------------------------------------------------- retention
@dataclasses.dataclass(frozen=True)
class GcPlan(_Record):
    """`gc/plan-N.json`: what garbage-collection run N deletes, written (create-if-absent) before its first
    deletion so that a rerun after a crash finishes exactly these deletions."""

    VERSION: ClassVar[int] = 1

    run: int
    holder: str
    time: float
    lineage_file: str | None
    """The lineage index committed for this run's slots (None: no new slots were covered)."""
    data_files: list[str]
    """Data files to delete: the ready marker (if any) first, then the data."""
    folders: list[str]
    """Policy or checkpoint folders to delete: COMMITTED first, then every other file."""
