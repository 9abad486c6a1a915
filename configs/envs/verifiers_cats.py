"""An example verifiers environment for configs/verifiers_example.yaml: "Say cats." tasks, two reward functions.

Any function returning a `vf.Taskset` (or a `vf.Env`) can be named in `env_args.env` as `path/to/file.py:function`
or `package.module:function`; its keyword arguments come from `env_args.env_kwargs`.
"""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf

__all__ = ["CatsTaskset", "load_environment"]


class CatsTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def says_cats(self, trace: vf.Trace) -> float:
        """1.0 iff the reply mentions cats."""
        return 1.0 if "cat" in trace.last_reply.lower() else 0.0

    @vf.reward(weight=0.5)
    async def brevity(self, trace: vf.Trace) -> float:
        """1.0 for an empty reply, down to 0.0 at 16 characters."""
        return max(0.0, 1.0 - len(trace.last_reply) / 16)


class CatsTaskset(vf.Taskset[CatsTask, vf.TasksetConfig]):
    def __init__(self, config: vf.TasksetConfig, n: int) -> None:
        super().__init__(config)
        self.n = n

    def load(self) -> Iterable[CatsTask]:
        for i in range(self.n):
            yield CatsTask(vf.TaskData(id=f"cats-{i}", prompt=f"Say cats {i}."))


def load_environment(n: int = 8) -> vf.Taskset:
    """The example taskset of `n` tasks."""
    return CatsTaskset(vf.TasksetConfig(), n=n)
