"""A scripted source and publisher for the scheduler's tests: rollouts that take known times on
trio's clock and end as told, and a publisher that serves what was pushed last.

Shared by the scheduler's test modules, which each script their own rollouts through `Plan`.
"""

from __future__ import annotations

import attrs
import jax
import numpy as np
import trio

from dew import models
from dew.data import ArrayDataset, Task
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.sessions import Call, Label, Session, Status, note_progress

CONFIG = models.TransformerConfig(vocab=32, d_model=16, heads=2, layers=1, d_ff=32, max_len=64)
PARAMS = models.init(jax.random.PRNGKey(0), CONFIG)
OBJECTIVE = GRPOObjective(models.model(CONFIG))
WIDTH, ROWS = 64, 8


@attrs.frozen
class Plan:
    """How one scripted rollout goes: `delay` seconds, then `calls` calls over `duration`
    seconds, each under the version served when it starts (told the scheduler as it starts,
    as an engine does through note_progress); then `raises`, or a session of
    `status`, `reward` and `truncation` whose calls complete `tokens` tokens each. Cancelled,
    it raises `raises_when_cancelled` if set (a source broken in its cleanup)."""

    duration: float = 1.0
    status: Status = Status.COMPLETED
    reward: float | None = 1.0
    calls: int = 1
    truncation: str | None = None
    raises: BaseException | None = None
    raises_when_cancelled: BaseException | None = None
    delay: float = 0.0
    tokens: int = 2


class Engine:
    """A Publisher that serves whatever version was pushed last, and keeps each push as
    (time, version)."""

    def __init__(self):
        self.version: int | None = None
        self.pushes: list[tuple[float, int]] = []

    def load(self, variables, version):
        self.version = version
        self.pushes.append((trio.current_time(), version))


class Scripted:
    """A source whose every rollout follows `script(task, label) -> Plan`, and which remembers
    what it ran (time, task name, label) and why each run was cancelled (time, label, reason)."""

    def __init__(self, engine: Engine, script=lambda task, label: Plan()):
        self.engine = engine
        self.script = script
        self.started: list[tuple[float, str, Label]] = []
        self.cancelled: list[tuple[float, Label, str | None]] = []

    async def run(self, task: Task, label: Label) -> Session:
        plan = self.script(task, label)
        self.started.append((trio.current_time(), task.name, label))
        calls = []
        try:
            if plan.delay:
                await trio.sleep(plan.delay)
            for i in range(plan.calls):
                version = self.engine.version
                note_progress(version=version)  # as an engine says it, for the running lag
                await trio.sleep(plan.duration / plan.calls)
                prompt = np.arange(1, 3 + i * (1 + plan.tokens), dtype=np.int32) % 30 + 1
                completion = np.full(plan.tokens, 5 + label.sample, np.int32)
                logprobs = np.full(plan.tokens, -0.5, np.float32)
                calls.append(Call(prompt, completion, logprobs, version))
        except trio.Cancelled as cancelled:
            self.cancelled.append((trio.current_time(), label, cancelled.reason))
            if plan.raises_when_cancelled is not None:
                raise plan.raises_when_cancelled from None
            raise
        if plan.raises is not None:
            raise plan.raises
        return Session(plan.status, calls, reward=plan.reward, truncation=plan.truncation)


def dataset(batches: int = 6, size: int = 2) -> ArrayDataset:
    return ArrayDataset({"task_id": np.arange(batches * size)}, batch_size=size)
