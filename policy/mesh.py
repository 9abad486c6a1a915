"""The learner's device mesh, the way levanter's trainer builds it, and moving arrays onto it and back.

Axes (levanter's `ResourceAxis` names): `replica` = `mesh.data` (pure data parallelism), `data` = `mesh.fsdp`
(data parallelism with parameters sharded), `model` = `mesh.model` (tensor parallelism). Mappings from
haliax axis names to mesh axes:
  compute:    batch rows over (replica, data); heads, kv_head and mlp over model;
  parameters: the compute mapping plus "embed" over data (FSDP: parameters and optimizer state sharded).
Multi-host: `initialize_distributed` starts `jax.distributed` (one process per host); each process builds
only its own rows of a batch (`process_rows`) and `global_batch` assembles the global array from them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import numpy as np
from haliax.partitioning import ResourceAxis
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from levanter.utils.jax_utils import create_fsdp_mesh

from pipeline.config import ConfigError, DistributedConfig, MeshConfig

logger = logging.getLogger(__name__)

BATCH_AXIS = "batch"
FSDP_AXES = ("embed",)
TENSOR_PARALLEL_AXES = ("heads", "kv_head", "mlp")
BATCH_RESOURCES = (ResourceAxis.REPLICA, ResourceAxis.DATA)


def initialize_distributed(cfg: DistributedConfig) -> None:
    """Start `jax.distributed` when this learner is one of several processes; a no-op for one process.

    Fields left unset come from `RLPIPE_COORDINATOR`, `RLPIPE_NUM_PROCESSES`, `RLPIPE_PROCESS_ID`. On CPU the
    cross-process collectives go through gloo."""
    coordinator = cfg.coordinator_address or os.environ.get("RLPIPE_COORDINATOR")
    num = (
        int(os.environ.get("RLPIPE_NUM_PROCESSES", cfg.num_processes)) if cfg.num_processes == 1 else cfg.num_processes
    )
    pid = cfg.process_id if cfg.process_id is not None else os.environ.get("RLPIPE_PROCESS_ID")
    if num == 1:
        return
    if not coordinator or pid is None:
        raise ConfigError(
            "distributed.coordinator_address", coordinator, f"and process_id are required ({num} processes)"
        )
    if getattr(jax.config, "jax_platforms", None) == "cpu" or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _compile_cache_writes_from_every_process()
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num, process_id=int(pid))
    logger.info("jax.distributed: process %d of %d (coordinator %s)", jax.process_index(), num, coordinator)


def _compile_cache_writes_from_every_process() -> None:
    """Let every CPU learner process write the programs it compiles to JAX's persistent compilation cache.

    JAX writes that cache from process 0 only (writers of one key would contend on a shared filesystem). On CPU
    the key of a program hashes the compiling process's view of the topology, so the keys of process i > 0 are
    its own: nobody ever wrote them, and without this such a process compiled the train step again at every
    start (measured on a busy 2-core machine, a restart of 2 processes: process 1 spent 21.7 s compiling, 1.3 s
    with this).
    Each process still writes only its own keys. Left as JAX has it where JAX's internals differ from 0.10."""
    from jax._src import compiler
    from jax._src import distributed as jax_distributed

    write = getattr(compiler, "_cache_write", None)
    if write is None or getattr(write, "rlpipe_every_process", False):
        return

    def write_as_writer(*args: Any, **kwargs: Any) -> Any:
        state = jax_distributed.global_state
        own = state.process_id
        state.process_id = 0  # the only thing JAX's check reads; restored at once
        try:
            return write(*args, **kwargs)
        finally:
            state.process_id = own

    write_as_writer.rlpipe_every_process = True  # type: ignore[attr-defined]
    compiler._cache_write = write_as_writer


@dataclass(frozen=True)
class LearnerMesh:
    """A device mesh and the haliax axis mappings for parameters and compute on it."""

    mesh: Mesh
    param_mapping: dict[str, Any]
    compute_mapping: dict[str, Any]

    @property
    def data_ways(self) -> int:
        """Devices the batch rows are split over (replica × data)."""
        return int(self.mesh.shape[ResourceAxis.REPLICA] * self.mesh.shape[ResourceAxis.DATA])

    @contextmanager
    def active(self) -> Iterator[None]:
        """The mesh and the compute mapping in context (haliax's `shard` and levanter's layers read them)."""
        with hax.partitioning.set_mesh(self.mesh), hax.axis_mapping(self.compute_mapping):
            yield

    @property
    def batch_sharding(self) -> NamedSharding:
        """[rows, seq] arrays: rows split over replica × data, replicated over model."""
        return NamedSharding(self.mesh, PartitionSpec(BATCH_RESOURCES, None))


def build_mesh(cfg: MeshConfig, devices: int | None = None) -> LearnerMesh:
    """The mesh of `cfg` over every device (of every process); ConfigError naming `mesh` when they do not fit."""
    n = jax.device_count() if devices is None else devices
    try:
        data, fsdp, model = cfg.resolve(n)
    except ValueError as e:
        raise ConfigError("mesh", cfg, str(e)) from None
    mesh = create_fsdp_mesh(data, fsdp, model)
    compute = {axis: ResourceAxis.MODEL for axis in TENSOR_PARALLEL_AXES}
    compute[BATCH_AXIS] = BATCH_RESOURCES  # type: ignore[assignment]
    params = dict(compute)
    params.update({axis: ResourceAxis.DATA for axis in FSDP_AXES})
    logger.info("learner mesh: data=%d fsdp=%d model=%d over %d devices", data, fsdp, model, n)
    return LearnerMesh(mesh=mesh, param_mapping=params, compute_mapping=compute)


def shard_params(tree: Any, lm: LearnerMesh) -> Any:
    """`tree` (model or optimizer state) placed on the mesh per the parameter mapping (FSDP over "embed"); plain
    (unnamed) arrays such as the optimizer's step counts replicated over the mesh.

    The train step returns those counts replicated on the mesh, so an input left on one device would give the
    first call a different signature from every later one and compile the train step twice."""
    with lm.active():
        sharded = hax.shard(tree, lm.param_mapping)
    replicated = NamedSharding(lm.mesh, PartitionSpec())

    def place(x: Any) -> Any:
        if isinstance(x, hax.NamedArray) or not isinstance(x, jax.Array) or isinstance(x.sharding, NamedSharding):
            return x
        return jax.device_put(x, replicated)

    return jax.tree.map(place, sharded, is_leaf=lambda x: isinstance(x, hax.NamedArray))


def process_rows(batch_size: int) -> tuple[int, int]:
    """[start, stop) of the batch rows this process reads (contiguous, equal shares in process order)."""
    n, i = jax.process_count(), jax.process_index()
    if batch_size % n:
        raise ConfigError("train.batch_size", batch_size, f"must be divisible by the {n} learner processes")
    share = batch_size // n
    return i * share, (i + 1) * share


def global_batch(local: dict[str, np.ndarray], lm: LearnerMesh, batch_size: int) -> dict[str, jax.Array]:
    """Global [batch_size, seq] arrays on the mesh from this process's rows (`process_rows`) of each."""
    sharding = lm.batch_sharding
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (batch_size, *v.shape[1:])) for k, v in local.items()
    }


def to_host(tree: Any) -> Any:
    """Every array leaf of `tree` as one full host numpy array (an all-gather across processes when several).

    Used once per policy publish and per checkpoint: each host holds the whole tree briefly."""

    def fetch(x: Any) -> Any:
        if not eqx.is_array(x):
            return x
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree_util.tree_map(fetch, tree)


def barrier(name: str) -> None:
    """Wait until every learner process reaches `name` (no-op for one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def is_writer() -> bool:
    """Whether this process writes commit objects (policies, checkpoints, metrics, LEARNER_DONE): process 0."""
    return jax.process_index() == 0


def agree_with_writer(flag: bool) -> bool:
    """Process 0's value of `flag` on every process (its own value when there is one process)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def all_processes(flag: bool) -> bool:
    """Whether `flag` holds on every learner process (a collective when there are several)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.asarray(multihost_utils.process_allgather(np.array([int(flag)], np.int32))).min())


def writer_ints(values: list[int]) -> list[int]:
    """Process 0's `values` on every process (a collective when there are several)."""
    if jax.process_count() == 1:
        return list(values)
    n = int(multihost_utils.broadcast_one_to_all(np.int64(len(values))))
    padded = np.zeros(max(n, 1), np.int64)
    if is_writer():
        padded[: len(values)] = values
    return [int(v) for v in np.asarray(multihost_utils.broadcast_one_to_all(padded))[:n]]
