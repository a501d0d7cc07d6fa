"""`read_trace`: a trace file read back into its records (`_recorded`), every line checked."""

from __future__ import annotations

import base64
import functools
import gzip
import json
import math
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from dew import _gc
from dew.data import Task
from dew.objectives.rl.scheduler import LogEvent, SchedulerRecord
from dew.objectives.rl.sessions import Call, Label, Session, Status
from dew.replay._format import (
    ADDED,
    CONFIG,
    FACADES,
    FORMAT,
    GZIP_MAGIC,
    KINDS,
    MAX_LINE,
    OUTCOMES,
    READ_VERSIONS,
    VERSION,
    TraceError,
)
from dew.replay._recorded import RecordedCall, RecordedSession, RecordedStream, Trace


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
        if type(value) in kinds:
            # JSON's values are of exact types, so this answers nearly every call (a trace has
            # millions) at once; bool is a type of its own, taken only where kinds name it.
            return value
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
            dtype = _dtype(self.get("dtype", (str,), spec))
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
        return np.frombuffer(raw, dtype=dtype).reshape(shape)

    def label(self, value: Any, name: str = "label") -> Label:
        if type(value) is not list or len(value) != 3 or not all(type(v) is int for v in value):
            self.fail(f"field {name!r} must be [group, sample, attempt], got {value!r}")
        return Label(*value)

    def task(self, value: Any) -> Task:
        if not isinstance(value, dict):
            self.fail(f"a task must be an object, got {value!r}")
        return Task(self.get("name", (str,), value), value.get("payload"))


def _first_call(line: _Line) -> tuple[float, int] | None:
    """A session line's `first_call` [time, version], or None where it has none (a trace
    written before the field, or an engine that does not say)."""
    value = line.data.get("first_call")
    if value is None:
        return None
    if (
        type(value) is not list
        or len(value) != 2
        or type(value[0]) not in (int, float)
        or not math.isfinite(value[0])
        or type(value[1]) is not int
        or value[1] < 0
    ):
        line.fail(f"field 'first_call' must be [time, version >= 0], got {value!r}")
    return float(value[0]), value[1]


@functools.lru_cache(maxsize=64)
def _dtype(name: str) -> np.dtype:
    """numpy's dtype of a name, parsed once per name (a trace names a few, on every array)."""
    return np.dtype(name)


def _kind_names(kinds: tuple[type, ...]) -> str:
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


_OPTIONAL_INT = (int, type(None))
# A scheduler numbers its batches from 0; replay hands each over by its index as an int64.
_MAX_BATCH = 2**63
_OPTIONAL_STR = (str, type(None))
_NUMBER = (int, float)
_REWARD = (int, float, bool)


def _decode_session(line: _Line, data: dict) -> Session:
    value = line.get("status", (str,), data)
    try:
        status = Status(value)
    except ValueError:
        line.fail(f"session status {value!r} is not one of {[s.value for s in Status]}")
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
                seat=line.get("seat", _OPTIONAL_STR, call) if "seat" in call else None,
            )
        )
    # A reward may be a bool, as the scheduler takes it (a Python bool is an int): a trace
    # holds the value the source returned.
    components = line.mapping("components", data)
    for name, value in components.items():
        if not isinstance(value, _REWARD):
            line.fail(f"component {name!r} must be a number, got {value!r}")
    seats = line.mapping("seats", data) if "seats" in data else None
    for name, value in (seats or {}).items():
        if not isinstance(value, _REWARD):
            line.fail(f"seat {name!r}'s reward must be a number, got {value!r}")
    return Session(
        status,
        calls,
        reward=line.get("reward", (*_REWARD, type(None)), data),
        components=components,
        truncation=line.get("truncation", _OPTIONAL_STR, data),
        error=line.get("error", _OPTIONAL_STR, data),
        seats=seats,
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
        error=line.get("error", _OPTIONAL_STR, data) if "error" in data else None,
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


def _decode_resumed(line: _Line, restored: int) -> tuple[tuple[tuple[int, int], Task, int], ...]:
    """A stream line's `restored_state`: the checkpoint state the scheduler was restored from
    (`carried` as [stream position, index in its batch], `stale` cycles) and each carried
    group's task, one of each for every one of the line's `restored` groups."""
    state = line.mapping("restored_state")
    carried = line.get("carried", (list,), state)
    stale = line.get("stale", (list,), state)
    tasks = line.get("tasks", (list,), state)
    if not len(carried) == len(stale) == len(tasks) == restored:
        line.fail(
            f"restored_state holds {len(carried)} carried groups, {len(stale)} stale counts "
            f"and {len(tasks)} tasks, where the line's restored says {restored}"
        )
    resumed = []
    for k, (origin, cycles, task) in enumerate(zip(carried, stale, tasks, strict=True)):
        if type(origin) is not list or len(origin) != 2 or not all(_count(x) for x in origin):
            line.fail(f"restored_state carried[{k}] must be [position, index], got {origin!r}")
        if not _count(cycles):
            line.fail(f"restored_state stale[{k}] must be a count >= 0, got {cycles!r}")
        resumed.append(((origin[0], origin[1]), line.task(task), cycles))
    return tuple(resumed)


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _check_read(
    line: _Line,
    streams: Sequence[tuple[float | None, bool, list[int], int, tuple, int]],
    calls: Sequence[RecordedCall],
    stream: int | None,
    read: int,
) -> None:
    """Refuse a call line whose stream and read the recorded trainer cannot have had: a
    stream no line before it opened, an older stream than a call before it read (a trainer
    reads only its newest), or more batches than that stream's lines before it yielded."""
    if stream is None:
        return
    if not 0 <= stream < len(streams):
        line.fail(f"call reads stream {stream}, which no stream line before it opened")
    previous = next((c.stream for c in reversed(calls) if c.stream is not None), 0)
    if stream < previous:
        line.fail(f"call reads stream {stream}, older than stream {previous} a call before read")
    yielded = len(streams[stream][2])
    if not 0 <= read <= yielded:
        line.fail(
            f"call has read {read} batches of stream {stream}, which the lines before it show "
            f"yielding {yielded}"
        )


# How every header a Recorder writes begins.
_HEADER_START = ('{"format":' + json.dumps(FORMAT)).encode()


def _read_header(line: _Line) -> tuple[int, str, dict, float | None]:
    if line.data.get("format") != FORMAT:
        line.fail(
            f"is not a dew trace: a trace's first line is a {FORMAT} header, and this one's "
            f"'format' is {line.data.get('format')!r}"
        )
    version = line.data.get("version")
    if type(version) is not int or version not in READ_VERSIONS:
        if type(version) is int and version > VERSION:
            why = "written by a newer dew: replay it with that one"
        elif type(version) is int:
            why = "an older format this dew no longer reads"
        elif "version" not in line.data:
            why = "the header lacks its 'version'"
        else:
            why = "not a version number"
        line.fail(
            f"{FORMAT} version {version!r} is not one this dew reads (versions "
            f"{', '.join(map(str, READ_VERSIONS))}): {why}"
        )
    facade = line.get("facade", (str,))
    if facade not in FACADES:
        line.fail(f"facade {facade!r} is not one of {FACADES}")
    config = line.mapping("config")
    missing = [name for name in CONFIG if name not in config and name not in ADDED]
    if missing:
        line.fail(f"config lacks {', '.join(missing)}")
    config = {name: config.get(name, ADDED.get(name)) for name in CONFIG}
    return version, facade, config, line.optional_time("start")


def read_trace(path: str | os.PathLike, *, partial: bool = False) -> Trace:
    """Read a trace written by Recorder, plain or gzip-compressed (told by its first bytes).

    Memory stays bounded by the trace's size: a line longer than MAX_LINE bytes is refused
    before it is read whole, and so is JSON nested too deep to parse. The recorded sessions'
    arrays are read-only views of the bytes read, as a record's should be: change a copy.

    Args:
        path: the trace's file.
        partial: read a trace whose recording was cut off (a killed run's: no end line, maybe
            a last line cut partway) up to its last whole line; `Trace.cut` says where it
            ends. Otherwise such a trace is refused.

    Raises:
        TraceError: naming the file, the line and the problem: not a trace at all, not UTF-8,
            not JSON, a line too long, a missing or mistyped field, an unknown format version,
            a line or the end line cut off (unless `partial`).
        OSError: when the file cannot be opened.
    """
    path = os.fspath(path)
    with _gc.paused():  # the records hold no cycles: nothing to collect while they are built
        return _read_trace(path, partial)


def _read_trace(path: str, partial: bool) -> Trace:
    lines, tail = _read_lines(path)

    def parse(number: int, text: str) -> _Line:
        try:
            return _Line(path, number, json.loads(text))
        except json.JSONDecodeError as error:
            if not text.strip():
                raise TraceError(path, number, "is blank, where a trace has a line") from None
            problem = f"is not JSON ({error.msg} at column {error.colno})"
        except RecursionError:
            problem = "is not JSON a trace can hold: it nests too deeply to read"
        except ValueError as error:  # e.g. an integer of more digits than Python converts
            problem = f"is not JSON a trace can hold: {error}"
        if number == 1:
            problem = f"is not a dew trace: its first line {problem}"
        raise TraceError(path, number, problem)

    if not lines:
        if tail is None:
            raise TraceError(path, 1, "the file is empty, not a trace")
        # One unfinished line: a trace's header cut partway (a recorder writes the format
        # first), or a line that says whether it is a header at all.
        if tail and not (tail.startswith(_HEADER_START) or _HEADER_START.startswith(tail)):
            _read_header(parse(1, _decode(path, 1, tail)))
        raise TraceError(path, 1, "is cut off (the file is truncated) in its header line")
    version, facade, config, start = _read_header(parse(1, lines[0]))
    batches: dict[int, tuple[Task, ...]] = {}
    streams: list[tuple[float | None, bool, list[int], int, tuple, int]] = []
    sessions: dict[Label, RecordedSession] = {}
    pushes: list[tuple[float, int]] = []
    push_starts: list[float | None] = []
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
            restored = line.get("restored", (int,)) if "restored" in line.data else 0
            if restored < 0:
                line.fail(f"restored must be >= 0, got {restored}")
            resumed = _decode_resumed(line, restored) if "restored_state" in line.data else ()
            next_group = line.get("next_group", (int,)) if "next_group" in line.data else 0
            if next_group < 0:
                line.fail(f"next_group must be >= 0, got {next_group}")
            streams.append(
                (line.optional_time("time"), running, [], restored, resumed, next_group, number)
            )
        elif kind == "batch":
            index = line.get("batch", (int,))
            if not 0 <= index < _MAX_BATCH:
                line.fail(f"batch index {index} is not one a scheduler gives (0 <= index < 2**63)")
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
                first_call=_first_call(line),
                started=line.optional_time("started") if "started" in line.data else None,
            )
        elif kind == "push":
            pushes.append((line.time("time"), line.get("version", (int,))))
            began = line.optional_time("began") if "began" in line.data else None
            if began is not None and began > pushes[-1][0]:
                line.fail(f"the push began at {began!r}, after it ended at {pushes[-1][0]!r}")
            push_starts.append(began)
        elif kind == "call":
            step = line.get("step", (int,))
            if step != len(calls):
                line.fail(f"call step {step} is out of order (expected {len(calls)})")
            raised = line.get("raised", _OPTIONAL_STR)
            batch = line.get("batch", (int,))
            if batch not in batches:
                line.fail(f"call hands over batch {batch}, which no batch line before it holds")
            stream, read = line.get("stream", _OPTIONAL_INT), line.get("read", (int,))
            _check_read(line, streams, calls, stream, read)
            calls.append(
                RecordedCall(
                    step=step,
                    batch=batch,
                    updates=line.get("updates", (int,)),
                    stream=stream,
                    read=read,
                    handed_over=line.optional_time("handed_over"),
                    returned=line.optional_time("returned"),
                    record=None if raised else _decode_record(line, line.mapping("record")),
                    events=tuple(_decode_event(line, e) for e in line.get("events", (list,))),
                    arrays=line.mapping("arrays"),
                    raised=raised,
                )
            )
        elif kind == "end":
            ended, end = True, line.optional_time("time")
            closing = tuple(_decode_event(line, e) for e in line.get("events", (list,)))
        else:
            line.fail(
                f"has unknown kind {kind!r}, not one of {KINDS} that a {FORMAT} version "
                f"{version} trace holds (a damaged trace, or one of another format?)"
            )
    cut = None
    if tail is not None and (ended or not partial):
        raise TraceError(path, len(lines) + 1, "is cut off (the file is truncated)")
    if not ended:
        if not partial:
            raise TraceError(
                path,
                len(lines),
                "is the last line, and no end line follows: the recording was cut off "
                "(`dew replay` replays it up to there)",
            )
        partway = {None: "", b"": " (its compressed stream ends there)"}.get(
            tail, f" (line {len(lines) + 1} is cut partway)"
        )
        cut = f"the trace ends at line {len(lines)}{partway} without its end line"
        end, closing = _last_return(calls, start), ()
    # The k-th stream opened while the scheduler ran, with no time of its own, is the k-th one
    # the event logs saw reopened.
    reopened = iter([e.time for call in calls for e in call.events if e.kind == "reopened"])
    opened = tuple(
        RecordedStream(
            next(reopened, None) if time is None and running else time,
            running,
            tuple(indices),
            restored,
            resumed,
            next_group,
            number,
        )
        for time, running, indices, restored, resumed, next_group, number in streams
    )
    if start is None or end is None:
        times = _times(opened, sessions.values(), pushes, calls)
        times += [began for began in push_starts if began is not None]
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
        cut=cut,
        push_starts=tuple(push_starts),
    )


def _last_return(calls: Sequence[RecordedCall], start: float | None) -> float | None:
    """Where a cut trace's replay ends: its last call's return (None to read it from the times
    the trace holds, when no call has one)."""
    returned = [t for c in calls for t in (c.handed_over, c.returned) if t is not None]
    return max(returned, default=start)


def _read_lines(path: str) -> tuple[list[str], bytes | None]:
    """A trace file's whole lines, decoded, without their newlines, and what follows the last
    newline (None when nothing does): a writer stopped partway there. A gzip file is read
    through gzip; one cut off (a killed run's) gives its lines up to the cut.

    Raises:
        TraceError: for a line over MAX_LINE bytes, one that is not UTF-8, or a gzip file
            damaged other than at its end.
    """
    with open(path, "rb") as raw:
        compressed = raw.read(len(GZIP_MAGIC)) == GZIP_MAGIC
    lines: list[str] = []
    with gzip.open(path, "rb") if compressed else open(path, "rb") as file:
        while True:
            number = len(lines) + 1
            try:
                line = file.readline(MAX_LINE + 1)
            except EOFError:
                # The compressed stream ends early: the writer was stopped. What it holds
                # stands, but a part of a line that decompressed before the end is lost.
                return lines, b""
            except (gzip.BadGzipFile, zlib.error) as error:
                raise TraceError(path, number, f"is damaged gzip data: {error}") from None
            if len(line) > MAX_LINE:
                raise TraceError(
                    path,
                    number,
                    f"is longer than {MAX_LINE} bytes, longer than any trace line "
                    "(is this a trace?)",
                )
            if not line.endswith(b"\n"):
                return lines, (line or None)
            lines.append(_decode(path, number, line[:-1]))


def _decode(path: str, number: int, line: bytes) -> str:
    """A line's text.

    Raises:
        TraceError: naming the first byte that is not UTF-8.
    """
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as error:
        problem = (
            f"is not UTF-8 text (byte {line[error.start]:#04x} at column {error.start + 1}), "
            "so not a dew trace"
        )
        raise TraceError(path, number, problem) from None


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
