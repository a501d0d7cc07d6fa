"""The scheduler's public records: where weights go (`Publisher`), what one call consumed
(`SchedulerRecord`) and what the scheduler is doing (`SchedulerStatus`).

Defined here, apart from the shell that fills them, so that the shell and the public module
both import them without a circle; `dew.objectives.rl.scheduler` is where users import them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

Variables = Any


@runtime_checkable
class Publisher(Protocol):
    """Where the trainer's weights go: load serves them under version.

    A RolloutServer is one; so is an engine fleet's publish sequence.

    A publisher whose push waits on other processes or machines (writing a checkpoint folder,
    HTTP to inference servers, as `dew.serve.vllm.VLLMEngine`'s does) may also offer
    `async def load_async(variables, version)`, the same push as a trio coroutine: the
    scheduler awaits it in place of `load`, so that the rollouts in flight, a gateway and
    anything else in the scheduler's trio run go on during the push. The trainer's call still
    returns only after the push is done, and rollouts the call submits start under the new
    version. A publisher without it is called synchronously, at the trainer's call, before that
    instant settles (what a mock-clock engine such as the simulated one relies on).
    """

    def load(self, variables: Variables, version: int) -> None:
        """Serve `variables` under `version` to every call that starts from now on."""
        ...


@attrs.frozen
class SchedulerRecord:
    """What one trainer call consumed and what it cost.

    version and lag are the oldest admitted call's; groups counts admitted groups; resubmitted
    counts resubmissions by cause (infra_error, cancelled, stale, timeout, unscored); cancelled
    counts in-flight rollouts cancelled as surplus, stale or abandoned; abandoned counts groups
    given up after max_attempts; cut counts complete groups left out because their chains did
    not fit the batch's rows beside the groups admitted before them; waited is the seconds the
    trainer waited. metrics is session_metrics over the admitted rollouts and their packed batch.
    """

    updates: int
    version: int
    lag: int
    groups: int
    resubmitted: Mapping[str, int]
    cancelled: int
    abandoned: int
    cut: int
    waited: float
    metrics: Mapping[str, float]


@attrs.frozen
class SampleStatus:
    """One sample of a group the trainer waits on."""

    sample: int
    attempt: int
    failures: int
    state: str  # running, finished or ended
    age: float  # seconds since its latest submission


@attrs.frozen
class GroupStatus:
    """One group in play: its id, task and batch, its state, and its samples."""

    group: int
    task: str
    batch: int
    state: str
    samples: tuple[SampleStatus, ...]


@attrs.frozen
class SchedulerStatus:
    """What the scheduler is doing: the batch the trainer waits on, every group in play, and
    the most frequent error texts of failed sessions so far, with their counts."""

    time: float
    waiting: int | None
    updates: int | None
    served: int | None
    groups: tuple[GroupStatus, ...]
    errors: tuple[tuple[str, int], ...] = ()

    def __str__(self) -> str:
        waiting = "not waiting" if self.waiting is None else f"waiting on batch {self.waiting}"
        lines = [f"{waiting} at updates {self.updates}, serving {self.served}"]
        if self.errors:
            lines.append("  most frequent errors:")
            lines += [f"    {count}x {error}" for error, count in self.errors]
        for g in self.groups:
            if g.batch != self.waiting:
                continue
            samples = ", ".join(
                f"{s.sample}:{s.state}(attempt {s.attempt}, {s.age:.1f}s)" for s in g.samples
            )
            lines.append(f"  group {g.group} task {g.task!r} {g.state}: {samples}")
        return "\n".join(lines)
