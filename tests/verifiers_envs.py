"""verifiers environments defined for the tests (loaded by file path: `tests/verifiers_envs.py:FUNCTION`).

- `single_turn()`: "Say cats." tasks; two reward functions (`says_cats`: 1.0 iff the reply contains "cat";
  `brevity` at weight 0.5: 1.0 for an empty reply, falling linearly to 0.0 at 16 characters).
- `tool_use()`: "What is A + B?" tasks with a Python tool (`add(a: int, b: int)` on a `Toolset`); rewards
  `correct` (1.0 iff the last reply contains the sum) and `used_tool` (1.0 iff any tool result is in the trace).
"""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf

__all__ = ["CatsTaskset", "SumTaskset", "single_turn", "tool_use"]


class CatsTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def says_cats(self, trace: vf.Trace) -> float:
        return 1.0 if "cat" in trace.last_reply.lower() else 0.0

    @vf.reward(weight=0.5)
    async def brevity(self, trace: vf.Trace) -> float:
        return max(0.0, 1.0 - len(trace.last_reply) / 16)


class CatsTaskset(vf.Taskset[CatsTask, vf.TasksetConfig]):
    def __init__(self, config: vf.TasksetConfig, n: int = 6) -> None:
        super().__init__(config)
        self.n = n

    def load(self) -> Iterable[CatsTask]:
        for i in range(self.n):
            yield CatsTask(vf.TaskData(id=f"cats-{i}", prompt=f"Say cats {i}."))


def single_turn(n: int = 6) -> vf.Taskset:
    """The single-turn test taskset of `n` tasks."""
    return CatsTaskset(vf.TasksetConfig(), n=n)


class Adder(vf.Toolset):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class SumData(vf.TaskData):
    answer: int = 0


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Adder(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if str(self.data.answer) in trace.last_reply else 0.0

    @vf.reward
    async def used_tool(self, trace: vf.Trace) -> float:
        return 1.0 if trace.tool_messages else 0.0


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def __init__(self, config: vf.TasksetConfig, n: int = 6) -> None:
        super().__init__(config)
        self.n = n

    def load(self) -> Iterable[SumTask]:
        for i in range(self.n):
            a, b = i + 2, 2 * i + 1
            yield SumTask(SumData(id=f"sum-{i}", prompt=f"What is {a} + {b}? Use the add tool.", answer=a + b))


def tool_use(n: int = 6) -> vf.Taskset:
    """The multi-turn tool test taskset of `n` tasks."""
    return SumTaskset(vf.TasksetConfig(), n=n)
