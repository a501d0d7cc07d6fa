"""A single-turn verifiers taskset for the tests (taskset id `_vf_copy`): repeat the digits.

Its rubric is two `@vf.reward`s on the task, the share of digits repeated in place and, at a
small weight, a reply of the right length; a `@vf.metric` reports the reply's length. Options:
`digits`, `seed`; `task.broken=true` makes each task's setup raise (an environment failing
inside its rollout); `hub_file=REPO` loads from a Hugging Face dataset (which dew refuses).
"""

from collections.abc import Iterator

import huggingface_hub
import numpy as np
import verifiers.v1 as vf


class CopyData(vf.TaskData):
    digits: str


class CopyTaskConfig(vf.TaskConfig):
    broken: bool = False


class CopyTask(vf.Task[CopyData, vf.State, CopyTaskConfig]):
    async def setup(self, trace: vf.Trace, runtime) -> None:
        if self.config.broken:
            raise RuntimeError("the copy task broke")

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
    task: CopyTaskConfig = CopyTaskConfig()
    digits: int = 3
    seed: int = 0
    hub_file: str = ""


class CopyTaskset(vf.Taskset[CopyTask, CopyConfig]):
    INFINITE = True

    def load(self) -> Iterator[CopyTask]:
        if self.config.hub_file:
            repo = self.config.hub_file
            huggingface_hub.hf_hub_download(repo, "train.jsonl", repo_type="dataset")
        rng = np.random.default_rng(self.config.seed)
        while True:
            digits = "".join(map(str, rng.integers(0, 10, self.config.digits)))
            yield CopyTask(CopyData(prompt=digits, digits=digits), self.config.task)


__all__ = ["CopyTaskset"]
