"""The one rule for where a run root (or any storage location rlpipe is given) lives: on local disk or not.

Local: a plain path (relative, absolute, `~/…`), `file://…` and `local://…` (fsspec's alias of `file`). Anything
else with a scheme (`gs://`, `gcs://`, `memory://`, `s3://`, …) is remote and is reached through fsspec. A Windows
drive letter (`C://…`) is not a scheme.
"""

from __future__ import annotations

import os

LOCAL_PROTOCOLS = frozenset({"file", "local"})
"""Schemes of local paths; a path without one is local too."""


def split_location(location: str | os.PathLike[str]) -> tuple[str, str]:
    """(protocol, path) of a location: `("file", path)` for a local one (the scheme removed; not made absolute),
    else its scheme and the rest (`gs://bucket/run` -> `("gs", "bucket/run")`)."""
    text = os.fspath(location)
    if "://" in text:
        protocol, path = text.split("://", 1)
        if len(protocol) > 1:  # a one-letter "scheme" is a Windows drive
            return ("file" if protocol in LOCAL_PROTOCOLS else protocol), path
    return "file", text


def is_local(location: str | os.PathLike[str]) -> bool:
    """Whether a location is on local disk (a plain path, `file://…` or `local://…`)."""
    return split_location(location)[0] == "file"


def local_path(location: str | os.PathLike[str]) -> str:
    """The absolute OS path of a local location (`~` expanded); ValueError naming it for a remote one."""
    protocol, path = split_location(location)
    if protocol != "file":
        raise ValueError(f"{os.fspath(location)!r} is not on local disk ({protocol}://)")
    return os.path.abspath(os.path.expanduser(path))
