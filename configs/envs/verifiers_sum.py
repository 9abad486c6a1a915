"""An example multi-turn verifiers environment with a Python tool: "What is A + B?" tasks, an `add` tool.

The tool is a verifiers `Toolset` (`@vf.tool` methods) on the taskset; verifiers serves it to the agent as an MCP
server (its tools are named `<server>_<tool>`: `adder_add`), started as `python -m verifiers_sum` (this file, found
through `PYTHONPATH`, which `VerifiersEnv` extends with this file's folder), so the module runs the toolset when
executed as `__main__`. Rewards: `correct` (1.0 iff the last reply
contains the sum) and `used_tool` (1.0 iff the agent called a tool).
"""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf

__all__ = ["Adder", "SumTaskset", "load_environment"]


class Adder(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class SumData(vf.TaskData):
    answer: int = 0


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 iff the last reply contains the sum."""
        return 1.0 if str(self.data.answer) in trace.last_reply else 0.0

    @vf.reward
    async def used_tool(self, trace: vf.Trace) -> float:
        """1.0 iff a tool result is in the trace."""
        return 1.0 if trace.tool_messages else 0.0


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def __init__(self, config: vf.TasksetConfig, n: int) -> None:
        super().__init__(config)
        self.n = n

    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        """A taskset-scoped toolset: one server for all tasks (a task-scoped one, `Task.toolsets`, starts per
        rollout)."""
        return [Adder(vf.ToolsetConfig())]

    def load(self) -> Iterable[SumTask]:
        for i in range(self.n):
            a, b = i + 2, 2 * i + 1
            yield SumTask(SumData(id=f"sum-{i}", prompt=f"What is {a} + {b}? Use the add tool.", answer=a + b))


def load_environment(n: int = 6) -> vf.Taskset:
    """The example taskset of `n` tasks."""
    return SumTaskset(vf.TasksetConfig(), n=n)


if __name__ == "__main__":  # verifiers starts the toolset's MCP server as `python -m verifiers_sum`
    Adder.run()
