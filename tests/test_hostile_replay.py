"""Hostile tests of replay: against episodes of several agents (`Call.seat`, `Session.seats`):
interleaved conversations, seats' own rewards, and what a trace holds of a session the scheduler
takes or refuses; and against hostile trace files (cut anywhere, of another format version, of
an unknown line kind, lines that contradict the run, a forged restored state), each refused
naming its file and line or replayed as far as it goes."""

from __future__ import annotations

import collections
import itertools
import json
import pathlib

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from dew import cli
from dew.data import ArrayDataset
from dew.objectives.rl.scheduler import MAX_IN_FLIGHT
from dew.objectives.rl.sessions import Call, Session, SessionError, Status, chains
from dew.replay import (
    Recorder,
    TraceError,
    read_trace,
    replay,
    replay_async,
)
from dew.testing import assert_replays, record_run
from test_carry_over import _recorded_scheduler

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


@pytest.mark.parametrize("true", [True, np.True_], ids=["bool", "numpy"])
async def test_a_bool_reward_the_scheduler_takes_is_read_back_and_replays(
    tmp_path, autojump_clock, true
):
    """The scheduler takes a bool as a reward, a seat's or a component (a Python bool is an
    int), and numpy's bool as it takes numpy's ints; a bool's trace was refused as a mistyped
    field, a run that trained made unreadable, and numpy's bool was refused as no number."""

    def booleans(session):
        seats, components = {"a": true, "b": not true}, {"x": true}
        return attrs.evolve(session, reward=true, seats=seats, components=components)

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


# --- Hostile trace files: cut, of another format version, of unknown line kinds, or lines that
# contradict each other. Each is a TraceError naming the file and the line, or (a killed run's
# cut) a replay as far as the trace goes; never an exception from inside the replay.


def _resumed_trace(directory: pathlib.Path, name: str = "resumed.trace") -> pathlib.Path:
    """Record a carry-over run for two calls, then its resume from the checkpoint state then
    (groups carried), for three calls more; the resumed run's trace."""
    data = ArrayDataset({"task_id": np.arange(40)}, batch_size=4)

    async def run(path, start, updates, state=None):
        recorder = Recorder(path)
        async with recorder.record(_recorded_scheduler(recorder)):
            if state is not None:
                recorder.restore_state(state)
            stream = recorder.tasks(data).stream(start)
            pending = collections.deque([next(stream), next(stream)])
            for count in updates:
                await recorder.step(pending.popleft(), None, count)
                pending.append(next(stream))
            return recorder.checkpoint_state()

    async def both():
        state = await run(directory / f"first-{name}", 0, range(2))
        assert state["carried"], "the workload must leave groups carried at the checkpoint"
        await run(directory / name, 2, range(2, 5), state)

    trio.run(both, clock=trio.testing.MockClock(autojump_threshold=0))
    return directory / name


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> pathlib.Path:
    """A resumed carry-over run's trace (its stream line restores carried groups), plain."""
    return _resumed_trace(tmp_path_factory.mktemp("resumed"))


def _lines(path: pathlib.Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _write(path: pathlib.Path, lines: list[str]) -> pathlib.Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _refused(path: pathlib.Path, line: int, problem: str, capsys) -> TraceError:
    """Check that read-and-replay and `dew replay` refuse path, naming it, line and problem."""
    with pytest.raises(TraceError) as refused:
        replay(path)
    assert (refused.value.path, refused.value.line) == (str(path), line), refused.value
    assert problem in refused.value.problem, refused.value
    assert cli.main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"dew replay: {path}:{line}: {refused.value.problem}\n", err
    return refused.value


def test_a_resumed_trace_replays(resumed):
    assert replay(resumed).matched


@pytest.mark.medium
@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "gzip"])
def test_a_trace_cut_at_any_byte_replays_as_far_as_it_goes_or_names_its_file_and_line(
    resumed, tmp_path, compressed
):
    """A killed run's trace ends anywhere: in its header (refused, line 1: cut off), within or
    after any later line (replayed up to its last whole call, matching). Plain, every cut
    around each line's start and a sample of the rest; gzip, the first bytes and a sample."""
    lines = _lines(resumed)
    if compressed:
        raw = _resumed_trace(tmp_path, "whole.trace.gz").read_bytes()
        assert raw[:2] == b"\x1f\x8b"
        cuts = sorted(set(range(64)) | set(range(64, len(raw), 61)))
    else:
        raw = resumed.read_bytes()
        starts = [0, *itertools.accumulate(len(line) + 1 for line in lines)]
        near = {s + d for s in starts for d in (-1, 0, 1, 2)} | set(range(0, len(raw), 251))
        cuts = sorted(c for c in near if 0 <= c < len(raw))
    header = len(lines[0]) + 1
    path = tmp_path / ("cut.trace.gz" if compressed else "cut.trace")
    replayed = 0
    for cut in cuts:
        path.write_bytes(raw[:cut])
        try:
            result = replay(path)
        except TraceError as error:
            assert error.path == str(path), error
            if not compressed:
                assert cut < header and error.line == 1, (cut, error)
                assert "cut off" in error.problem or "empty" in error.problem, error
            continue
        assert result.matched, (cut, str(result))
        assert result.cut is not None and "without its end line" in result.cut, result.cut
        replayed += 1
    assert replayed > len(cuts) // 2


@pytest.mark.parametrize(
    "version, why",
    [
        (5, "written by a newer dew: replay it with that one"),
        (2, "an older format this dew no longer reads"),
        ("4", "not a version number"),
        (4.0, "not a version number"),
        (True, "not a version number"),
        (None, "the header lacks its 'version'"),
    ],
)
def test_a_trace_of_another_format_version_is_refused_naming_the_version(
    resumed, tmp_path, capsys, version, why
):
    """Before, a version written as 4.0 was read as version 4."""
    lines = _lines(resumed)
    header = json.loads(lines[0])
    if version is None:
        del header["version"]
    else:
        header["version"] = version
    path = _write(tmp_path / "other.trace", [json.dumps(header), *lines[1:]])
    error = _refused(path, 1, f"dew-trace version {version!r} is not one this dew reads", capsys)
    assert error.problem.endswith(why)


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"kind": "checkpoint", "state": {}}', "has unknown kind 'checkpoint', not one of"),
        ('{"kind": 7}', "field 'kind' must be str, got 7"),
        ('{"state": {}}', "lacks field 'kind'"),
        ("", "is blank, where a trace has a line"),
        ("[1, 2]", "is a JSON list, not an object"),
    ],
    ids=["unknown", "mistyped", "missing", "blank", "list"],
)
def test_an_unknown_or_malformed_line_kind_is_refused_naming_its_line(
    resumed, tmp_path, capsys, line, problem
):
    lines = _lines(resumed)
    path = _write(tmp_path / "kind.trace", [*lines[:3], line, *lines[3:]])
    _refused(path, 4, problem, capsys)


def _changed(lines: list[str], kind: str, change, which: int = 0) -> tuple[list[str], int]:
    """lines with change(data) applied to the `which`-th line of `kind` (of a session, the
    `which`-th returned one), and its number."""
    found = [
        i
        for i, line in enumerate(lines)
        if json.loads(line).get("kind") == kind
        and (kind != "session" or json.loads(line)["outcome"] == "returned")
    ][which]
    data = json.loads(lines[found])
    change(data)
    return [*lines[:found], json.dumps(data), *lines[found + 1 :]], found + 1


def _restored(field: str, index: int, value):
    """A change of a stream line's restored_state[field][index] to value."""
    return lambda line: line["restored_state"][field].__setitem__(index, value)


@pytest.mark.parametrize(
    "kind, which, change, problem",
    [
        ("call", 0, lambda c: c.update(read=99), "call has read 99 batches of stream 0"),
        ("call", 0, lambda c: c.update(read=-1), "call has read -1 batches"),
        ("call", 0, lambda c: c.update(stream=3), "call reads stream 3, which no stream line"),
        ("session", 0, lambda s: s["session"].pop("status"), "lacks field 'status'"),
        ("batch", -1, lambda b: b.update(batch=10**30), "is not one a scheduler gives"),
        ("stream", 0, lambda s: s.update(restored_state="all"), "must be dict, got 'all'"),
        ("stream", 0, _restored("carried", 0, [0]), "carried[0] must be [position, index]"),
        ("stream", 0, _restored("stale", 0, -1), "stale[0] must be a count >= 0, got -1"),
        ("stream", 0, _restored("tasks", 0, 5), "a task must be an object, got 5"),
        ("stream", 0, lambda s: s["restored_state"]["tasks"].pop(), "the line's restored says"),
        ("stream", 0, lambda s: s.update(restored=-2), "restored must be >= 0, got -2"),
        ("push", 0, lambda p: p.update(began=p["time"] + 1), "the push began at"),
        ("push", 0, lambda p: p.update(began="soon"), "field 'began' must be"),
    ],
    ids=[
        "read-past-stream",
        "negative-read",
        "unopened-stream",
        "session-without-status",
        "huge-batch-index",
        "restored-state-not-object",
        "restored-origin",
        "restored-stale",
        "restored-task",
        "restored-miscount",
        "negative-restored",
        "push-began-after-its-end",
        "push-began-not-a-time",
    ],
)
def test_a_line_that_contradicts_the_run_is_refused_naming_it(
    resumed, tmp_path, capsys, kind, which, change, problem
):
    """Before, a call reading past its stream's batches replayed into `RuntimeError: coroutine
    raised StopIteration`, one naming an unopened stream into an IndexError, a returned
    session without a status into a KeyError, and a batch index past int64 into an
    OverflowError, each from inside the replay."""
    lines, number = _changed(_lines(resumed), kind, change, which)
    _refused(_write(tmp_path / "bad.trace", lines), number, problem, capsys)


def test_a_trace_that_starts_before_the_replay_clock_is_refused_naming_its_header(
    resumed, tmp_path, capsys
):
    """Before, a ValueError that `dew replay` printed as a usage error."""
    lines = _lines(resumed)
    header = json.loads(lines[0])
    header["start"] = -5.0
    path = _write(tmp_path / "early.trace", [json.dumps(header), *lines[1:]])
    _refused(path, 1, "the recording starts at time -5.0, before the replay clock's 0.0", capsys)


def test_a_header_cut_partway_says_the_file_is_cut_off(resumed, tmp_path, capsys):
    """Before, a header cut partway was "not a dew trace: its first line is not JSON"."""
    header = _lines(resumed)[0]
    for cut in (12, 40, len(header) - 1, len(header)):
        path = tmp_path / "header.trace"
        path.write_text(header[:cut], encoding="utf-8")
        _refused(path, 1, "is cut off (the file is truncated) in its header line", capsys)


@pytest.mark.medium
def test_a_trace_that_restores_more_rollouts_than_a_batch_may_start_is_refused(
    resumed, tmp_path, capsys
):
    """A forged restored state of a million groups would start millions of rollouts."""
    count = MAX_IN_FLIGHT // 2 + 1

    def many(line):
        state = line["restored_state"]
        line["restored"] = count
        state["carried"] = [[0, 0]] * count
        state["stale"] = [0] * count
        state["tasks"] = [{"name": "0"}] * count

    lines, number = _changed(_lines(resumed), "stream", many)
    path = _write(tmp_path / "many.trace", lines)
    _refused(path, number, f"restores {count} carried groups of 2 rollouts", capsys)
