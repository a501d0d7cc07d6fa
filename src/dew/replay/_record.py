"""Recording a run: the Recorder and the source, dataset and publisher that feed it."""

from __future__ import annotations

import collections
import functools
import gzip
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing

from dew.data import Batch, Dataset, Task
from dew.objectives.rl._session import oldest_call, released_at
from dew.objectives.rl.scheduler import Publisher, RolloutScheduler, SchedulerRecord
from dew.objectives.rl.sessions import Label, Session, SessionError, SessionSource, check_session
from dew.replay._format import (
    FORMAT,
    MAX_LINE,
    VERSION,
    _describe,
    _encode_event,
    _encode_label,
    _encode_record,
    _encode_session,
    _encode_task,
    _plain,
    array_digests,
)


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
        path: where the trace goes, written afresh when the recording starts (a file there is
            replaced; its folder must exist); written line by line, flushed as it goes, so a
            killed run's trace replays up to its last call (`dew.replay.replay`). A name ending
            in `.gz` is written gzip-compressed (an eighth of the size for a small `dew train`
            run), each line flushed as a whole gzip block so the cut-off file of a killed run
            reads as far (which costs about 15 % over compressing the file whole); `read_trace`
            tells the two forms by their first bytes.

    Attributes:
        last_record: the SchedulerRecord of the latest call that returned.
        last_events: that call's event log.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.last_record: SchedulerRecord | None = None
        self.last_events: tuple = ()
        self._file = None
        self._lock = threading.Lock()
        self._scheduler: RolloutScheduler | None = None
        # The scheduler recorded, kept after the recording ends: a run stopped by Ctrl-C saves
        # its checkpoint (and the scheduler's state) once the `with` has closed it.
        self._recorded: RolloutScheduler | None = None
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

    def checkpoint_state(self) -> dict:
        """The scheduler's `checkpoint_state()`, which the Trainer keeps in each checkpoint;
        also once the recording has ended (a stopped run's last checkpoint is saved then).

        Raises:
            RuntimeError: before `record`.
        """
        if self._recorded is None:
            raise RuntimeError("the recorder has no scheduler before `recorder.record(...)`")
        return self._recorded.checkpoint_state()

    def restore_state(self, state: dict) -> None:
        """The scheduler's `restore_state(state)`: the next stream resubmits the checkpoint's
        carried groups, and its line in the trace holds them (`restored_state`: the state, with
        the tasks the scheduler read for it), which a replay gives its scheduler again.

        Raises:
            RuntimeError: outside `record`.
            ValueError: when state is not what checkpoint_state writes.
        """
        self._recording().restore_state(state)

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
            outcome = {"raised": _describe(error), "record": None, "events": events}
            self._write({**line, "returned": time, **outcome, "arrays": {}})
            return
        self.last_record = scheduler.last_record
        self.last_events = tuple(scheduler.last_events)
        self._write(
            {
                **line,
                "returned": time,
                "raised": None,
                "record": _encode_record(scheduler.last_record),
                "events": [_encode_event(e) for e in scheduler.last_events],
                "arrays": array_digests(packed),
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
            "vocab": scheduler.vocab,
            "empty_streak": scheduler.empty_streak,
            "filter_uniform": scheduler.filter_uniform,
            "carry_over": scheduler.config.carry_over,
            "waste_budget": scheduler.config.waste_budget,
            "hedge": scheduler.config.hedge,
            "narrow": scheduler.narrow,
            "align_starts": scheduler.align_starts,
        }
        # Open until `_stop`: the recording spans a `with` of the caller's.
        if self.path.endswith(".gz"):
            self._file = gzip.open(self.path, "wb")
        else:
            self._file = open(self.path, "wb")
        self._scheduler, self._facade = scheduler, facade
        self._recorded = scheduler
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
        """Write one whole line and flush it (a gzip trace's as a sync-flushed block).

        Raises:
            ValueError: for a line longer than MAX_LINE bytes, which no reader would take.
        """
        text = (json.dumps(line, separators=(",", ":")) + "\n").encode("utf-8")
        if len(text) > MAX_LINE:
            raise ValueError(
                f"a trace {line.get('kind', 'header')} line of {len(text)} bytes is longer than "
                f"MAX_LINE ({MAX_LINE}); no reader would take it"
            )
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
        """Write the line of a stream the scheduler has just opened, with the carried groups
        it read for a checkpoint's state (`restore_state`), which its first call submits."""
        scheduler = self._recording()
        stream, self._streams = self._streams, self._streams + 1
        # Reopening forgets what the old stream yielded, as the scheduler's registry does.
        self._stream, self._read = stream, 0
        self._pending.clear()
        if self._facade == "async":
            time, running = trio.current_time(), True
        else:
            # The scheduler's thread starts at the trainer's first call.
            time, running = None, self._step > 0
        line = {"kind": "stream", "stream": stream, "time": time, "running": running}
        if scheduler._next_group:
            line["next_group"] = scheduler._next_group
        resumed = scheduler._resumed()
        if resumed:
            line["restored"] = len(resumed)
            line["restored_state"] = {
                "carried": [list(origin) for origin, _, _ in resumed],
                "stale": [stale for _, _, stale in resumed],
                "tasks": [_encode_task(task) for _, task, _ in resumed],
            }
        self._write(line)
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
        first = oldest_call()
        line = {
            "kind": "session",
            "task": _encode_task(task),
            "label": _encode_label(label),
            "submitted": submitted,
            "ended": ended,
            "outcome": outcome,
            "error": error,
        }
        if first is not None:
            line["first_call"] = list(first)
        released = released_at()
        if released is not None:
            line["started"] = released
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
        # The scheduler opens its stream first: the line holds the carried groups it read then.
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
    returned what the scheduler refuses (written `invalid` with the refusal) is written when it
    ends, with its start and end on the scheduler's clock. The run itself is untouched: the
    same session, the same exception.
    """

    source: SessionSource
    recorder: Recorder

    async def run(self, task: Task, label: Label) -> Session:
        """Run the rollout with `source` and record how it ended, then return (or raise) it."""
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
        # What the scheduler refuses is written as its refusal, which a replay raises alike: a
        # trace cannot hold every value the check tells apart (numpy's ints, a seat named by
        # an int, a mapping's int keys would read back as plain ints and str), nor some at all.
        refusal = _refusal(session, task, label, recorder._recording().vocab)
        try:
            encoded = _encode_session(session) if refusal is None else None
        except TypeError as problem:
            refusal = str(problem)
        if refusal is not None:
            now = trio.current_time()
            recorder._session(task, label, submitted, now, "invalid", error=refusal)
            return session
        return _Stamping.of(
            session,
            functools.partial(recorder._session, task, label, outcome="returned", session=encoded),
        )


def _refusal(session: Any, task: Task, label: Label, vocab: int | None) -> str | None:
    """What the scheduler's check of a returned session raises, as a trainer call that fails on
    it says it (`_describe`); None for a session it takes."""
    stamped = session.stamped(task, label, 0.0, 0.0) if isinstance(session, Session) else session
    try:
        check_session(stamped, vocab=vocab)
    except SessionError as error:
        return _describe(error)
    return None


@attrs.frozen(eq=False)
class RecordingPublisher:
    """A Publisher that passes every weight push on to `publisher` and, once it is taken,
    records it (version, when it began and ended). It offers `load_async` where `publisher`
    does (an instance of its subclass then), so the scheduler awaits the push as it would the
    publisher's own."""

    publisher: Publisher
    recorder: Recorder

    def __new__(cls, publisher: Publisher, recorder: Recorder):
        if cls is RecordingPublisher and hasattr(publisher, "load_async"):
            cls = _AsyncRecordingPublisher
        return super().__new__(cls)

    def load(self, variables: Any, version: int) -> None:
        """Push the weights through `publisher`, then record the push."""
        began = trio.current_time()
        self.publisher.load(variables, version)
        self._recorded(version, began)

    def _recorded(self, version: int, began: float) -> None:
        push = {
            "kind": "push",
            "version": _plain(version),
            "time": trio.current_time(),
            "began": began,
        }
        self.recorder._write(push)


class _AsyncRecordingPublisher(RecordingPublisher):
    """A RecordingPublisher of a publisher with `load_async`."""

    async def load_async(self, variables: Any, version: int) -> None:
        """Push the weights through `publisher.load_async` (the scheduler's run goes on
        meanwhile), then record the push: the instants it began and ended."""
        began = trio.current_time()
        await self.publisher.load_async(variables, version)
        self._recorded(version, began)
