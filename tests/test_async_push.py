"""A publisher's async push (`load_async`): the scheduler awaits it, so rollouts in flight go on
during the push, while the trainer's call still returns only once the push is done.

Under trio's autojump clock, with the scripted source of the scheduler's tests and a publisher
whose push takes two seconds of trio's clock and cannot end until a rollout has run during it.
vLLM's own push (HTTP and a checkpoint folder) is tested on real servers in test_vllm.py.
"""

from __future__ import annotations

import pytest
import trio

from _scripted import OBJECTIVE, PARAMS, ROWS, WIDTH, Engine, Plan, Scripted, dataset
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.testing import assert_replays, record_run

PUSH = 2.0  # seconds of trio's clock a push takes


class AsyncEngine(Engine):
    """A Publisher whose push is a trio coroutine: it takes PUSH seconds, and the pushes after
    the first end only once a rollout has run during them (`ran_during`)."""

    def __init__(self):
        super().__init__()
        self.pushing = False
        self.ran_during = trio.Event()
        self.windows: list[tuple[float, float, int]] = []

    def load(self, variables, version):
        raise AssertionError("the scheduler called load where the publisher has load_async")

    async def load_async(self, variables, version):
        began = trio.current_time()
        self.pushing = True
        await trio.sleep(PUSH)
        if self.windows:
            with trio.fail_after(60):  # never, unless nothing ran during the push
                await self.ran_during.wait()
        self.pushing = False
        self.version = version
        self.windows.append((began, trio.current_time(), version))


class Noting(Scripted):
    """The scripted source, whose rollouts tell the engine when they end during a push."""

    async def run(self, task, label):
        session = await super().run(task, label)
        if self.engine.pushing:
            self.engine.ran_during.set()
        return session


async def test_rollouts_run_during_an_async_push_and_the_call_waits_for_it(autojump_clock):
    engine = AsyncEngine()
    # Batch 0 runs from the first push's end (2 s) to 5 s; the trainer hands batch 1 over at
    # 6 s, and its rollouts, submitted at 2 s, end at 7 s, during the second push.
    source = Noting(engine, lambda task, label: Plan(duration=5.0 if task.name == "1" else 3.0))
    sched = RolloutScheduler(OBJECTIVE, source, engine, width=WIDTH, rows=ROWS, groups=2)
    returned = []
    async with sched:
        stream = sched.tasks(dataset(batches=5, size=1)).stream(0)
        batches = [next(stream), next(stream)]
        for updates in range(3):
            handed = trio.current_time()
            await sched.step(batches.pop(0), PARAMS, updates)
            returned.append((handed, trio.current_time(), sched.last_events))
            batches.append(next(stream))
            await trio.sleep(1.0)
    assert [version for _, _, version in engine.windows] == [0, 1, 2]
    for (began, ended, _), (handed, back, events) in zip(engine.windows, returned, strict=True):
        assert began == handed and ended == handed + PUSH <= back
        # The hand-over, and what it submits, come at the instant the push ended.
        (handed_over,) = [e for e in events if e.kind == "handed_over"]
        assert handed_over.time == ended
    assert engine.windows[:2] == [(0.0, 2.0, 0), (6.0, 8.0, 1)]
    # Batch 2 is submitted by the second hand-over, once the push has ended.
    submitted = {name: t for t, name, label in source.started if label.attempt == 0}
    assert submitted == {"0": 2.0, "1": 2.0, "2": 8.0, "3": 11.0}


async def test_an_async_push_that_fails_fails_the_trainers_call(autojump_clock):
    class Failing(AsyncEngine):
        async def load_async(self, variables, version):
            await trio.sleep(1.0)
            raise RuntimeError(f"the push of version {version} failed")

    engine = Failing()
    sched = RolloutScheduler(OBJECTIVE, Scripted(engine), engine, width=WIDTH, rows=ROWS, groups=2)
    async with sched:
        stream = sched.tasks(dataset(batches=2, size=1)).stream(0)
        with pytest.raises(RuntimeError, match="the push of version 0 failed"):
            await sched.step(next(stream), PARAMS, 0)


def test_a_load_async_that_is_not_a_coroutine_is_refused():
    class Blocking(Engine):
        def load_async(self, variables, version):
            self.load(variables, version)

    with pytest.raises(TypeError, match="weights must have load_async as an async method"):
        RolloutScheduler(OBJECTIVE, Scripted(Blocking()), Blocking(), width=WIDTH, rows=ROWS)


async def test_a_run_with_async_pushes_replays_as_recorded(tmp_path, autojump_clock):
    engine = AsyncEngine()
    engine.ran_during.set()  # no waiting on rollouts here: the recording is what is tested
    source = Scripted(engine, lambda task, label: Plan(duration=1.0 + label.sample))
    trace = await record_run(
        source, engine, tmp_path / "trace", updates=range(4), width=WIDTH, rows=ROWS, groups=2
    )
    assert [time for time, _ in trace.pushes] == [end for _, end, _ in engine.windows]
    result = await assert_replays(trace)
    assert result.steps == 4
