"""Shared fixtures: a real GCS emulator for the session, and RunStores over every backend.

- `gcs_endpoint` (session): a running `GcsEmulator` (fake-gcs-server on loopback, in-memory, one bucket).
- `store` (parametrized: local, file, memory, gs): an empty `RunStore` on a fresh root of that backend.
- `local_store`: an empty `RunStore` on a fresh local folder.
- `store_factory(backend)`: a fresh empty root of the named backend (for tests that pick backends themselves).

Scheduling over xdist workers (`make test` runs `-n 2 --dist loadgroup`): a test that uses a module- or
class-scoped fixture (a job shared by several assertions) is kept on one worker with the other users of that
fixture (its `xdist_group` is the module or class), so the fixture runs once; every other test is scheduled on
its own, so the long end-to-end tests spread over both workers instead of queueing behind one file. Slow tests
are scheduled first, so the short ones fill in at the end. A test's own `xdist_group` mark wins.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gcs_emulator import GcsEmulator

from pipeline.storage import RunStore

BACKENDS = ("local", "file", "memory", "gs")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a slow test (crash suites, end-to-end runs)")


def _shared_scope(item: pytest.Item) -> str | None:
    """The widest of module / class a fixture of `item` is scoped to ("module" wins), or None."""
    info = getattr(item, "_fixtureinfo", None)
    scopes = {d.scope for defs in (info.name2fixturedefs.values() if info else ()) for d in defs}
    if "module" in scopes or "package" in scopes:
        return "module"
    return "class" if "class" in scopes else None


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group tests that share a module/class fixture; put slow tests first (see the module docstring)."""
    for item in items:
        if any(True for _ in item.iter_markers("xdist_group")):
            continue
        scope = _shared_scope(item)
        if scope == "module":
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
        elif scope == "class":
            item.add_marker(pytest.mark.xdist_group("::".join(item.nodeid.split("::")[:2])))
    items.sort(key=lambda it: 0 if it.get_closest_marker("slow") else 1)


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[GcsEmulator]:
    """One fake-gcs-server for the whole test session (per xdist worker)."""
    emu = GcsEmulator()
    emu.start()
    try:
        yield emu
    finally:
        emu.stop()


StoreFactory = Callable[[str], RunStore]


@pytest.fixture
def store_factory(tmp_path: Path, request: pytest.FixtureRequest) -> StoreFactory:
    """`factory(backend)` -> an empty RunStore on a fresh root of `backend` (local, file, memory, gs)."""

    def make(backend: str) -> RunStore:
        uid = uuid.uuid4().hex[:10]
        if backend == "local":
            return RunStore(str(tmp_path / f"run-{uid}"))
        if backend == "file":
            return RunStore(f"file://{tmp_path}/run-{uid}")
        if backend == "memory":
            return RunStore(f"memory://rlpipe-{uid}")
        if backend == "gs":
            emu: GcsEmulator = request.getfixturevalue("gcs_endpoint")
            return RunStore(f"gs://{emu.bucket}/run-{uid}", emu.storage_options)
        raise ValueError(f"unknown backend {backend!r}")

    return make


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, store_factory: StoreFactory) -> RunStore:
    """An empty RunStore, once per backend."""
    return store_factory(str(request.param))


@pytest.fixture
def local_store(store_factory: StoreFactory) -> RunStore:
    """An empty RunStore on a fresh local folder."""
    return store_factory("local")
