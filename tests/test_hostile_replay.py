"""Hostile tests of replay against episodes of several agents (`Call.seat`, `Session.seats`):
interleaved conversations, seats' own rewards, and what a trace holds of a session the scheduler
takes or refuses."""

from __future__ import annotations

import json
import pathlib

import attrs
import numpy as np
import pytest
import trio

from dew.objectives.rl.sessions import Call, Session, SessionError, Status, chains
from dew.replay import TraceError, read_trace, replay_async
from dew.testing import assert_replays, record_run

OPTIONS = dict(updates=range(4), width=32, rows=8, groups=2, oversample=1)


class Served:
    """The publisher: serves the version pushed last."""

    version = 0

    def load(self, variables, version):
        self.version = version


@attrs.define(eq=False)
class SelfPlay:
    """A game of two seats whose calls interleave (a, b, a, b), each extending its own seat's
    conversation rather than the call before it, and each seat scored on its own (seeded).
    `hostile`, where set, turns the returned session of task 2's sample 1 into something else."""

    engine: Served
    hostile: object = None

    async def run(self, task, label):
        rng = np.random.default_rng([int(task.name), label.group, label.sample, label.attempt])
        version = self.engine.version
        history = {"a": [1, 2], "b": [1, 5]}
        calls = []
        for turn in range(4):
            seat = "ab"[turn % 2]
            await trio.sleep(float(rng.exponential(1.0)))
            completion = [int(rng.integers(10, 20))]
            prompt = np.array(history[seat], np.int32)
            logprobs = np.full(1, -0.7, np.float32)
            calls.append(Call(prompt, np.array(completion, np.int32), logprobs, version, seat=seat))
            history[seat] = history[seat] + completion + [7]
        a = float(rng.integers(2))
        session = Session(Status.COMPLETED, calls, reward=0.0, seats={"a": a, "b": 1.0 - a})
        if self.hostile is not None and (task.name, label.sample) == ("2", 1):
            return self.hostile(session)
        return session


def rewrite(trace, target: pathlib.Path, change) -> int:
    """Copy a trace to target with change(session line) applied to its first returned
    session's line; that line's number."""
    lines = pathlib.Path(trace.path).read_text(encoding="utf-8").split("\n")
    i = next(i for i, line in enumerate(lines) if '"outcome":"returned"' in line)
    data = json.loads(lines[i])
    change(data["session"])
    lines[i] = json.dumps(data)
    target.write_text("\n".join(lines), encoding="utf-8")
    return i + 1


async def test_a_self_play_run_replays_and_its_seats_are_what_it_trains(tmp_path, autojump_clock):
    """Seats and seat tags round-trip, each seat keeps a chain of its own, the run replays; and
    the replay trains on the trace's seats: their rewards swapped, or a call's seat changed,
    the packed batch differs."""
    engine = Served()
    trace = await record_run(SelfPlay(engine), engine, tmp_path / "play.trace", **OPTIONS)
    returned = [s.session for s in trace.sessions.values() if s.outcome == "returned"]
    assert all([c.seat for c in s.calls] == ["a", "b", "a", "b"] for s in returned)
    assert all(len(chains(s)) == 2 for s in returned)
    assert {tuple(sorted(s.seats.items())) for s in returned} == {
        (("a", 0.0), ("b", 1.0)),
        (("a", 1.0), ("b", 0.0)),
    }
    assert sum(call.record.groups for call in trace.calls) > 0
    await assert_replays(trace)

    def swap_rewards(session):
        session["seats"] = {"a": session["seats"]["b"], "b": session["seats"]["a"]}

    def reseat(session):
        session["calls"][2]["seat"] = "b"

    for change in (swap_rewards, reseat):
        path = tmp_path / f"{change.__name__}.trace"
        rewrite(trace, path, change)
        result = await replay_async(path)
        assert result.divergence is not None, change.__name__
        assert result.divergence.field.startswith(("packed[", "record.")), str(result)


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda s: s["calls"][0].update(seat=5), "field 'seat' must be str or null, got 5"),
        (lambda s: s.update(seats=[1.0, 0.0]), "field 'seats' must be dict, got [1.0, 0.0]"),
        (lambda s: s.update(seats="a"), "field 'seats' must be dict"),
        (lambda s: s["seats"].update(a="1"), "seat 'a''s reward must be a number, got '1'"),
        (lambda s: s["seats"].update(a=None), "seat 'a''s reward must be a number, got None"),
    ],
)
async def test_a_malformed_seat_or_seats_is_refused_naming_line_and_field(
    tmp_path, autojump_clock, change, problem
):
    engine = Served()
    trace = await record_run(SelfPlay(engine), engine, tmp_path / "play.trace", **OPTIONS)
    path = tmp_path / "bad.trace"
    line = rewrite(trace, path, change)
    with pytest.raises(TraceError) as error:
        read_trace(path)
    assert (error.value.path, error.value.line) == (str(path), line)
    assert problem in error.value.problem


@pytest.mark.parametrize(
    "hostile",
    [
        lambda s: None,
        lambda s: attrs.evolve(s, calls=[attrs.evolve(c, seat=0) for c in s.calls]),
        lambda s: attrs.evolve(s, seats={0: 1.0, "b": 0.0}),
        lambda s: attrs.evolve(s, seats=[1.0, 0.0]),
        lambda s: attrs.evolve(s, seats={"a": "1", "b": 0.0}),
        lambda s: attrs.evolve(s, seats={"a": float("nan"), "b": 0.0}),
    ],
    ids=["none", "int-seat", "int-key", "list", "str", "nan"],
)
async def test_a_session_the_scheduler_refuses_replays_as_its_refusal(
    tmp_path, autojump_clock, hostile
):
    """The recorded run's call fails on the scheduler's refusal. Its trace reads (before, one
    holding a seat or seats of a type the reader refuses could not be read), and replays
    the same failure (before, a value JSON turns into one the check takes, a numpy int or an
    int key, replayed as a session the scheduler took; and every session that no trace holds
    replayed raising another message than the recorded call's)."""
    engine = Served()
    path = tmp_path / "refused.trace"
    with pytest.raises(SessionError) as refused:
        await record_run(SelfPlay(engine, hostile), engine, path, **OPTIONS)
    trace = read_trace(path)
    assert [s.outcome for s in trace.sessions.values()].count("invalid") == 1
    assert trace.calls[-1].raised == f"SessionError: {refused.value}"
    await assert_replays(trace)


async def test_a_bool_reward_the_scheduler_takes_is_read_back_and_replays(tmp_path, autojump_clock):
    """The scheduler takes a bool as a reward, a seat's or a component (a Python bool is an
    int); its trace was refused as a mistyped field, a run that trained made unreadable."""

    def booleans(session):
        seats, components = {"a": True, "b": False}, {"x": True}
        return attrs.evolve(session, reward=True, seats=seats, components=components)

    engine = Served()
    trace = await record_run(SelfPlay(engine, booleans), engine, tmp_path / "b.trace", **OPTIONS)
    returned = [s.session for s in trace.sessions.values() if s.outcome == "returned"]
    assert any(s.reward is True and s.seats["a"] is True for s in returned)
    await assert_replays(trace)


async def test_numpy_numbers_the_scheduler_takes_are_read_back_and_replay(tmp_path, autojump_clock):
    """A reward, a seat's reward or a component may be a numpy int or float, as a float may
    (the check refused numpy's ints with "must be a finite number, got 1"); the trace holds
    them as plain numbers."""

    def numpy_numbers(session):
        seats = {"a": np.int64(1), "b": np.float32(-0.5)}
        return attrs.evolve(session, reward=np.int32(1), seats=seats, components={"x": np.int8(2)})

    engine = Served()
    trace = await record_run(
        SelfPlay(engine, numpy_numbers), engine, tmp_path / "n.trace", **OPTIONS
    )
    returned = [s.session for s in trace.sessions.values() if s.outcome == "returned"]
    assert any(s.reward == 1 and s.seats == {"a": 1, "b": -0.5} for s in returned)
    await assert_replays(trace)
