"""The machinery shared by every declared schema: a named, versioned Arrow schema
bound to a row dataclass, with lossless conversion both ways and validation.

A table's columns are declared once, as its row dataclass: `arrow_schema` reads the Arrow schema off the
fields (their order, their types, `| None` for a nullable column). A Python type names the widest Arrow type
(`int` int64, `float` float64); a narrower column says so with `Int32`, `Int8` or `Float32`."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, Generic, TypeVar

import pyarrow as pa

SCHEMA_NAME_KEY = b"rlpipe.schema"
SCHEMA_VERSION_KEY = b"rlpipe.schema_version"

R = TypeVar("R")

Int32 = Annotated[int, pa.int32()]
"""An int column stored as int32 (token ids, small counters)."""
Int8 = Annotated[int, pa.int8()]
"""An int column stored as int8 (0/1 masks)."""
Float32 = Annotated[float, pa.float32()]
"""A float column stored as float32 (log-probabilities, sampling controls)."""

_ARROW_SCALARS: dict[Any, pa.DataType] = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}


def _arrow_type(tp: Any) -> pa.DataType:
    """The Arrow type of a (non-None) field annotation: a scalar, `Annotated[_, arrow type]`, `list[T]`,
    `dict[K, V]`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return tp.__metadata__[0]
    if origin is list:
        return pa.list_(_arrow_type(args[0]))
    if origin is dict:
        return pa.map_(_arrow_type(args[0]), _arrow_type(args[1]))
    if tp in _ARROW_SCALARS:
        return _ARROW_SCALARS[tp]
    raise TypeError(f"no Arrow type for the annotation {tp!r}")


def arrow_schema(row_type: type) -> pa.Schema:
    """The Arrow schema of a row dataclass: one column per field, in field order (a base class's first), of the
    field's type; nullable exactly when the annotation allows None (`X | None`)."""
    hints = typing.get_type_hints(row_type, include_extras=True)
    fields = []
    for f in dataclasses.fields(row_type):
        tp = hints[f.name]
        args = typing.get_args(tp)
        nullable = typing.get_origin(tp) in (types.UnionType, typing.Union) and type(None) in args
        if nullable:
            (tp,) = [a for a in args if a is not type(None)]
        fields.append(pa.field(f.name, _arrow_type(tp), nullable=nullable))
    return pa.schema(fields)


class ValidationError(ValueError):
    """A row or table violates its declared contract; the message names the row and field."""


class SchemaMismatchError(ValueError):
    """A file's schema name or version is not the one the reader expects."""

    def __init__(self, path: str, expected: str, found: str) -> None:
        super().__init__(f"{path}: expected schema {expected}, found {found}")
        self.path = path
        self.expected = expected
        self.found = found


@dataclasses.dataclass(frozen=True)
class TableSpec(Generic[R]):
    """A declared table: name, version, Arrow schema, row class and row validator.

    `to_table(rows)` and `from_table(table)` are exact inverses for valid rows:
    token lists stay integer lists, floats keep their declared width. Files of an older version listed in
    `upgrades` stay readable: `upgrades[v]` turns a table of version `v` into one with this version's columns.
    """

    name: str
    version: int
    schema: pa.Schema
    row_type: type[R]
    validate_row: Callable[[R], None]
    upgrades: Mapping[int, Callable[[pa.Table], pa.Table]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls,
        row_type: type[R],
        name: str,
        validate_row: Callable[[R], None],
        *,
        version: int,
        upgrades: Mapping[int, Callable[[pa.Table], pa.Table]] | None = None,
    ) -> TableSpec[R]:
        """The spec of `row_type`'s table, its Arrow schema read off the row dataclass (`arrow_schema`)."""
        return cls(name, version, arrow_schema(row_type), row_type, validate_row, dict(upgrades or {}))

    @property
    def tag(self) -> str:
        """`name@vN`, how files and errors name this schema."""
        return f"{self.name}@v{self.version}"

    @property
    def metadata(self) -> dict[bytes, bytes]:
        """File-level metadata every table of this spec carries."""
        return {SCHEMA_NAME_KEY: self.name.encode(), SCHEMA_VERSION_KEY: str(self.version).encode()}

    def arrow_schema(self) -> pa.Schema:
        """The Arrow schema with the version metadata attached."""
        return self.schema.with_metadata(self.metadata)

    def to_table(self, rows: Sequence[R], *, validate: bool = True) -> pa.Table:
        """Rows to an Arrow table of exactly this schema (validated unless told not to)."""
        if validate:
            for i, row in enumerate(rows):
                try:
                    self.validate_row(row)
                except ValidationError as e:
                    raise ValidationError(f"{self.tag} row {i}: {e}") from None
        columns = {f.name: [getattr(r, f.name) for r in rows] for f in self.schema}
        return pa.Table.from_pydict(columns, schema=self.arrow_schema())

    def from_table(self, table: pa.Table) -> list[R]:
        """An Arrow table (same columns) back to row objects."""
        table = self.conform(table, path="<table>")
        cols = {name: table.column(name).to_pylist() for name in self.schema.names}
        for f in self.schema:
            if pa.types.is_map(f.type):  # Arrow gives a map's entries as (key, value) pairs
                cols[f.name] = [None if v is None else dict(v) for v in cols[f.name]]
        n = table.num_rows
        return [self.row_type(**{k: cols[k][i] for k in cols}) for i in range(n)]

    def check_metadata(self, metadata: dict[bytes, bytes] | None, path: str) -> int:
        """The file's version: this one, or an older one listed in `upgrades`. Raises SchemaMismatchError when the
        file metadata names another schema or a version this spec cannot read."""
        md = metadata or {}
        name = md.get(SCHEMA_NAME_KEY, b"<none>").decode(errors="replace")
        version = md.get(SCHEMA_VERSION_KEY, b"<none>").decode(errors="replace")
        if name == self.name and version == str(self.version):
            return self.version
        if name == self.name and version.isdigit() and int(version) in self.upgrades:
            return int(version)
        raise SchemaMismatchError(path, self.tag, f"{name}@v{version}")

    def upgrade(self, table: pa.Table, version: int) -> pa.Table:
        """A table read from a file of `version` (as `check_metadata` returned it) with this version's columns."""
        return table if version == self.version else self.upgrades[version](table)

    def conform(self, table: pa.Table, path: str) -> pa.Table:
        """Select and cast the declared columns; a missing column is a mismatch, never a silent drop."""
        missing = [n for n in self.schema.names if n not in table.column_names]
        if missing:
            raise SchemaMismatchError(path, self.tag, f"table without columns {missing}")
        table = table.select(self.schema.names)
        if not table.schema.equals(self.schema, check_metadata=False):
            table = table.cast(self.schema)
        return table.replace_schema_metadata(self.metadata)


def check_finite(name: str, value: float) -> None:
    """Raise ValidationError if `value` is NaN or infinite."""
    if value is None or math.isnan(value) or math.isinf(value):
        raise ValidationError(f"{name} must be finite, got {value!r}")


def check_nonempty(name: str, value: str) -> None:
    """Raise ValidationError if the string is empty."""
    if not value:
        raise ValidationError(f"{name} must be a non-empty string")


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """Raise ValidationError unless `value` is one of `choices`."""
    if value not in choices:
        raise ValidationError(f"{name} {value!r} is not one of {choices}")


def check_same_length(names: Iterable[str], values: Iterable[Sequence[Any]]) -> None:
    """Raise ValidationError unless all sequences have the same length."""
    names = list(names)
    lengths = [len(v) for v in values]
    if len(set(lengths)) > 1:
        detail = ", ".join(f"{n}={ln}" for n, ln in zip(names, lengths, strict=True))
        raise ValidationError(f"lengths disagree: {detail}")


def check_int_list(name: str, value: Sequence[Any]) -> None:
    """Raise ValidationError unless every element is an int (not a float, not a bool)."""
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValidationError(f"{name} must hold integers, found {type(v).__name__} {v!r}")
