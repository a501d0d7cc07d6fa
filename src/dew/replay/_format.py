"""The trace format's constants and errors, and how values are written as JSON lines."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from dew.data import Task
from dew.objectives.rl.grpo import REFERENCE
from dew.objectives.rl.scheduler import LogEvent, SchedulerRecord
from dew.objectives.rl.sessions import Call, Label, Session, Status

FORMAT = "dew-trace"
"""The `format` a trace's header names."""
VERSION = 4
"""The trace format's version, which traces are written in."""
READ_VERSIONS = (3, VERSION)
"""The versions read; a trace of another is refused by name. Version 3's call lines also hold
a whole-batch `digest`, over the proximal log-probs too, which no replay can check (a trace
holds no weights to rescore them with): version 4 drops it, and a version 3 trace is read
without it. Every array's own digest (`arrays`) is in both. A stream line's `restored_state`
(the checkpoint state a resumed run's scheduler took, with its carried groups' tasks) was added
within version 4: a dew that does not know it reads the line by its `restored` count alone
(and refuses to replay it), and this one refuses to replay a trace that has the count alone.
So was a stream line's `next_group` (the id a resumed run's scheduler gave its first group,
from its checkpoint): a trace without it numbers its groups from 0, as resumed runs did
before."""
FACADES = ("async", "thread")
"""How a recorded trainer called the scheduler: `await scheduler.step` or the thread facade."""
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
    "vocab",
    "empty_streak",
    "filter_uniform",
    "carry_over",
    "waste_budget",
    "hedge",
    "narrow",
    "align_starts",
)
"""The RolloutScheduler arguments a trace holds: all but objective, source, weights, tasks, log."""
# CONFIG names added after traces of this VERSION were first written: a trace without one ran
# with the default here.
ADDED = {
    "vocab": None,
    "empty_streak": 5,
    "filter_uniform": False,
    "carry_over": False,
    "waste_budget": 0.2,
    "hedge": True,
    "narrow": False,
    "align_starts": None,
}
KINDS = ("stream", "batch", "session", "push", "call", "end")
"""The kinds of a trace's lines after its header."""
OUTCOMES = ("returned", "cancelled", "raised", "invalid")
"""How a recorded rollout ended: returned a session, was cancelled, raised, or returned what no
trace can hold."""
MAX_LINE = 256 * 2**20
"""The longest trace line, in bytes, that is read (or written): past it a file is refused rather
than read without bound (`/dev/zero`, say, is one endless line)."""
GZIP_MAGIC = b"\x1f\x8b"
"""The first bytes of a gzip file: a trace that starts with them is read through gzip."""
PROXIMAL = "proximal_logprobs"
"""The packed array replay cannot compare: the trainer's rescoring, which needs its weights."""
RESCORED = (PROXIMAL, REFERENCE)
"""Every packed array replay cannot compare: the rescorings under the trainer's weights and
under its reference policy's."""
UNCOMPARED = ("importance/", "mismatch/", "staleness/", "bias/")
"""The prefixes of the record's figures replay cannot compare: those of the rescoring
(`GRPOObjective.importance_metrics`), and the selection bias, whose cancelled rollouts count as
far as their engine reported (replay has none) by the clock they were cancelled at."""


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file, the line and the problem."""

    def __init__(self, path: str, line: int, problem: str):
        super().__init__(f"{path}:{line}: {problem}")
        self.path, self.line, self.problem = path, line, problem


class RecordedSourceError(RuntimeError):
    """A replayed source failure: the recorded source raised, or returned what no trace holds."""


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
    if isinstance(value, np.bool_):
        return bool(value)
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
        encoded = {
            "prompt": _encode_array(call.prompt),
            "completion": _encode_array(call.completion),
            "logprobs": _encode_array(call.logprobs),
            "version": _plain(call.version),
            "support": (None if call.support is None else [_encode_array(s) for s in call.support]),
        }
        if call.seat is not None:  # a multi-agent episode's (see Session.seats)
            encoded["seat"] = call.seat
        calls.append(encoded)
    encoded = {
        "status": session.status.value,
        "calls": calls,
        "reward": _plain(session.reward),
        "components": _plain(session.components),
        "truncation": session.truncation,
        "error": session.error,
    }
    if session.seats is not None:
        encoded["seats"] = _plain(session.seats)
    return encoded


def _encode_event(event: LogEvent) -> dict:
    return {
        "kind": event.kind,
        "time": _plain(event.time),
        "version": _plain(event.version),
        "group": _plain(event.group),
        "task": event.task,
        "label": _encode_label(event.label),
        "reason": event.reason,
        "error": event.error,
    }


def _encode_record(record: SchedulerRecord) -> dict:
    return {field.name: _plain(getattr(record, field.name)) for field in attrs.fields(type(record))}


def _array_digest(array: np.ndarray) -> str:
    array = np.asarray(array)
    header = f"{array.dtype.str}{list(array.shape)}".encode()
    return hashlib.sha256(header + array.tobytes()).hexdigest()


def array_digests(batch: Mapping[str, np.ndarray]) -> dict[str, str]:
    """A packed batch's digests as a trace holds them: per key, in sorted order, the sha256 of
    the array's dtype, shape and bytes."""
    return {key: _array_digest(batch[key]) for key in sorted(batch)}


def _describe(error: BaseException) -> str:
    """What a call raised, as a trace says it; a replayed source failure says the recorded one."""
    if isinstance(error, RecordedSourceError):
        return str(error)
    return f"{type(error).__name__}: {error}"
