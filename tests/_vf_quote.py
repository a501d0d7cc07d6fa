"""A single-turn verifiers taskset whose reward raises, quoting the reply (taskset id
`_vf_quote`): a rubric's own failure, whose text differs with every reply."""

from collections.abc import Iterator

import verifiers.v1 as vf

from _vf_copy import CopyData


class QuoteTask(vf.Task[CopyData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def scored(self, trace: vf.Trace) -> float:
        raise ValueError(f"cannot score the reply {trace.last_reply!r}")


class QuoteTaskset(vf.Taskset[QuoteTask, vf.TasksetConfig]):
    INFINITE = True

    def load(self) -> Iterator[QuoteTask]:
        while True:
            yield QuoteTask(CopyData(prompt="123", digits="123"), self.config.task)


__all__ = ["QuoteTaskset"]
