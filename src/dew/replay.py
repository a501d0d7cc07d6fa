"""Traces: record a scheduler run, replay it bit for bit, and find where two runs part.

A trace is JSON lines, no pickle. Its first line is a header, `{"format": "dew-trace",
"version": 2, "facade": ..., "config": {...}, "start": ...}`, holding every RolloutScheduler
argument but the objective, source, weights, tasks and log, and which facade the trainer called:
`async` (`await step` inside the caller's trio run) or `thread` (`scheduler(batch, ...)` from the
trainer's thread). Each later line has a `kind`:

- `stream`: the trainer opened the `tasks()` stream (`stream` id, `time`, and `running`: whether
  the scheduler's trio side ran then, so that the open logged a `reopened` event);
- `batch`: a task batch the scheduler took (`batch` index, the `stream` that yielded it or null
  for a batch handed over without one, its `tasks` as name and, where JSON holds it, payload);
- `session`: one rollout the source ran: its `task`, `label` [group, sample, attempt],
  `submitted` and `ended` on the scheduler's clock (for a returned session, the times the
  scheduler stamped on it), and its `outcome`: `returned` (with the `session`: status, calls
  with their arrays, reward, components, truncation, error), `cancelled` (its run got
  trio.Cancelled at `ended`), `raised` (the source raised `error`) or `invalid` (it returned
  what no trace holds, said in `error`);
- `push`: a weight push (`version`, `time`);
- `call`: one trainer call: its `step`, `batch`, `updates`, the `stream` and how many batches it
  had yielded (`read`), `handed_over` and `returned` times, and either the SchedulerRecord
  (`record`, metrics included), the event log (`events`) and digests of the packed batch it
  returned (`digest` over every array; `arrays`, one per key) — or what it `raised`, with the
  event log up to its failure;
- `end`: the time the scheduler was closed and its `closing_events` (the event log after the
  last call's, through the close); the last line.

Arrays are stored losslessly: `{"dtype", "shape", "data"}` with the raw bytes in base64.

A `thread` trace is written from two threads, the trainer's (streams, batches, calls) and the
scheduler's (sessions, pushes), one whole line at a time. The trainer's thread cannot read the
scheduler's trio clock, so the scheduler's event log tells the times: a call's `handed_over` is
its `handed_over` event's time and `returned` its last event's (the delivery); a stream opened
while the scheduler ran has `time` null in its line and takes the time of its `reopened` event
(the k-th such stream, the k-th `reopened` event of the calls' logs); the header's `start` and
the end line's `time` are null, read as the first and last times the trace holds. A call that
raised has null times. The scheduler then runs on the real clock; its readings that no event
carries are recorded but not compared: each record's `waited` (the trainer thread's seconds)
and each push's time (the engine takes the weights a moment after the hand-over; versions are
compared); nor is what happened after the last call returned (the close is off the trainer's
clock). A rollout's latency and deadline count from its submission event's time, so they replay
exactly.

Replay runs the recorded configuration (with any overrides) against `ReplaySource`, which plays
each recorded rollout back by (task name, label) with its recorded duration and outcome, under
trio's MockClock: the trainer's calls are made at their recorded hand-over times and every
record, event and packed array is compared. The proximal log-probs are not replayed: they are the
trainer's weights' rescoring, and a trace holds no weights. Replay uses `NoRescoring` (zeros) and
compares every packed array but `proximal_logprobs`; the recorded `digest` still covers them, so
two recordings can be compared whole.

`replay(path, **overrides)` runs a replay in a trio run of its own (`replay_async` from inside
another, through a worker thread), and `dew replay TRACE [--max-lag N ...]` from the command
line; each says the replay matched (steps, groups, events) or gives its first divergence: step,
group, sample, event, field, recorded and replayed values.

Time lands exactly: trio's MockClock moves by differences, which can round a jump one ulp past
its target, so `ReplaySource` keeps the clock itself and lands it on the recorded times (session
ends, cancellations, hand-overs). A trace recorded under the mock clock replays bit for bit, and
so does the event log of one recorded on the real clock, whose event times are the scheduler's
own readings.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing

from dew._trio import lone_exception
from dew.data import Batch, Dataset, Task
from dew.objectives.rl.scheduler import LogEvent, Publisher, RolloutScheduler, SchedulerRecord
from dew.objectives.rl.sessions import Call, Label, Session, SessionSource, Status

__all__ = [
    "CONFIG",
    "FACADES",
    "FORMAT",
    "VERSION",
    "Divergence",
    "NoRescoring",
    "RecordedCall",
    "RecordedSession",
    "RecordedSourceError",
    "RecordedStream",
    "Recorder",
    "RecordingPublisher",
    "RecordingSource",
    "ReplayNote",
    "ReplayPublisher",
    "ReplayResult",
    "ReplaySource",
    "ReplayStalled",
    "ReplayedCall",
    "Trace",
    "TraceError",
    "batch_digest",
    "configure_cli",
    "read_trace",
    "replay",
    "replay_async",
    "run_cli",
]

FORMAT = "dew-trace"
VERSION = 3
FACADES = ("async", "thread")
# The RolloutScheduler arguments a trace holds: all but objective, source, weights, tasks, log.
CONFIG = (
    "width",
    "rows",
    "groups",
    "oversample",
    "admit",
    "max_lag",
    "ahead",
    "sync_every",
    "max_attempts",
    "timeout",
    "estimator",
    "truncation",
    "support_capacity",
)
OUTCOMES = ("returned", "cancelled", "raised", "invalid")
PROXIMAL = "proximal_logprobs"
# Real seconds every task must stay blocked before the replay clock moves: any positive cushion
# lets the scheduler's own zero-cushion waits settle an instant first.
_SETTLE = 1e-9


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file, the line and the problem."""

    def __init__(self, path: str, line: int, problem: str):
        super().__init__(f"{path}:{line}: {problem}")
        self.path, self.line, self.problem = path, line, problem


class RecordedSourceError(RuntimeError):
    """A replayed source failure: the recorded source raised, or returned what no trace holds."""


class ReplayStalled(RuntimeError):
    """A replayed run waits on what the trace never ended: every task waits and nothing is due,
    or nothing but the scheduler's own timers until the recording's end plus its length.

    Args:
        time: the replay's clock when it stalled.
    """

    def __init__(self, time: float, why: str):
        super().__init__(f"at time {time!r} {why}: the replayed run waits on what never ends")
        self.time = time


# --- encoding ---------------------------------------------------------------------------------


def _encode_array(array: np.ndarray) -> dict:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected a numpy array, got {type(array).__name__}")
    if array.dtype.hasobject:
        raise TypeError(f"an array of dtype {array.dtype} holds Python objects")
    return {
        "dtype": array.dtype.str,
        "shape": list(array.shape),
        "data": base64.b64encode(array.tobytes()).decode("ascii"),
    }


def _plain(value: Any) -> Any:
    """value with numpy scalars made Python numbers, so JSON takes it and it compares alike."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _encode_task(task: Task) -> dict:
    encoded = {"name": task.name}
    try:
        json.dumps(task.payload)
    except (TypeError, ValueError):
        return encoded
    encoded["payload"] = task.payload
    return encoded


def _encode_label(label: Label | None) -> list[int] | None:
    return None if label is None else [int(label.group), int(label.sample), int(label.attempt)]


def _encode_session(session: Session) -> dict:
    if not isinstance(session, Session):
        raise TypeError(f"the source returned {type(session).__name__}, not a Session")
    if not isinstance(session.status, Status):
        raise TypeError(f"status {session.status!r} is not a Status")
    calls = []
    for call in session.calls:
        if not isinstance(call, Call):
            raise TypeError(f"a call is a {type(call).__name__}, not a Call")
        calls.append(
            {
                "prompt": _encode_array(call.prompt),
                "completion": _encode_array(call.completion),
                "logprobs": _encode_array(call.logprobs),
                "version": _plain(call.version),
                "support": (
                    None if call.support is None else [_encode_array(s) for s in call.support]
                ),
            }
        )
    return {
        "status": session.status.value,
        "calls": calls,
        "reward": _plain(session.reward),
        "components": _plain(session.components),
        "truncation": session.truncation,
        "error": session.error,
    }


def _encode_event(event: LogEvent) -> dict:
    return {
        "kind": event.kind,
        "time": _plain(event.time),
        "version": _plain(event.version),
        "group": _plain(event.group),
        "task": event.task,
        "label": _encode_label(event.label),
        "reason": event.reason,
    }


def _encode_record(record: SchedulerRecord) -> dict:
    return {field.name: _plain(getattr(record, field.name)) for field in attrs.fields(type(record))}


def _array_digest(array: np.ndarray) -> str:
    array = np.asarray(array)
    header = f"{array.dtype.str}{list(array.shape)}".encode()
    return hashlib.sha256(header + array.tobytes()).hexdigest()


def batch_digest(batch: Mapping[str, np.ndarray], *, exclude: Sequence[str] = ()) -> str:
    """sha256 over a packed batch's arrays in sorted key order: name, dtype, shape and bytes.

    Args:
        batch: name -> array.
        exclude: names left out (e.g. `proximal_logprobs`, which replay does not rescore).

    Returns:
        the hex digest.
    """
    digest = hashlib.sha256()
    for key in sorted(batch):
        if key in exclude:
            continue
        array = np.asarray(batch[key])
        digest.update(f"{key}\0{array.dtype.str}{list(array.shape)}\0".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _describe(error: BaseException) -> str:
    """What a call raised, as a trace says it; a replayed source failure says the recorded one."""
    if isinstance(error, RecordedSourceError):
        return str(error)
    return f"{type(error).__name__}: {error}"


# --- the trace, read back ---------------------------------------------------------------------


@attrs.frozen
class RecordedSession:
    """One rollout the recorded source ran, and how it ended.

    Args:
        task, label: what the scheduler asked for.
        submitted, ended: the scheduler's clock when the run started and when it returned,
            raised or was cancelled.
        outcome: one of OUTCOMES.
        session: the returned session (unstamped), for `returned`.
        error: what was raised, or why the returned value could not be held, for `raised` and
            `invalid`.
    """

    task: Task
    label: Label
    submitted: float
    ended: float
    outcome: str
    session: Session | None = attrs.field(default=None, eq=False)
    error: str | None = None


@attrs.frozen
class RecordedCall:
    """One recorded trainer call.

    Args:
        step: its index among the run's calls.
        batch: the scheduler's index of the batch handed over.
        updates: the trainer's updates at the call.
        stream: the tasks() stream open at the call (None if none was).
        read: batches that stream had yielded at the hand-over.
        handed_over, returned: the scheduler's clock at the call and at its return (for a call
            from the trainer's thread, its `handed_over` event and its delivery; None when such a
            call raised).
        record, events: the call's SchedulerRecord and event log.
        digest: batch_digest of the returned packed batch.
        arrays: per key, the digest of that array alone.
        raised: what the call raised instead, if it did.
    """

    step: int
    batch: int
    updates: int
    stream: int | None
    read: int
    handed_over: float | None
    returned: float | None
    record: SchedulerRecord | None
    events: tuple[LogEvent, ...]
    digest: str | None
    arrays: Mapping[str, str]
    raised: str | None


@attrs.frozen
class RecordedStream:
    """One `tasks()` stream the trainer opened.

    Args:
        time: the scheduler's clock when it was opened; None when no scheduler's clock ran (it
            was opened before the scheduler's first call from the trainer's thread) or when no
            delivered call's log holds its `reopened` event.
        running: whether the scheduler's trio side ran when it was opened (the open then logged
            a `reopened` event and cancelled what was in flight).
        batches: the batch indices it yielded, in order.
    """

    time: float | None
    running: bool
    batches: tuple[int, ...]


@attrs.frozen
class Trace:
    """A recorded run, read back.

    Args:
        path: the file it was read from.
        facade: how the trainer called the scheduler, one of FACADES.
        config: the scheduler's configuration, by CONFIG name.
        start: the scheduler's clock when the recording began (a thread trace's first time).
        batches: batch index -> its tasks.
        streams: per stream id, in order of opening.
        sessions: label -> the recorded rollout.
        pushes: every weight push, as (time, version).
        calls: the trainer calls, in order.
        end: the time the scheduler was closed (a thread trace's last time).
        closing_events: the scheduler's `closing_events`: its event log after the last call's,
            through the close.
    """

    path: str
    facade: str
    config: Mapping[str, Any]
    start: float
    batches: Mapping[int, tuple[Task, ...]]
    streams: tuple[RecordedStream, ...]
    sessions: Mapping[Label, RecordedSession]
    pushes: tuple[tuple[float, int], ...]
    calls: tuple[RecordedCall, ...]
    end: float
    closing_events: tuple[LogEvent, ...]


class _Line:
    """One parsed line of a trace, whose field readers raise TraceError naming file and line."""

    def __init__(self, path: str, number: int, data: Any):
        self.path, self.number = path, number
        if not isinstance(data, dict):
            self.fail(f"is a JSON {type(data).__name__}, not an object")
        self.data = data

    def fail(self, problem: str):
        raise TraceError(self.path, self.number, problem)

    def get(self, name: str, kinds: tuple[type, ...], where: Mapping | None = None) -> Any:
        source = self.data if where is None else where
        if name not in source:
            self.fail(f"lacks field {name!r}")
        value = source[name]
        if isinstance(value, bool) and bool not in kinds:
            self.fail(f"field {name!r} must be {_kind_names(kinds)}, got {value!r}")
        if not isinstance(value, kinds):
            self.fail(f"field {name!r} must be {_kind_names(kinds)}, got {value!r}")
        return value

    def time(self, name: str, where: Mapping | None = None) -> float:
        value = self.get(name, (int, float), where)
        if not math.isfinite(value):
            self.fail(f"field {name!r} must be a finite time, got {value!r}")
        return value

    def optional_time(self, name: str, where: Mapping | None = None) -> float | None:
        source = self.data if where is None else where
        if name in source and source[name] is None:
            return None
        return self.time(name, where)

    def mapping(self, name: str, where: Mapping | None = None) -> dict:
        return self.get(name, (dict,), where)

    def array(self, spec: Any, name: str) -> np.ndarray:
        if not isinstance(spec, dict):
            self.fail(f"array {name} must be an object with dtype, shape and data, got {spec!r}")
        try:
            dtype = np.dtype(self.get("dtype", (str,), spec))
        except TypeError as error:
            self.fail(f"array {name} has an unknown dtype: {error}")
        if dtype.hasobject:
            self.fail(f"array {name} has dtype {dtype}, which holds Python objects")
        shape = self.get("shape", (list,), spec)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            self.fail(f"array {name} has shape {shape}, not a list of sizes")
        try:
            raw = base64.b64decode(self.get("data", (str,), spec), validate=True)
        except ValueError as error:
            self.fail(f"array {name} data is not base64: {error}")
        expected = math.prod(shape) * dtype.itemsize
        if len(raw) != expected:
            self.fail(f"array {name} holds {len(raw)} bytes, but {dtype}{shape} takes {expected}")
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()

    def label(self, value: Any, name: str = "label") -> Label:
        if (
            not isinstance(value, list)
            or len(value) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            self.fail(f"field {name!r} must be [group, sample, attempt], got {value!r}")
        return Label(*value)

    def task(self, value: Any) -> Task:
        if not isinstance(value, dict):
            self.fail(f"a task must be an object, got {value!r}")
        return Task(self.get("name", (str,), value), value.get("payload"))


def _kind_names(kinds: tuple[type, ...]) -> str:
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


_OPTIONAL_INT = (int, type(None))
_OPTIONAL_STR = (str, type(None))
_NUMBER = (int, float)


def _decode_session(line: _Line, data: dict) -> Session:
    try:
        status = Status(line.get("status", (str,), data))
    except ValueError:
        line.fail(f"session status {data['status']!r} is not one of {[s.value for s in Status]}")
    calls = []
    for i, call in enumerate(line.get("calls", (list,), data)):
        if not isinstance(call, dict):
            line.fail(f"calls[{i}] must be an object")
        support = line.get("support", (list, type(None)), call)
        calls.append(
            Call(
                prompt=line.array(call.get("prompt"), f"calls[{i}].prompt"),
                completion=line.array(call.get("completion"), f"calls[{i}].completion"),
                logprobs=line.array(call.get("logprobs"), f"calls[{i}].logprobs"),
                version=line.get("version", (int,), call),
                support=(
                    None
                    if support is None
                    else tuple(
                        line.array(kept, f"calls[{i}].support[{j}]")
                        for j, kept in enumerate(support)
                    )
                ),
            )
        )
    components = line.mapping("components", data)
    for name, value in components.items():
        if not isinstance(value, _NUMBER) or isinstance(value, bool):
            line.fail(f"component {name!r} must be a number, got {value!r}")
    return Session(
        status,
        calls,
        reward=line.get("reward", (int, float, type(None)), data),
        components=components,
        truncation=line.get("truncation", _OPTIONAL_STR, data),
        error=line.get("error", _OPTIONAL_STR, data),
    )


def _decode_event(line: _Line, data: Any) -> LogEvent:
    if not isinstance(data, dict):
        line.fail(f"an event must be an object, got {data!r}")
    label = line.get("label", (list, type(None)), data)
    return LogEvent(
        kind=line.get("kind", (str,), data),
        time=line.time("time", data),
        version=line.get("version", _OPTIONAL_INT, data),
        group=line.get("group", _OPTIONAL_INT, data),
        task=line.get("task", _OPTIONAL_STR, data),
        label=None if label is None else line.label(label),
        reason=line.get("reason", _OPTIONAL_STR, data),
    )


def _decode_record(line: _Line, data: dict) -> SchedulerRecord:
    fields = {}
    for field in attrs.fields(SchedulerRecord):
        if field.name in ("resubmitted", "metrics"):
            value = line.mapping(field.name, data)
            for key, number in value.items():
                if not isinstance(number, _NUMBER) or isinstance(number, bool):
                    line.fail(f"record {field.name}[{key!r}] must be a number, got {number!r}")
        elif field.name == "waited":
            value = line.get(field.name, _NUMBER, data)
        else:
            value = line.get(field.name, (int,), data)
        fields[field.name] = value
    return SchedulerRecord(**fields)


def _read_header(line: _Line) -> tuple[str, dict, float | None]:
    if line.data.get("format") != FORMAT:
        line.fail(f"is not a {FORMAT} header (its 'format' is {line.data.get('format')!r})")
    version = line.data.get("version")
    if version != VERSION:
        line.fail(f"{FORMAT} version {version!r} is not one this dew reads (version {VERSION})")
    facade = line.get("facade", (str,))
    if facade not in FACADES:
        line.fail(f"facade {facade!r} is not one of {FACADES}")
    config = line.mapping("config")
    missing = [name for name in CONFIG if name not in config]
    if missing:
        line.fail(f"config lacks {', '.join(missing)}")
    return facade, {name: config[name] for name in CONFIG}, line.optional_time("start")


def read_trace(path: str | os.PathLike) -> Trace:
    """Read a trace written by Recorder.

    Raises:
        TraceError: naming the file, the line and the problem: not JSON, a missing or mistyped
            field, an unknown format version, a line or the end line cut off.
        OSError: when the file cannot be opened.
    """
    path = os.fspath(path)
    with open(path, encoding="utf-8") as file:
        text = file.read()
    lines = text.split("\n")
    if lines[-1]:
        # The last line has no newline: the writer stopped partway through it.
        raise TraceError(path, len(lines), "is cut off (the file is truncated)")
    lines.pop()
    if not lines:
        raise TraceError(path, 1, "the file is empty, not a trace")

    def parse(number: int, text: str) -> _Line:
        try:
            return _Line(path, number, json.loads(text))
        except json.JSONDecodeError as error:
            problem = f"is not JSON ({error.msg} at column {error.colno})"
            raise TraceError(path, number, problem) from None

    facade, config, start = _read_header(parse(1, lines[0]))
    batches: dict[int, tuple[Task, ...]] = {}
    streams: list[tuple[float | None, bool, list[int]]] = []
    sessions: dict[Label, RecordedSession] = {}
    pushes: list[tuple[float, int]] = []
    calls: list[RecordedCall] = []
    ended, end = False, None
    for number, text in enumerate(lines[1:], start=2):
        line = parse(number, text)
        if ended:
            line.fail("follows the trace's end line")
        kind = line.get("kind", (str,))
        if kind == "stream":
            if line.get("stream", (int,)) != len(streams):
                line.fail(f"stream {line.data['stream']} is out of order (expected {len(streams)})")
            running = line.get("running", (bool,))
            if not running and streams and streams[-1][1]:
                line.fail("opens before the scheduler ran, after a stream opened while it ran")
            streams.append((line.optional_time("time"), running, []))
        elif kind == "batch":
            index = line.get("batch", (int,))
            if index in batches:
                line.fail(f"batch {index} is recorded twice")
            stream = line.get("stream", _OPTIONAL_INT)
            if stream is not None:
                if not 0 <= stream < len(streams):
                    line.fail(f"batch {index} names stream {stream}, which was never opened")
                streams[stream][2].append(index)
            batches[index] = tuple(line.task(t) for t in line.get("tasks", (list,)))
        elif kind == "session":
            label = line.label(line.get("label", (list,)))
            if label in sessions:
                line.fail(f"{label} is recorded twice")
            outcome = line.get("outcome", (str,))
            if outcome not in OUTCOMES:
                line.fail(f"outcome {outcome!r} is not one of {OUTCOMES}")
            session = None
            if outcome == "returned":
                session = _decode_session(line, line.mapping("session"))
            sessions[label] = RecordedSession(
                task=line.task(line.get("task", (dict,))),
                label=label,
                submitted=line.time("submitted"),
                ended=line.time("ended"),
                outcome=outcome,
                session=session,
                error=line.get("error", _OPTIONAL_STR),
            )
        elif kind == "push":
            pushes.append((line.time("time"), line.get("version", (int,))))
        elif kind == "call":
            step = line.get("step", (int,))
            if step != len(calls):
                line.fail(f"call step {step} is out of order (expected {len(calls)})")
            raised = line.get("raised", _OPTIONAL_STR)
            batch = line.get("batch", (int,))
            if batch not in batches:
                line.fail(f"call hands over batch {batch}, which no batch line before it holds")
            calls.append(
                RecordedCall(
                    step=step,
                    batch=batch,
                    updates=line.get("updates", (int,)),
                    stream=line.get("stream", _OPTIONAL_INT),
                    read=line.get("read", (int,)),
                    handed_over=line.optional_time("handed_over"),
                    returned=line.optional_time("returned"),
                    record=None if raised else _decode_record(line, line.mapping("record")),
                    events=tuple(_decode_event(line, e) for e in line.get("events", (list,))),
                    digest=None if raised else line.get("digest", (str,)),
                    arrays=line.mapping("arrays"),
                    raised=raised,
                )
            )
        elif kind == "end":
            ended, end = True, line.optional_time("time")
            closing = tuple(_decode_event(line, e) for e in line.get("events", (list,)))
        else:
            line.fail(f"has unknown kind {kind!r}")
    if not ended:
        raise TraceError(
            path, len(lines), "is the last line, and no end line follows: the recording was cut off"
        )
    # The k-th stream opened while the scheduler ran, with no time of its own, is the k-th one
    # the event logs saw reopened.
    reopened = iter([e.time for call in calls for e in call.events if e.kind == "reopened"])
    opened = tuple(
        RecordedStream(
            next(reopened, None) if time is None and running else time, running, tuple(indices)
        )
        for time, running, indices in streams
    )
    if start is None or end is None:
        times = _times(opened, sessions.values(), pushes, calls)
        start = min(times, default=0.0) if start is None else start
        end = max(times, default=start) if end is None else end
    return Trace(
        path=path,
        facade=facade,
        config=config,
        start=start,
        batches=batches,
        streams=opened,
        sessions=sessions,
        pushes=tuple(pushes),
        calls=tuple(calls),
        end=end,
        closing_events=closing,
    )


def _times(
    streams: Sequence[RecordedStream],
    sessions: Iterable[RecordedSession],
    pushes: Sequence[tuple[float, int]],
    calls: Sequence[RecordedCall],
) -> list[float]:
    """Every scheduler's-clock time a trace holds."""
    times = [s.time for s in streams if s.time is not None]
    times += [t for s in sessions for t in (s.submitted, s.ended)]
    times += [time for time, _ in pushes]
    for call in calls:
        times += [t for t in (call.handed_over, call.returned) if t is not None]
        times += [e.time for e in call.events]
    return times


# --- recording --------------------------------------------------------------------------------


class Recorder:
    """Writes one scheduler run's trace, and is the trainer's handle on the scheduler meanwhile.

    Give the scheduler its source and publisher wrapped (RecordingSource, RecordingPublisher),
    then drive it through the recorder, which records each call's hand-over, record, event log
    and packed batch. From the trainer's thread, where the scheduler runs its trio side in a
    thread of its own, the recorder is the trainer's Rollout:

        recorder = Recorder("run.trace")
        scheduler = RolloutScheduler(
            objective, RecordingSource(source, recorder), RecordingPublisher(engine, recorder),
            width=256, rows=16)
        with recorder.record(scheduler):
            for updates, batch in enumerate(recorder.tasks(dataset).stream()):
                packed = recorder(batch, params, updates)

    Inside a trio run (tests, notebooks, under a mock clock), the same with `async with
    recorder.record(scheduler)` and `await recorder.step(batch, params, updates)`.

    The trainer reads its stream ahead as it likes; the recorder notes how far, so replay reads
    alike. Leaving `record` closes the scheduler; the rollouts that close cancels are recorded.
    The two threads of a thread recording write whole lines under one lock.

    Args:
        path: where the trace goes; written line by line, flushed as it goes.

    Attributes:
        last_record: the SchedulerRecord of the latest call that returned.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.last_record: SchedulerRecord | None = None
        self._file = None
        self._lock = threading.Lock()
        self._scheduler: RolloutScheduler | None = None
        self._facade: str | None = None
        self._used = False
        self._next_batch = 0
        # Batches the open stream yielded that the trainer has not handed over yet.
        self._pending: collections.deque[int] = collections.deque()
        self._stream: int | None = None
        self._streams = 0
        self._read = 0
        self._step = 0

    def record(self, scheduler: RolloutScheduler) -> _Recording:
        """Record `scheduler`'s run: `with` for calls from the trainer's thread, `async with`
        inside a trio run (which runs `async with scheduler`); either closes the scheduler at
        its end and writes the trace's end line.

        Raises:
            ValueError: when the scheduler's source or weights are not this recorder's
                RecordingSource and RecordingPublisher, or the recorder was used before.
        """
        if self._used:
            raise ValueError("a Recorder records one run; make a new one for another")
        for name, kind in (("source", RecordingSource), ("weights", RecordingPublisher)):
            wrapped = getattr(scheduler, name)
            if not isinstance(wrapped, kind) or wrapped.recorder is not self:
                raise ValueError(
                    f"the scheduler's {name} must be a {kind.__name__} of this recorder, "
                    f"got {type(wrapped).__name__}"
                )
        return _Recording(self, scheduler)

    def tasks(self, dataset: Dataset) -> Dataset:
        """The scheduler's `tasks(dataset)`, its streams and batches recorded."""
        return _RecordingDataset(self, self._recording().tasks(dataset))

    def __call__(self, batch: Batch, variables: Any, updates: int) -> dict[str, np.ndarray]:
        """`scheduler(batch, variables, updates)` from the trainer's thread, recorded.

        The hand-over and return times are the scheduler's `handed_over` event and its
        delivery, read from the call's event log.
        """
        scheduler = self._recording("thread")
        line = self._hand_over(batch, updates, None)
        try:
            packed = scheduler(batch, variables, updates)
        except Exception as error:
            self._returned(line, None, error=error)
            raise
        events = scheduler.last_events
        line["handed_over"] = next(e.time for e in events if e.kind == "handed_over")
        self._returned(line, events[-1].time, packed=packed)
        return packed

    async def step(self, batch: Batch, variables: Any, updates: int) -> dict[str, np.ndarray]:
        """`await scheduler.step(batch, variables, updates)`, recorded."""
        scheduler = self._recording("async")
        line = self._hand_over(batch, updates, trio.current_time())
        try:
            packed = await scheduler.step(batch, variables, updates)
        except Exception as error:
            self._returned(line, trio.current_time(), error=error)
            raise
        self._returned(line, trio.current_time(), packed=packed)
        return packed

    def _hand_over(self, batch: Batch, updates: int, time: float | None) -> dict:
        """A call's line as far as its hand-over, its batch recorded."""
        if self._pending:
            index = self._pending.popleft()
        else:
            index = self._take_batch(batch, stream=None)
        line = {
            "kind": "call",
            "step": self._step,
            "batch": index,
            "updates": _plain(updates),
            "stream": self._stream,
            "read": self._read,
            "handed_over": time,
        }
        self._step += 1
        return line

    def _returned(
        self,
        line: dict,
        time: float | None,
        *,
        packed: Mapping[str, np.ndarray] | None = None,
        error: Exception | None = None,
    ) -> None:
        """Write a call's line: what it returned, or what it raised."""
        scheduler = self._recording()
        if error is not None:
            # A failed call's log runs up to its failure; a refused call has none.
            events = [_encode_event(e) for e in scheduler.last_events]
            outcome = {"raised": _describe(error), "record": None, "events": events, "digest": None}
            self._write({**line, "returned": time, **outcome, "arrays": {}})
            return
        self.last_record = scheduler.last_record
        self._write(
            {
                **line,
                "returned": time,
                "raised": None,
                "record": _encode_record(scheduler.last_record),
                "events": [_encode_event(e) for e in scheduler.last_events],
                "digest": batch_digest(packed),
                "arrays": {key: _array_digest(packed[key]) for key in sorted(packed)},
            }
        )

    def _begin(self, scheduler: RolloutScheduler, facade: str, start: float | None) -> None:
        if self._used:
            raise ValueError("a Recorder records one run; make a new one for another")
        self._used = True
        config = {
            "width": scheduler.width,
            "rows": scheduler.rows,
            "groups": scheduler.config.groups,
            "oversample": scheduler.config.oversample,
            "admit": scheduler.admit,
            "max_lag": scheduler.config.max_lag,
            "ahead": scheduler.ahead,
            "sync_every": scheduler.sync_every,
            "max_attempts": scheduler.config.max_attempts,
            "timeout": scheduler.timeout,
            "estimator": scheduler.estimator,
            "truncation": scheduler.truncation,
            "support_capacity": scheduler.support_capacity,
        }
        # Open until `_stop`: the recording spans a `with` of the caller's.
        self._file = open(self.path, "w", encoding="utf-8")
        self._scheduler, self._facade = scheduler, facade
        header = {"format": FORMAT, "version": VERSION, "facade": facade}
        self._write({**header, "config": _plain(config), "start": start})

    def _stop(self, end: float | None, *, ended: bool) -> None:
        """Write the end line if the run ended (not if the scheduler failed to start) and close
        the trace."""
        try:
            if ended:
                closing = [_encode_event(e) for e in self._scheduler.closing_events]
                self._write({"kind": "end", "time": end, "events": closing})
        finally:
            self._scheduler = None
            self._file.close()

    def _recording(self, facade: str | None = None) -> RolloutScheduler:
        if self._scheduler is None:
            raise RuntimeError("the recorder records only inside `recorder.record(...)`")
        if facade is not None and facade != self._facade:
            raise RuntimeError(
                "inside `with recorder.record(...)` call `recorder(batch, variables, updates)`; "
                "inside `async with` use `await recorder.step(...)`"
            )
        return self._scheduler

    def _write(self, line: dict) -> None:
        text = json.dumps(line, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(text)
            self._file.flush()

    def _take_batch(self, batch: Batch, stream: int | None) -> int:
        """Record a batch the scheduler takes, under the index the scheduler gives it."""
        scheduler = self._recording()
        index, self._next_batch = self._next_batch, self._next_batch + 1
        tasks = [_encode_task(t) for t in scheduler.task_fn(batch)]
        self._write({"kind": "batch", "batch": index, "stream": stream, "tasks": tasks})
        return index

    def _open_stream(self) -> int:
        self._recording()
        stream, self._streams = self._streams, self._streams + 1
        # Reopening forgets what the old stream yielded, as the scheduler's registry does.
        self._stream, self._read = stream, 0
        self._pending.clear()
        if self._facade == "async":
            time, running = trio.current_time(), True
        else:
            # The scheduler's thread starts at the trainer's first call.
            time, running = None, self._step > 0
        self._write({"kind": "stream", "stream": stream, "time": time, "running": running})
        return stream

    def _yielded(self, stream: int, batch: Batch) -> None:
        if stream != self._stream:
            return
        self._pending.append(self._take_batch(batch, stream))
        self._read += 1

    def _session(
        self,
        task: Task,
        label: Label,
        submitted: float,
        ended: float,
        outcome: str,
        session: dict | None = None,
        error: str | None = None,
    ) -> None:
        line = {
            "kind": "session",
            "task": _encode_task(task),
            "label": _encode_label(label),
            "submitted": submitted,
            "ended": ended,
            "outcome": outcome,
            "error": error,
        }
        if session is not None:
            line["session"] = session
        self._write(line)


class _Recording:
    """`Recorder.record`'s context: `with` records calls from the trainer's thread, `async with`
    runs the scheduler in the caller's trio run; each closes the scheduler at its end."""

    def __init__(self, recorder: Recorder, scheduler: RolloutScheduler):
        self.recorder, self.scheduler = recorder, scheduler

    def __enter__(self) -> Recorder:
        self.recorder._begin(self.scheduler, "thread", None)
        return self.recorder

    def __exit__(self, *exc_info) -> None:
        try:
            # Joins the scheduler's thread: every line it writes is written by then.
            self.scheduler.close()
        finally:
            self.recorder._stop(None, ended=True)

    async def __aenter__(self) -> Recorder:
        self.recorder._begin(self.scheduler, "async", trio.current_time())
        try:
            await self.scheduler.__aenter__()
        except BaseException:
            self.recorder._stop(None, ended=False)
            raise
        return self.recorder

    async def __aexit__(self, *exc_info) -> bool | None:
        # Leaving `async with scheduler` closes it now, cancelling what runs.
        end = trio.current_time()
        try:
            return await self.scheduler.__aexit__(*exc_info)
        finally:
            self.recorder._stop(end, ended=True)


@attrs.frozen
class _RecordingDataset:
    recorder: Recorder
    dataset: Dataset

    def stream(self, start: int = 0) -> Iterator[Batch]:
        batches = self.dataset.stream(start)
        return self._recording(batches, self.recorder._open_stream())

    def _recording(self, batches: Iterator[Batch], stream: int) -> Iterator[Batch]:
        for batch in batches:
            self.recorder._yielded(stream, batch)
            yield batch

    def __len__(self) -> int:
        return len(self.dataset)


@attrs.frozen(eq=False)
class _Stamping(Session):
    """A returned session that tells `note` the times the scheduler stamps on it.

    The scheduler stamps a session with its own clock's readings at the rollout's start and its
    finish; the finish is the time of the rollout's event, which a replay must land on exactly,
    and on the real clock no reading of the source's own is that time.
    """

    note: Callable[[float, float], None] = attrs.field(kw_only=True)

    @classmethod
    def of(cls, session: Session, note: Callable[[float, float], None]) -> _Stamping:
        fields = {f.name: getattr(session, f.name) for f in attrs.fields(Session)}
        return cls(**fields, note=note)

    def stamped(self, task: Task, label: Label, submitted: float, finished: float) -> Session:
        self.note(submitted, finished)
        return super().stamped(task, label, submitted, finished)


@attrs.frozen(eq=False)
class RecordingSource:
    """A SessionSource that records every rollout of `source` into `recorder`'s trace.

    A returned session is written when the scheduler stamps it, with the stamped start and
    finish (the run gets the session as a Session subclass that notes its stamping, which is a
    plain Session again); a run that was cancelled (trio.Cancelled reached it), raised, or
    returned what no trace holds is written when it ends, with its start and end on the
    scheduler's clock. The run itself is untouched: the same session, the same exception.
    """

    source: SessionSource
    recorder: Recorder

    async def run(self, task: Task, label: Label) -> Session:
        recorder = self.recorder
        recorder._recording()
        submitted = trio.current_time()
        try:
            session = await self.source.run(task, label)
        except trio.Cancelled:
            recorder._session(task, label, submitted, trio.current_time(), "cancelled")
            raise
        except Exception as error:
            now = trio.current_time()
            recorder._session(task, label, submitted, now, "raised", error=_describe(error))
            raise
        try:
            encoded = _encode_session(session)
        except TypeError as problem:
            now = trio.current_time()
            recorder._session(task, label, submitted, now, "invalid", error=str(problem))
            return session
        return _Stamping.of(
            session,
            functools.partial(recorder._session, task, label, outcome="returned", session=encoded),
        )


@attrs.frozen(eq=False)
class RecordingPublisher:
    """A Publisher that passes every weight push on to `publisher` and, once it is taken,
    records it (version, time)."""

    publisher: Publisher
    recorder: Recorder

    def load(self, variables: Any, version: int) -> None:
        self.publisher.load(variables, version)
        push = {"kind": "push", "version": _plain(version), "time": trio.current_time()}
        self.recorder._write(push)


# --- replay -----------------------------------------------------------------------------------


class NoRescoring:
    """The objective replay gives the scheduler: every proximal log-prob is 0.

    A trace holds no weights to rescore with, and rescoring is not what replay checks; it costs
    nothing and compiles nothing. Replay compares every packed array but `proximal_logprobs`.
    """

    def packed_log_probs(self, variables: Any, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        """float32[rows, width] zeros, the shape of `batch["tokens"]`."""
        return np.zeros(np.shape(batch["tokens"]), np.float32)


@attrs.define(eq=False)
class ReplayPublisher:
    """A Publisher for replay: it accepts every push and keeps them, as (time, version)."""

    pushes: list[tuple[float, int]] = attrs.field(factory=list, init=False)

    def load(self, variables: Any, version: int) -> None:
        self.pushes.append((trio.current_time(), int(version)))


@attrs.frozen
class ReplayNote:
    """Something a replayed rollout did that the recording did not: at `time`, for `label`,
    what the recording did and what the replay does."""

    time: float
    task: str
    label: Label
    recorded: str
    replayed: str


class ReplaySource:
    """A SessionSource that plays a trace's rollouts back, on trio's MockClock, exactly.

    A rollout is found by (task name, label). Submitted when it was recorded (at its `submitted`
    event where a call's log holds one, else at its recorded start), it ends at its recorded
    end; submitted at another time, its recorded duration later. It returns its
    recorded session (calls and versions as recorded; the scheduler stamps it), raises what was
    recorded (as RecordedSourceError), or, recorded as cancelled, waits until cancelled. Use it
    as an async context manager: inside, it keeps trio's MockClock (which must run at rate 0),
    landing every jump exactly on the recorded times, which MockClock's own jumps can miss by an
    ulp.

    What the replayed run does that the recording did not is kept in `notes`: a rollout the
    trace never ran (it returns INFRA_ERROR at once), one recorded as cancelled still running
    after its recorded cancellation.

    Args:
        trace: a Trace, or the path of one.

    Raises:
        ReplayStalled: (out of the `async with`) when every task waits and nothing is due, or
            nothing until the recording's end plus its length.
    """

    def __init__(self, trace: Trace | str | os.PathLike):
        self.trace = trace if isinstance(trace, Trace) else read_trace(trace)
        self.notes: list[ReplayNote] = []
        # When the scheduler submitted each rollout, by its log: on the real clock the source's
        # own reading of its start comes a moment later.
        self._submitted = {
            e.label: e.time for c in self.trace.calls for e in c.events if e.kind == "submitted"
        }
        # Times the clock should land on: ends of sleeps (which are deadlines), and recorded
        # cancellations (the scheduler's deadline that caused one lands on it).
        self._targets: collections.Counter[float] = collections.Counter()
        self._cancellations: dict[Label, tuple[float, str]] = {}
        # A replay that still waits this long after the recording ended waits on nothing the
        # trace holds.
        self._horizon = self.trace.end + (self.trace.end - self.trace.start)
        self._stack: contextlib.AsyncExitStack | None = None

    async def __aenter__(self) -> ReplaySource:
        clock = trio.lowlevel.current_clock()
        if not isinstance(clock, trio.testing.MockClock) or clock.rate != 0:
            raise RuntimeError(
                f"ReplaySource needs trio.testing.MockClock at rate 0, got {clock!r}"
            )
        if self._stack is not None:
            raise RuntimeError("the ReplaySource is already in use")
        stack = contextlib.AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(self._keep_time, clock)
        stack.callback(nursery.cancel_scope.cancel)
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info) -> bool | None:
        stack, self._stack = self._stack, None
        # The clock keeper is the nursery's one child: a lone error is the body's own, or the
        # keeper's ReplayStalled, and reaches the caller as itself.
        with lone_exception():
            return await stack.__aexit__(*exc_info)

    async def sleep_until(self, time: float) -> None:
        """Sleep until `time` on the replay's clock, landing on it exactly."""
        self._targets[time] += 1
        try:
            await trio.sleep_until(time)
        finally:
            self._targets[time] -= 1
            if not self._targets[time]:
                del self._targets[time]

    async def run(self, task: Task, label: Label) -> Session:
        """Play back the recorded rollout of (task name, label)."""
        if self._stack is None:
            raise RuntimeError("run a ReplaySource inside `async with source:`")
        now = trio.current_time()
        recorded = self.trace.sessions.get(label)
        if recorded is None or recorded.task.name != task.name:
            self.notes.append(ReplayNote(now, task.name, label, "never ran", f"ran at {now!r}"))
            return Session(Status.INFRA_ERROR, error="replay: this rollout is not in the trace")
        if now == self._submitted.get(label, recorded.submitted):
            end = recorded.ended
        else:
            end = now + (recorded.ended - recorded.submitted)
        if recorded.outcome == "cancelled":
            # Returns only by trio.Cancelled.
            await self._until_cancelled(label, task.name, end)
        if end > now:
            await self.sleep_until(end)
        if recorded.outcome == "returned":
            return recorded.session
        raise RecordedSourceError(recorded.error)

    async def _until_cancelled(self, label: Label, task: str, time: float) -> None:
        self._cancellations[label] = (time, task)
        self._targets[time] += 1
        try:
            await trio.sleep_forever()
        finally:
            self._cancellations.pop(label, None)
            self._targets[time] -= 1
            if not self._targets[time]:
                del self._targets[time]

    async def _keep_time(self, clock: trio.testing.MockClock, task_status=trio.TASK_STATUS_IGNORED):
        """Move the clock whenever every task waits: onto the next recorded time if that comes
        before the next deadline or is it (to the ulp), else by the deadline's distance as
        MockClock would."""
        task_status.started()
        while True:
            await trio.testing.wait_all_tasks_blocked(_SETTLE)
            now = trio.current_time()
            for label, (time, task) in list(self._cancellations.items()):
                if time <= now:
                    self.notes.append(
                        ReplayNote(time, task, label, f"cancelled at {time!r}", "still running")
                    )
                    del self._cancellations[label]
            distance = trio.lowlevel.current_statistics().seconds_to_next_deadline
            if distance == math.inf:
                raise ReplayStalled(now, "every task waits and nothing is due")
            deadline = now + distance
            target = min((t for t in self._targets if t > now), default=math.inf)
            # A recorded time the clock would pass is visited: a deadline within an ulp or so
            # of it lands on it, and a recorded cancellation before the next deadline is
            # checked there.
            visit = math.isfinite(target) and (
                target < deadline or abs(target - deadline) <= 4 * math.ulp(target)
            )
            if min(target, deadline) > self._horizon:
                # Only the scheduler's own timers are left, e.g. its long-wait log's doubling.
                raise ReplayStalled(
                    now,
                    f"nothing is due before {self._horizon!r}, the recording's end plus its length",
                )
            if visit:
                _jump_to(clock, target)
            else:
                clock.jump(distance)


def _jump_to(clock: trio.testing.MockClock, target: float) -> None:
    """Jump a rate-0 MockClock from below `target` so that it reads exactly `target`.

    From a time within [target / 2, target] both the difference and the sum are exact
    (Sterbenz); from further below, base + (target - base) can round past target, or no jump at
    all reads exactly target, so the clock first steps to three quarters of the way, short of
    every deadline.
    """
    if clock.current_time() < target / 2:
        clock.jump(0.75 * target - clock.current_time())
    clock.jump(target - clock.current_time())


@attrs.frozen
class _Batches:
    """A dataset whose one stream yields replay batches by the scheduler's batch index."""

    indices: tuple[int, ...]

    def stream(self, start: int = 0) -> Iterator[Batch]:
        for index in self.indices[start:]:
            yield _batch(index)


def _batch(index: int) -> dict[str, np.ndarray]:
    return {"batch": np.array([index], np.int64)}


@attrs.frozen
class ReplayedCall:
    """One trainer call as the replay made it: its record, event log, the packed batch's digest
    and its arrays' (or what it raised), and when it returned."""

    record: SchedulerRecord | None
    events: tuple[LogEvent, ...]
    digest: str | None
    arrays: Mapping[str, str]
    raised: str | None
    returned: float


@attrs.frozen
class Divergence:
    """Where a replay first parts from its recording.

    Args:
        step: the trainer call.
        field: what differs: `events[i].<field>`, `events[i]` (the events are about different
            things, or one log is longer),
            `record.<field>` (with `[key]` for resubmitted and metrics), `packed[key]`,
            `raised`, `call` (one run made fewer calls, or the replay stalled), `push[i]`, or
            `rollout of task ...` (a rollout the recording never ran, or one it cancelled that
            the replay did not).
        recorded, replayed: the two values.
        time: the scheduler's clock where they part.
        event: the index in the step's event log, for event fields.
        kind: the event's kind.
        label: the rollout concerned, where one is.
        group: its group, where one is.
    """

    step: int
    field: str
    recorded: Any
    replayed: Any
    time: float | None = None
    event: int | None = None
    kind: str | None = None
    label: Label | None = None
    group: int | None = None

    @property
    def sample(self) -> int | None:
        return None if self.label is None else self.label.sample

    def __str__(self) -> str:
        where = [f"step {self.step}"]
        if self.label is not None:
            where.append(str(self.label))
        elif self.group is not None:
            where.append(f"group {self.group}")
        if self.event is not None:
            where.append(f"event {self.event} ({self.kind})")
        if self.time is not None:
            where.append(f"time {self.time!r}")
        return (
            f"{', '.join(where)}: {self.field}: recorded {_show(self.recorded)}, "
            f"replayed {_show(self.replayed)}"
        )


def _show(value: Any) -> str:
    """A divergence's value as the report prints it: an event as a log line, else its repr."""
    if not isinstance(value, LogEvent):
        return repr(value)
    what = [value.kind]
    if value.label is not None:
        what.append(str(value.label))
    elif value.group is not None:
        what.append(f"group {value.group}")
    if value.reason is not None:
        what.append(f"({value.reason})")
    return f"{' '.join(what)} at {value.time!r}"


@attrs.frozen
class ReplayResult:
    """What a replay found.

    Args:
        path: the trace's file.
        calls: the replayed trainer calls.
        divergence: the first place the replay parts from the recording; None if it matched.
    """

    path: str
    calls: tuple[ReplayedCall, ...]
    divergence: Divergence | None

    @property
    def matched(self) -> bool:
        return self.divergence is None

    @property
    def steps(self) -> int:
        return len(self.calls)

    @property
    def groups(self) -> int:
        return sum(c.record.groups for c in self.calls if c.record is not None)

    @property
    def events(self) -> int:
        return sum(len(c.events) for c in self.calls)

    def __str__(self) -> str:
        if self.matched:
            return (
                f"{self.path}: replay matched: {self.steps} steps, {self.groups} groups, "
                f"{self.events} events"
            )
        return f"{self.path}: replay diverged at {self.divergence}"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _event_divergence(
    step: int, recorded: Sequence[LogEvent], replayed: Sequence[LogEvent], log: str = "events"
) -> Divergence | None:
    """The first event where two logs differ: the whole events where they are about different
    things (kind, group, task, label), else the one field (time, version, reason). `log` names
    the log in the divergence's field (a call's `events`, or `closing_events`)."""
    for i, (a, b) in enumerate(zip(recorded, replayed, strict=False)):
        if a == b:
            continue
        name = next(
            f.name for f in attrs.fields(LogEvent) if getattr(a, f.name) != getattr(b, f.name)
        )
        if name in ("kind", "group", "task", "label"):
            field, values = f"{log}[{i}]", (a, b)
        else:
            field, values = f"{log}[{i}].{name}", (getattr(a, name), getattr(b, name))
        return Divergence(
            step,
            field,
            *values,
            time=min(a.time, b.time),
            event=i,
            kind=a.kind,
            label=a.label,
            group=a.group,
        )
    if len(recorded) == len(replayed):
        return None
    i = min(len(recorded), len(replayed))
    extra = recorded[i] if len(recorded) > i else replayed[i]
    return Divergence(
        step,
        f"{log}[{i}]",
        recorded[i] if len(recorded) > i else None,
        replayed[i] if len(replayed) > i else None,
        time=extra.time,
        event=i,
        kind=extra.kind,
        label=extra.label,
        group=extra.group,
    )


def _call_divergence(
    recorded: RecordedCall, replayed: ReplayedCall, *, real_clock: bool
) -> Divergence | None:
    """Where a replayed call first differs from its recording: what it raised, its event log
    (but, for `real_clock`, that of a call that raised), its record (but, for `real_clock`,
    `waited`), its packed arrays."""
    step = recorded.step
    end = min((t for t in (recorded.returned, replayed.returned) if t is not None), default=None)
    if recorded.raised != replayed.raised:
        return Divergence(step, "raised", recorded.raised, replayed.raised, time=end)
    if real_clock and recorded.raised is not None:
        # Its log runs up to a failure seen on the real clock a moment after the source raised,
        # a moment the trace does not hold.
        return None
    found = _event_divergence(step, recorded.events, replayed.events)
    if found is not None or recorded.raised is not None:
        return found
    for field in attrs.fields(SchedulerRecord):
        if real_clock and field.name == "waited":
            continue
        a, b = getattr(recorded.record, field.name), getattr(replayed.record, field.name)
        if isinstance(a, Mapping):
            for key in sorted(set(a) | set(b)):
                if not _same(a.get(key), b.get(key)):
                    name = f"record.{field.name}[{key!r}]"
                    return Divergence(step, name, a.get(key), b.get(key), time=end)
        elif not _same(a, b):
            return Divergence(step, f"record.{field.name}", a, b, time=end)
    for key in sorted(set(recorded.arrays) | set(replayed.arrays)):
        if key != PROXIMAL and recorded.arrays.get(key) != replayed.arrays.get(key):
            return Divergence(
                step,
                f"packed[{key!r}]",
                recorded.arrays.get(key),
                replayed.arrays.get(key),
                time=end,
            )
    return None


def _divergences(
    trace: Trace,
    calls: Sequence[ReplayedCall],
    pushes: Sequence[tuple[float, int]],
    notes: Sequence[ReplayNote],
    closing: Sequence[LogEvent],
) -> list[Divergence]:
    """Where the replay parts from the recording: the first call that differs, the first push,
    every note, the closing events; the earliest by (step, time) is the first divergence. A
    thread trace's pushes are compared by version, and its notes up to its last call's return;
    its close came at a time of the real clock that no trace holds, so its closing events are
    not compared."""

    def step_at(time: float) -> int:
        """The call in progress at `time` in the replay."""
        return next((i for i, c in enumerate(calls) if c.returned >= time), len(calls))

    real_clock = trace.facade == "thread"
    if real_clock:
        returned = max((c.returned for c in trace.calls if c.returned is not None), default=None)
        notes = [n for n in notes if returned is not None and n.time <= returned]
    found: list[Divergence] = []
    for recorded, replayed in zip(trace.calls, calls, strict=False):
        divergence = _call_divergence(recorded, replayed, real_clock=real_clock)
        if divergence is not None:
            found.append(divergence)
            break
    if len(trace.calls) != len(calls):
        step = min(len(trace.calls), len(calls))
        made = {True: "made", False: "not made"}
        found.append(
            Divergence(step, "call", made[step < len(trace.calls)], made[step < len(calls)])
        )
    for i, (a, b) in enumerate(zip(trace.pushes, pushes, strict=False)):
        if (a[1] != b[1]) if real_clock else (a != b):
            time = min(a[0], b[0])
            found.append(Divergence(step_at(time), f"push[{i}]", a, b, time=time))
            break
    if not real_clock:
        divergence = _event_divergence(
            len(trace.calls), trace.closing_events, closing, log="closing_events"
        )
        if divergence is not None:
            found.append(divergence)
    for note in notes:
        found.append(
            Divergence(
                step_at(note.time),
                f"rollout of task {note.task!r}",
                note.recorded,
                note.replayed,
                time=note.time,
                label=note.label,
                group=note.label.group,
            )
        )
    return found


def _configure(trace: Trace, overrides: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(CONFIG))
    if unknown:
        raise ValueError(f"cannot override {', '.join(unknown)}: the configuration is {CONFIG}")
    return {**trace.config, **overrides}


def replay(trace: Trace | str | os.PathLike, **overrides: Any) -> ReplayResult:
    """Replay a trace in a trio run of its own, on a `trio.testing.MockClock` from 0.

    The scheduler is rebuilt from the trace's configuration, `overrides` replacing any of it
    (by CONFIG name, e.g. `max_lag=0`), over a ReplaySource, a ReplayPublisher and NoRescoring.
    The trainer's calls are made at their recorded hand-over times with their recorded batches
    and updates, after reading the tasks() stream as far as the recorded trainer had; the
    scheduler is closed at the recorded end.

    Returns:
        the replayed calls and the first divergence, if any.

    Raises:
        ValueError: an unknown override, one the scheduler refuses, or a trace that starts
            before the clock's 0.
        TraceError: when the trace cannot be read.
    """
    return trio.run(
        functools.partial(_replay, trace, overrides),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )


async def replay_async(trace: Trace | str | os.PathLike, **overrides: Any) -> ReplayResult:
    """`replay` from inside a trio run, a test's say: it runs in a worker thread, in a trio
    run and on a MockClock of its own, so it starts at the trace's start whatever the caller's
    clock reads."""
    return await trio.to_thread.run_sync(functools.partial(replay, trace, **overrides))


async def _replay(trace: Trace | str | os.PathLike, overrides: Mapping[str, Any]) -> ReplayResult:
    trace = trace if isinstance(trace, Trace) else read_trace(trace)
    config = _configure(trace, overrides)
    if trio.current_time() > trace.start:
        raise ValueError(
            f"replay must start by the trace's start time {trace.start}; "
            f"the clock reads {trio.current_time()}"
        )
    publisher = ReplayPublisher()
    source = ReplaySource(trace)
    scheduler = RolloutScheduler(
        NoRescoring(),
        source,
        publisher,
        tasks=lambda batch: trace.batches[int(batch["batch"][0])],
        **config,
    )
    calls: list[ReplayedCall] = []
    stalled: list[Divergence] = []
    # Streams opened before the scheduler ran logged no reopening: open them before it runs.
    streams = [
        scheduler.tasks(_Batches(stream.batches)).stream()
        for stream in trace.streams
        if not stream.running
    ]
    try:
        async with source, scheduler:
            await _drive(trace, scheduler, source, calls, streams)
    except ReplayStalled as error:
        step = len(calls)
        recorded = trace.calls[step].returned if step < len(trace.calls) else trace.end
        returned = "returned" if recorded is None else f"returned at {recorded!r}"
        stalled.append(Divergence(step, "call", returned, str(error), time=error.time))
    closing = scheduler.closing_events
    found = _divergences(trace, calls, publisher.pushes, source.notes, closing) + stalled
    divergence = min(
        found, key=lambda d: (d.step, math.inf if d.time is None else d.time), default=None
    )
    return ReplayResult(trace.path, tuple(calls), divergence)


async def _drive(
    trace: Trace,
    scheduler: RolloutScheduler,
    source: ReplaySource,
    calls: list[ReplayedCall],
    streams: list[Iterator[Batch]],
) -> None:
    """The replay's trainer: open streams, read them, hand batches over, as recorded.

    Args:
        streams: the streams opened so far (before the scheduler ran).
    """
    read = 0

    async def open_streams(through: int) -> None:
        nonlocal read
        while len(streams) <= through:
            stream = trace.streams[len(streams)]
            if stream.time is not None:
                await source.sleep_until(stream.time)
            streams.append(scheduler.tasks(_Batches(stream.batches)).stream())
            read = 0

    for call in trace.calls:
        if call.stream is not None:
            await open_streams(call.stream)
            for _ in range(call.read - read):
                next(streams[call.stream])
            read = max(read, call.read)
        # A call from the trainer's thread that raised has no time: hand it over as soon as
        # the replay gets to it, but not before the recording began.
        await source.sleep_until(trace.start if call.handed_over is None else call.handed_over)
        try:
            packed = await scheduler.step(_batch(call.batch), None, call.updates)
        except Exception as error:
            replayed = ReplayedCall(
                None, scheduler.last_events, None, {}, _describe(error), trio.current_time()
            )
            calls.append(replayed)
            continue
        calls.append(
            ReplayedCall(
                scheduler.last_record,
                scheduler.last_events,
                batch_digest(packed),
                {key: _array_digest(packed[key]) for key in sorted(packed)},
                None,
                trio.current_time(),
            )
        )
    await open_streams(len(trace.streams) - 1)
    await source.sleep_until(trace.end)


def _optional(kind: type):
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = f"{kind.__name__} or none"
    return parse


_OPTIONS = {
    "width": int,
    "rows": int,
    "groups": int,
    "oversample": int,
    "admit": _optional(int),
    "max_lag": int,
    "ahead": int,
    "sync_every": int,
    "max_attempts": int,
    "timeout": _optional(float),
    "estimator": str,
    "truncation": str,
    "support_capacity": _optional(int),
}


def configure_cli(parser: argparse.ArgumentParser) -> None:
    """Add `dew replay`'s arguments to its parser: the trace, and one override per CONFIG
    name (`--max-lag 0`, `--timeout none`, ...)."""
    parser.add_argument("trace", help="a trace written by dew.replay.Recorder")
    for name, kind in _OPTIONS.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=kind,
            default=argparse.SUPPRESS,
            help=f"replay with this {name} instead of the recorded one",
        )


def run_cli(args: argparse.Namespace) -> int:
    """`dew replay TRACE [--max-lag N ...]`: replay a trace and print whether it matched.

    Prints the steps, groups and events that matched, or the first divergence: step, group,
    sample, event, field, recorded and replayed values.

    Returns:
        0 when the replay matched, 1 when it diverged, 2 when the trace cannot be read.

    Raises:
        SystemExit: with status 2, through the parser, for an override the scheduler refuses.
    """
    overrides = {name: getattr(args, name) for name in CONFIG if hasattr(args, name)}
    logger = logging.getLogger(RolloutScheduler.__module__)
    level = logger.level
    # The replayed scheduler's long-wait warnings describe the replay, not the recorded run.
    logger.setLevel(logging.ERROR)
    try:
        result = replay(args.trace, **overrides)
    except (TraceError, OSError) as error:
        print(f"dew replay: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        args.parser.error(str(error))
    finally:
        logger.setLevel(level)
    print(result)
    return 0 if result.matched else 1
