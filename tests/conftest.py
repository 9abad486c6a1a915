"""Shared fixtures: a real GCS emulator for the session, and RunStores over every backend.

- `gcs_endpoint` (session): a running `GcsEmulator` (fake-gcs-server on loopback, in-memory, one bucket).
- `store` (parametrized: local, file, memory, gs): an empty `RunStore` on a fresh root of that backend.
- `local_store`: an empty `RunStore` on a fresh local folder.
- `store_factory(backend)`: a fresh empty root of the named backend (for tests that pick backends themselves).
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
