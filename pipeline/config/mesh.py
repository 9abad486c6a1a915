"""Where the learner's arrays live: the device mesh, the mixed-precision policy, multi-host start-up.

The mesh has three axes, named as levanter's trainer names them (`haliax.partitioning.ResourceAxis`):
`data` (pure data parallelism: whole replicas of parameters; levanter's "replica"), `fsdp` (data parallelism
with parameters and optimizer state sharded over the "embed" axis; levanter's "data") and `model` (tensor
parallelism: attention heads and MLP width split over devices). Batch rows are split over data × fsdp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pipeline.config.base import at_least, require


@dataclass(frozen=True)
class MeshConfig:
    """`learner.mesh` / the learner step's `mesh`: device counts per axis; their product is every device.

    One axis may be -1: it takes the devices the others leave (the default puts every device on `fsdp`)."""

    data: int = 1
    """Replicas (pure data parallelism)."""
    fsdp: int = -1
    """Data parallelism with parameters and optimizer state sharded over the embedding axis (-1: the rest)."""
    model: int = 1
    """Tensor parallelism over attention heads and MLP width."""

    def __post_init__(self) -> None:
        sizes = {"mesh.data": self.data, "mesh.fsdp": self.fsdp, "mesh.model": self.model}
        for name, v in sizes.items():
            require(v == -1 or v >= 1, name, v, "must be >= 1 or -1 (the remaining devices)")
        require(sum(v == -1 for v in sizes.values()) <= 1, "mesh", sizes, "at most one axis may be -1")

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """(data, fsdp, model) for `num_devices` devices; ValueError naming the field when they do not fit."""
        fixed = max(self.data, 1) * max(self.fsdp, 1) * max(self.model, 1)
        if num_devices % fixed:
            raise ValueError(f"learner mesh {self} needs a multiple of {fixed} devices; {num_devices} present")
        rest = num_devices // fixed
        sizes = [rest if v == -1 else v for v in (self.data, self.fsdp, self.model)]
        if sizes[0] * sizes[1] * sizes[2] != num_devices:
            raise ValueError(f"learner mesh {self}: product {sizes} != {num_devices} devices present")
        return sizes[0], sizes[1], sizes[2]


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host start-up through `jax.distributed.initialize` (one learner process per host).

    Each field falls back to an environment variable (`RLPIPE_COORDINATOR`, `RLPIPE_NUM_PROCESSES`,
    `RLPIPE_PROCESS_ID`), which the job runners set when they start several learner processes."""

    SECTION: ClassVar[str] = "distributed"

    coordinator_address: str | None = None
    """host:port of process 0's coordinator; None with num_processes 1: single-process (no jax.distributed)."""
    num_processes: int = 1
    """Learner processes in this job (one per host)."""
    process_id: int | None = None
    """This process's index in [0, num_processes)."""

    def __post_init__(self) -> None:
        at_least(self, 1, "num_processes")
        if self.process_id is not None:
            require(
                0 <= self.process_id < self.num_processes,
                "distributed.process_id",
                self.process_id,
                f"must be in [0, num_processes={self.num_processes})",
            )


@dataclass(frozen=True)
class LearnerPlacement:
    """The job's `learner:` section: the learner's mesh and how many processes (hosts) run it."""

    SECTION: ClassVar[str] = "learner"

    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh over all learner processes' devices."""
    num_processes: int = 1
    """Learner processes started together under jax.distributed (local backend: on this machine, wired to a
    coordinator on loopback; one per host on a cluster)."""

    def __post_init__(self) -> None:
        at_least(self, 1, "num_processes")
