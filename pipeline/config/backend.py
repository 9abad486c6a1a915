"""Job backends: where the job runner starts the steps. A registered choice (`backend: {type: local}` or
`backend: {type: ray, address: ..., resources: {...}}`; on the command line `--backend.type ray`).

Adding a backend is one registered config class here, naming its launcher (`launcher`: "module:Class", imported
only when a job runs with it), plus that launcher's module (see `pipeline.jobs.launchers.base.Launcher`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import draccus

from pipeline.config.base import default_choice


@dataclass(frozen=True)
class JobBackendConfig(draccus.ChoiceRegistry):
    """Where the job's steps run, chosen once from config (`type: local` or `type: ray`)."""

    launcher: ClassVar[str] = ""
    """"module:Class" of the launcher that starts steps on this backend."""

    default_choice_name = default_choice("local")


@JobBackendConfig.register_subclass("local")
@dataclass(frozen=True)
class LocalBackendConfig(JobBackendConfig):
    """Every step as a child process of the job runner on this machine; output in
    `<run root>/logs/<step>/<attempt>.log`."""

    launcher: ClassVar[str] = "pipeline.jobs.launchers.local:LocalLauncher"

    fork_server: bool = True
    """Start step processes by forking a server that has imported the step programs once (a start or restart
    then forks in ~0.05 s instead of importing for ~2–5 s of CPU; Linux). False: every step process is a fresh
    `python -m steps.<name>`. Either way a step is the runner's child process with the same exit codes and logs."""


@dataclass(frozen=True)
class StepResources:
    """Resources per step on the Ray backend."""

    learner_cpus: float = 1.0
    """CPUs of each learner process."""
    learner_gpus: float = 0.0
    """GPUs of each learner process."""
    rollout_cpus: float = 1.0
    """CPUs of each rollout worker."""
    rollout_gpus: float = 0.0
    """GPUs of each rollout worker."""
    batches_cpus: float = 0.5
    """CPUs of the BatchMaker (it needs no GPU)."""
    evaluate_cpus: float = 0.5
    """CPUs of the evaluator."""
    evaluate_gpus: float = 0.0
    """GPUs of the evaluator."""
    rollout_node_resource: str | None = None
    """A Ray custom resource that only inference nodes offer (`ray start --resources '{"inference": 1000}'`):
    rollout workers (and the servers they start) then run only there; None: wherever CPUs/GPUs fit."""
    learner_node_resource: str | None = None
    """A Ray custom resource that only the learner's node offers: the learner then runs only there."""

    def node_resources(self, kind: str) -> dict[str, float]:
        """Ray custom resources a step of `kind` (a `StepKind.job_name`) asks for (a sliver of the node label, so
        steps can share)."""
        label = getattr(self, f"{kind}_node_resource", None)
        return {label: 0.001} if label else {}

    def for_kind(self, kind: str) -> tuple[float, float]:
        """(CPUs, GPUs) for a step of `kind` (a `StepKind.job_name`: the prefix of its `<kind>_cpus` and
        `<kind>_gpus` fields; a step without a GPU field asks for none)."""
        return getattr(self, f"{kind}_cpus"), getattr(self, f"{kind}_gpus", 0.0)


@JobBackendConfig.register_subclass("ray")
@dataclass(frozen=True)
class RayBackendConfig(JobBackendConfig):
    """Every step in a Ray actor with its own resources; the same step programs and supervision as `local`."""

    launcher: ClassVar[str] = "pipeline.jobs.launchers.ray:RayLauncher"
    address: str | None = None
    """Ray cluster address (e.g. ray://head:10001); None: join RAY_ADDRESS or start a local cluster."""
    resources: StepResources = field(default_factory=StepResources)
    """CPUs / GPUs per step; every step must fit on the cluster at once (checked before any starts)."""
