"""The kinds of step of a job, each with its one set of names.

A `StepKind` is a `str` whose value is the step's name in the run root's records: `metrics/<value>/`, the
`kind` field of its metrics records, and (the BatchMaker) `leases/<value>/`. The other names of a step are
attributes of its kind, never literals elsewhere:

    kind         value        job_name    cli_name    module
    LEARNER      learner      learner     learn       steps.learn
    BATCHMAKER   batchmaker   batches     batches     steps.make_batches
    ROLLOUT      rollout      rollout     rollout     steps.rollout
    EVALUATE     evaluate     evaluate    evaluate    steps.evaluate

`job_name` is the step's name in a job: its `logs/<job_name>/` folder (a rollout worker's is
`rollout-<worker_id>`), its key in `RLJob.to_worker_configs()`, and its resources in a backend config
(`batches_cpus`). `cli_name` is what users type: `python -m steps.run step <cli_name>`, `make <cli_name>`.
These names are on disk in run roots of earlier versions, so they never change.
"""

from __future__ import annotations

import enum


class StepKind(enum.StrEnum):
    """A kind of step (see the module docstring); its value is its name in metrics records and leases."""

    LEARNER = "learner"
    BATCHMAKER = "batchmaker"
    ROLLOUT = "rollout"
    EVALUATE = "evaluate"

    @property
    def job_name(self) -> str:
        """Its name in a job: `logs/<job_name>/`, its `to_worker_configs()` key, its backend resources."""
        return _JOB_NAMES.get(self, self.value)

    @property
    def cli_name(self) -> str:
        """What a user types: `python -m steps.run step <cli_name>` (and the Makefile target)."""
        return _CLI_NAMES.get(self, self.value)

    @property
    def module(self) -> str:
        """Its program: `python -m <module> --config_path <yaml>`."""
        return _MODULES[self]

    @classmethod
    def from_cli(cls, name: str) -> StepKind:
        """The kind `steps.run step <name>` names; ValueError listing the names for an unknown one."""
        for kind in cls:
            if kind.cli_name == name:
                return kind
        raise ValueError(f"unknown step {name!r}; one of {', '.join(cli_names())}")


def cli_names() -> list[str]:
    """The step names `steps.run step NAME` accepts, sorted."""
    return sorted(kind.cli_name for kind in StepKind)


_JOB_NAMES = {StepKind.BATCHMAKER: "batches"}
_CLI_NAMES = {StepKind.LEARNER: "learn", StepKind.BATCHMAKER: "batches"}
_MODULES = {
    StepKind.LEARNER: "steps.learn",
    StepKind.BATCHMAKER: "steps.make_batches",
    StepKind.ROLLOUT: "steps.rollout",
    StepKind.EVALUATE: "steps.evaluate",
}
