"""A single-turn verifiers taskset for the tests (taskset id `_vf_copy`): repeat the digits.

Its rubric is two `@vf.reward`s on the task, the share of digits repeated in place and, at a
small weight, a reply of the right length; a `@vf.metric` reports the reply's length.
"""

from collections.abc import Iterator

import numpy as np
import verifiers.v1 as vf


class CopyData(vf.TaskData):
    digits: str


class CopyTask(vf.Task[CopyData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def copied(self, trace: vf.Trace) -> float:
        """The share of the digits repeated in place."""
        reply, digits = trace.last_reply, self.data.digits
        return sum(a == b for a, b in zip(reply, digits, strict=False)) / len(digits)

    @vf.reward(weight=0.1)
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) == len(self.data.digits))

    @vf.metric
    async def reply_length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class CopyConfig(vf.TasksetConfig):
    digits: int = 3
    seed: int = 0


class CopyTaskset(vf.Taskset[CopyTask, CopyConfig]):
    INFINITE = True

    def load(self) -> Iterator[CopyTask]:
        rng = np.random.default_rng(self.config.seed)
        while True:
            digits = "".join(map(str, rng.integers(0, 10, self.config.digits)))
            yield CopyTask(CopyData(prompt=digits, digits=digits), self.config.task)


__all__ = ["CopyTaskset"]
