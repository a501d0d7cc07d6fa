"""Hostile tests of `dew.testing` as a user writes replay tests of their own source: the
docs' example run verbatim, `record_run` given wrong `updates` or an existing trace path, the
helpers handed the wrong thing or awaited outside trio, a replay under another width or rows, a
source nondeterministic in its reward or token ids (replay plays the recording back, so it
matches), and a SimulatedSource given a config that is not a SimulatedConfig."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re

import numpy as np
import pytest
import trio
import trio.testing

from dew.envs.simulated import SimulatedEngine, SimulatedSource
from dew.objectives.rl.sessions import Call, Session, Status
from dew.testing import assert_exactly_once, assert_record_adds_up, assert_replays, record_run

DOCS = pathlib.Path(__file__).parent.parent / "docs"
OPTIONS = dict(width=16, rows=8, groups=2, oversample=3)


class Served:
    """The publisher: serves the version pushed last."""

    version = 0

    def load(self, variables, version):
        self.version = version


class Coin:
    """A user's own source, a plain async class as the docs describe: one token after a seeded
    wait, rewarded for heads. `noise` makes it nondeterministic in the `reward` or the `tokens`
    (both vary with how many rollouts it ran before, as a shared RNG or a counter would)."""

    def __init__(self, engine, noise=None):
        self.engine = engine
        self.noise = noise
        self.runs = 0

    async def run(self, task, label):
        rng = np.random.default_rng([int(task.name), label.group, label.sample, label.attempt])
        version = self.engine.version
        await trio.sleep(float(rng.exponential(3.0)))
        heads = int(rng.integers(2))
        self.runs += 1
        token = self.runs % 7 if self.noise == "tokens" else heads + 3
        reward = heads + (0.01 * self.runs if self.noise == "reward" else 0.0)
        call = Call(
            np.array([1, 2], np.int32),
            np.array([token], np.int32),
            np.array([-0.7], np.float32),
            version,
        )
        return Session(Status.COMPLETED, [call], reward=float(reward))


async def _record(path, noise=None, updates=range(4)):
    engine = Served()
    return await record_run(Coin(engine, noise), engine, path, updates=updates, **OPTIONS)


async def test_replay_md_example_runs_verbatim(tmp_path, autojump_clock):
    """Pins docs/replay.md: its replay-test example, copied as it stands, passes (no other test
    runs it)."""
    text = (DOCS / "replay.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[-1]
    namespace: dict = {}
    exec(compile(example, "docs/replay.md", "exec"), namespace)
    await namespace["test_coin_replays"](tmp_path, autojump_clock)


@pytest.mark.parametrize("updates", [[0, 1.5], [0.9, 1.9], ["0", "1"]])
async def test_record_run_refuses_updates_that_are_not_ints(tmp_path, autojump_clock, updates):
    """Failed before: record_run turned each update into an int, so [0, 1.5] silently ran as
    [0, 1] (and "0" as 0). Now it is refused naming the entry, as the scheduler refuses it."""
    with pytest.raises(ValueError, match=r"updates\[\d\] must be an int >= 0"):
        await _record(tmp_path / "run.trace", updates=updates)
    assert not (tmp_path / "run.trace").exists()


@pytest.mark.parametrize("updates", [6, None])
async def test_record_run_says_updates_is_one_entry_per_call(tmp_path, autojump_clock, updates):
    """Failed before: `updates=6` (meaning six calls) raised "'int' object is not iterable".
    Now the message says what updates is."""
    with pytest.raises(TypeError, match=r"updates must be an iterable of ints, one per call"):
        await _record(tmp_path / "run.trace", updates=updates)


async def test_record_run_refuses_no_calls(tmp_path, autojump_clock):
    """Failed before: `updates=[]` recorded a run of no calls, whose replay then matched
    vacuously, so a test that built its updates wrongly passed."""
    with pytest.raises(ValueError, match="updates is empty"):
        await _record(tmp_path / "run.trace", updates=[])


async def test_record_run_overwrites_an_existing_trace(tmp_path, autojump_clock):
    """Pins what docs/replay.md now says: a Recorder (and so record_run) writes its path afresh,
    replacing any file there; a missing folder is not made, and the error names the path."""
    path = tmp_path / "run.trace"
    path.write_text("an older trace\n")
    trace = await _record(path)
    assert json.loads(path.read_text().splitlines()[0])["format"] == "dew-trace"
    assert len(trace.calls) == 4
    missing = tmp_path / "no such folder" / "run.trace"
    with pytest.raises(FileNotFoundError, match="no such folder"):
        await _record(missing)


@pytest.mark.parametrize("noise", ["reward", "tokens"])
async def test_a_nondeterministic_source_still_replays(tmp_path, autojump_clock, noise):
    """Pins what docs/replay.md now says: replay plays the recorded rollouts back and never runs
    the source again, so it checks the scheduler over them, not that the source is
    deterministic: a source whose reward or token ids vary between runs replays. Two
    recordings of it differ in their sessions."""
    engine = Served()
    coin = Coin(engine, noise)  # its count of rollouts run carries over to the second run
    first = await record_run(coin, engine, tmp_path / "first.trace", updates=range(4), **OPTIONS)
    await assert_replays(first)
    engine.version = 0
    second = await record_run(coin, engine, tmp_path / "second.trace", updates=range(4), **OPTIONS)

    def drawn(trace):
        if noise == "reward":
            return [s.session.reward for s in trace.sessions.values() if s.session]
        return [
            s.session.calls[0].completion.tolist() for s in trace.sessions.values() if s.session
        ]

    assert drawn(first) != drawn(second)


@pytest.mark.parametrize(
    ("override", "field"), [({"width": 32}, "fill"), ({"rows": 4}, "fill"), ({"groups": 3}, "")]
)
async def test_replay_under_another_shape_names_step_and_field(
    tmp_path, autojump_clock, override, field
):
    """Pins docs/replay.md ("any configuration value can be overridden, to see where a change
    makes the run part") for width, rows and groups through assert_replays: an AssertionError
    naming the step and what differed, recorded and replayed."""
    trace = await _record(tmp_path / "run.trace")
    with pytest.raises(AssertionError, match=r"replay diverged at step 0\b") as raised:
        await assert_replays(trace, **override)
    assert "recorded" in str(raised.value) and "replayed" in str(raised.value)
    assert field in str(raised.value)


async def test_helpers_name_what_they_want(tmp_path, autojump_clock):
    """Failed before: assert_exactly_once(trace.calls) raised "'RecordedCall' object has no
    attribute 'label'", and assert_record_adds_up(call, call.events) "... no attribute
    'version'". Each now says what it takes."""
    trace = await _record(tmp_path / "run.trace")
    with pytest.raises(TypeError, match=r"events must be LogEvents .*got RecordedCall"):
        assert_exactly_once(trace.calls)
    with pytest.raises(TypeError, match=r"record must be a SchedulerRecord .*got RecordedCall"):
        assert_record_adds_up(trace.calls[0], trace.calls[0].events)
    assert_exactly_once(event for call in trace.calls for event in call.events)


def test_helpers_outside_trio_say_so(tmp_path):
    """Failed before: awaited from asyncio, assert_replays failed with "Task got bad yield" and
    record_run with "must be called from async context". Each now says it runs inside trio, and
    points at `replay` for plain code."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    trace = trio.run(_record, tmp_path / "run.trace", clock=clock)
    with pytest.raises(RuntimeError, match=r"inside a trio run .*dew\.replay\.replay"):
        asyncio.run(assert_replays(trace))
    with pytest.raises(RuntimeError, match=r"record_run runs inside a trio run"):
        asyncio.run(_record(tmp_path / "other.trace"))


@pytest.mark.parametrize("config", [None, {"seed": 1}])
def test_simulated_source_refuses_a_config_of_another_type(config):
    """Failed before: SimulatedSource(engine, None) was taken, and its first rollout then
    raised "'NoneType' object has no attribute 'seed'" out of the scheduler's run."""
    with pytest.raises(TypeError, match=r"config must be a SimulatedConfig"):
        SimulatedSource(SimulatedEngine(), config)
