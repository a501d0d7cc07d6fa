"""Keep agent rollouts in flight and admit complete groups within a staleness bound.

`RolloutScheduler` is the trainer's Rollout for any SessionSource. Its admission rules live in the
pure core `_admission`; this module is the trio shell around it: it turns happenings into the
core's events, and carries out the core's commands with one cancel scope per rollout inside one
nursery per task batch.

Determinism: happenings are not applied as they arrive. The shell waits until every task of the
run is blocked (so nothing more can happen at this instant of trio's clock), then applies what
arrived in a documented order (`_event_order`): rollouts' finishes by (group, sample, attempt),
then their deadlines, then the trainer's. Under a mock clock, records, packed batches and the
event log are then a function of the seed, the source's behaviour and the clock, not of the order
in which trio runs ready tasks.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import math
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import trio
import trio.testing

from dew._checks import check_int, check_number
from dew._trio import exit_unwrapped, stop_in
from dew.data import Batch, Dataset, Task
from dew.objectives.rl import _admission as core
from dew.objectives.rl._admission import LogEvent
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.sessions import (
    ESTIMATORS,
    TRUNCATION,
    Label,
    Session,
    SessionError,
    SessionSource,
    chains,
    check_session,
    pack,
    session_metrics,
)
from dew.parallel import Pool, default_pool, first_reader_batch

__all__ = ["LogEvent", "Publisher", "RolloutScheduler", "SchedulerRecord", "task_ids"]

logger = logging.getLogger(__name__)

Variables = Any


@runtime_checkable
class Publisher(Protocol):
    """Where the trainer's weights go: load serves them under version.

    A RolloutServer is one; so is an engine fleet's publish sequence.
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


def task_ids(batch: Batch) -> list[Task]:
    """One task per integer task_id row, named by its decimal id.

    Raises:
        ValueError: when the batch has no 1-D integer `task_id` array.
    """
    if "task_id" not in batch:
        raise ValueError(f"task_ids needs a 'task_id' array in the batch, got {sorted(batch)}")
    ids = np.asarray(batch["task_id"])
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"task_id must be a 1-D integer array, got {ids.dtype}{list(ids.shape)}")
    return [Task(name=str(int(i))) for i in ids]


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


@attrs.frozen
class _HandOver:
    """What the trainer side prepared for one call."""

    event_fields: dict
    variables: Variables = attrs.field(eq=False)


@attrs.frozen
class _Delivery:
    groups: tuple[tuple[Session, ...], ...]
    events: tuple[LogEvent, ...]


@attrs.frozen
class _Failure:
    """A call that fails, with the event log up to its failure."""

    error: BaseException = attrs.field(eq=False)
    events: tuple[LogEvent, ...] = ()


def _event_order(item: tuple[int, core.Event]) -> tuple:
    """The documented order of events at one instant: rollouts' finishes (and failures) by
    (group, sample, attempt), then their deadlines in the same order, so that what finished
    by its deadline, or completed its group by a sibling's, counts; then the trainer's side
    (hand-over, reopen, close) in the order it posted them."""
    posted, event = item
    label = getattr(event, "label", None)
    if label is None:
        return (event.time, 2, posted, 0, 0)
    deadline = isinstance(event, core.TimedOut)
    return (event.time, int(deadline), label.group, label.sample, label.attempt)


# Sizes beyond these cannot work on any machine, and would fail late (a MemoryError after minutes,
# or a hang) rather than at construction: a row of at most MAX_WIDTH tokens, a packed batch of at
# most MAX_CELLS cells per process (its int32 and float32 arrays take about 32 bytes a cell, so
# 4 GiB), at most MAX_SAMPLES rollouts per group, and at most MAX_IN_FLIGHT rollouts submitted
# for one task batch.
MAX_WIDTH = 2**20
MAX_CELLS = 2**27
MAX_SAMPLES = 2**16
MAX_IN_FLIGHT = 2**20
# Distinct error texts status() counts, and how many of the most frequent it shows.
ERRORS_KEPT = 64
ERRORS_SHOWN = 5


def _check_collaborators(objective, source, weights, tasks, log) -> None:
    """Refuse a collaborator that cannot do its part, before the first call finds out.

    Raises:
        TypeError: naming the argument and what it needs.
    """

    def refuse(name: str, needs: str, value) -> TypeError:
        return TypeError(f"{name} must {needs}, got {type(value).__name__}")

    if not callable(getattr(objective, "packed_log_probs", None)):
        raise refuse("objective", "have packed_log_probs (a GRPOObjective)", objective)
    if not inspect.iscoroutinefunction(getattr(source, "run", None)):
        raise refuse("source", "have an async run(task, label) method (a SessionSource)", source)
    if not callable(getattr(weights, "load", None)):
        raise refuse("weights", "have a load(variables, version) method (a Publisher)", weights)
    if not callable(tasks):
        raise refuse("tasks", "be callable as tasks(batch) -> Sequence[Task]", tasks)
    if log is not None and not callable(log):
        raise refuse("log", "be None or callable as log(record)", log)


def _check_sizes(
    *, width: int, rows: int, groups: int, oversample: int, support_capacity: int | None
) -> None:
    """Refuse sizes no run can hold (see MAX_WIDTH and its neighbours).

    Raises:
        ValueError: naming the argument, the bound and the value.
    """
    if width > MAX_WIDTH:
        raise ValueError(f"width must be <= {MAX_WIDTH} tokens, got {width}")
    if rows * width > MAX_CELLS:
        raise ValueError(
            f"rows * width must be <= {MAX_CELLS} cells (the packed batch), got {rows} * {width}"
        )
    if groups > rows * width:
        raise ValueError(
            f"groups must be <= rows * width = {rows * width}: each rollout of a group takes at "
            f"least one cell of the batch, so a larger group could never be packed; got {groups}"
        )
    if groups + oversample > MAX_SAMPLES:
        raise ValueError(
            f"oversample must keep groups + oversample <= {MAX_SAMPLES} rollouts per group, "
            f"got {groups} + {oversample}"
        )
    if support_capacity is not None and rows * support_capacity > MAX_CELLS:
        raise ValueError(
            f"support_capacity must keep rows * support_capacity <= {MAX_CELLS}, "
            f"got {rows} * {support_capacity}"
        )


class _Scheduler:
    """The scheduler's workings behind `RolloutScheduler`, which the caller holds.

    Its trio side (the driver, the deadline watch, every rollout) holds this object, never the
    `RolloutScheduler` in front of it, so a scheduler its caller drops can be collected, and
    its collection closes this (see `RolloutScheduler`). Arguments and errors are
    `RolloutScheduler`'s.
    """

    def __init__(
        self,
        objective: GRPOObjective,
        source: SessionSource,
        weights: Publisher,
        *,
        width: int,
        rows: int,
        tasks: Callable[[Batch], Sequence[Task]],
        groups: int,
        oversample: int,
        admit: int | None,
        max_lag: int,
        ahead: int,
        sync_every: int,
        max_attempts: int,
        timeout: float | None,
        estimator: str,
        truncation: str,
        support_capacity: int | None,
        log: Callable[[SchedulerRecord], None] | None,
        vocab: int | None,
        empty_streak: int | None,
    ):
        _check_collaborators(objective, source, weights, tasks, log)
        for name, value, bound in [
            ("width", width, 1),
            ("rows", rows, 1),
            ("groups", groups, 1),
            ("oversample", oversample, 0),
            ("ahead", ahead, 0),
            ("sync_every", sync_every, 1),
            ("max_attempts", max_attempts, 1),
            ("max_lag", max_lag, 0),
        ]:
            check_int(name, value, low=bound)
        if admit is not None:
            check_int("admit", admit, low=1)
        for name, value in [
            ("support_capacity", support_capacity),
            ("vocab", vocab),
            ("empty_streak", empty_streak),
        ]:
            if value is not None:
                check_int(name, value, low=1)
        _check_sizes(
            width=width,
            rows=rows,
            groups=groups,
            oversample=oversample,
            support_capacity=support_capacity,
        )
        if max_lag < ahead + sync_every - 1:
            raise ValueError(
                f"max_lag must be >= ahead + sync_every - 1 = {ahead + sync_every - 1} "
                f"(a first submission can be that stale at consumption), got {max_lag}"
            )
        if timeout is not None:
            check_number("timeout", timeout, low=0, low_open=True)
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
        self.objective = objective
        self.source = source
        self.weights = weights
        self.width, self.rows = width, rows
        self.task_fn = tasks
        self.admit = admit
        self.ahead = ahead
        self.sync_every = sync_every
        self.timeout = timeout
        self.estimator = estimator
        self.truncation = truncation
        self.support_capacity = support_capacity
        self.log = log
        self.vocab = vocab
        self.empty_streak = empty_streak
        self.config = core.Config(
            groups=groups,
            oversample=oversample,
            admit=admit,
            max_lag=max_lag,
            max_attempts=max_attempts,
            truncation=truncation,
        )
        # While the trainer waits, what it waits on is logged after this many seconds, then
        # after twice as many, and so on; None logs nothing (simulations that wait by design).
        self.long_wait: float | None = 60.0
        # Where this process meets the others of a multi-process trainer, twice a call; its
        # share_size says how many consecutive processes read one data share (a tensor or
        # sequence axis across processes): only a share's first reader samples, the others
        # train on its rows.
        self.pool: Pool = default_pool()
        self.last_record: SchedulerRecord | None = None
        self.last_events: tuple[LogEvent, ...] = ()
        # The rest of the event log at close(): what came after the last call's delivery, and
        # the `closed` cancellations that end every submission still in flight.
        self.closing_events: tuple[LogEvent, ...] = ()

        self._state = core.initial(self.config)
        # The trainer's side: what its stream registered, what it handed over, what it pushed.
        self._lock = threading.Lock()
        self._calling = threading.Lock()
        self._tasked = -1  # the newest batch whose tasks the trio side has
        self._registry: list[tuple[int, Batch]] = []
        self._next_batch = 0
        self._generation = 0
        self._updates: int | None = None
        self._served: int | None = None
        self._failed: BaseException | None = None
        self._closed = False
        # The trio side.
        self._trio_thread: int | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._clock: trio.abc.Clock | None = None
        self._thread: threading.Thread | None = None
        self._crash: BaseException | None = None
        self._mode: str | None = None  # "async" inside the caller's run, "thread" in our own
        self._exit_stack: contextlib.AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._pending: list[core.Event] = []
        self._wake = trio.Event()
        self._scopes: dict[Label, trio.CancelScope] = {}
        self._deadlines: collections.deque[tuple[float, Label]] = collections.deque()
        self._deadline_added = trio.Event()
        self._batches: dict[int, tuple[trio.Nursery, trio.Event]] = {}
        # The first failure in the core's order goes to the trainer; later ones are logged.
        self._failure: core.Fail | None = None
        self._events: list[LogEvent] = []
        self._watch: trio.CancelScope | None = None
        self._waiting = False  # a hand-over waits for its delivery
        self._newest_pushed: int | None = None  # the newest version ever pushed to the engines
        # Failed sessions' error texts and how often each came, for status().
        self._errors: collections.Counter[str] = collections.Counter()
        # The trainer's side: the records of the current streak of calls that trained on
        # nothing, and whether a chain too long for any row has been reported.
        self._empty: list[tuple[SchedulerRecord, tuple[LogEvent, ...]]] = []
        self._reported_too_long = False
        self._send, self._receive = trio.open_memory_channel[_Delivery | _Failure](math.inf)

    # --- the data stream ----------------------------------------------------------------------

    def tasks(self, dataset: Dataset) -> Dataset:
        """dataset with a training stream that registers each task batch ahead of the step.

        Opening the stream again, as a resume does, cancels every rollout the previous stream
        left in flight.
        """
        return _RegisteringDataset(self, dataset)

    def _open_stream(self) -> int:
        with self._lock:
            self._generation += 1
            self._registry.clear()
            generation = self._generation
            # A resumed trainer may go back in updates, and its restored weights must be pushed.
            self._updates = self._served = None
        self._post_anywhere(lambda: core.Reopened(trio.current_time()))
        return generation

    def _register(self, generation: int, batch: Batch) -> None:
        with self._lock:
            if generation == self._generation:
                self._registry.append((self._next_batch, batch))
                self._next_batch += 1

    # --- the trainer's side -------------------------------------------------------------------

    def __call__(self, batch: Batch, variables: Variables, updates: int) -> dict[str, np.ndarray]:
        """Hand batch over from the trainer's thread; return its packed, rescored rows."""
        if self._mode == "async":
            raise RuntimeError("inside `async with scheduler:` use `await scheduler.step(...)`")
        with self._one_call():
            return self._call(batch, variables, updates)

    def _call(self, batch: Batch, variables: Variables, updates: int) -> dict[str, np.ndarray]:
        self._check_usable()
        if not self.pool.is_first_reader():
            return self._read_share(variables, updates)
        start = time.perf_counter()
        try:
            self._start_thread()
            handover = self._prepare(batch, variables, updates)
            trio.from_thread.run_sync(self._hand_over, handover, trio_token=self._token)
            message = trio.from_thread.run(self._receive.receive, trio_token=self._token)
        except (trio.RunFinishedError, trio.Cancelled) as stopped:
            message = self._left_behind()
            if message is None and (stop := stop_in(self._crash)) is not None:
                # A KeyboardInterrupt or SystemExit inside a source stops the program, as itself.
                self._failed = stop
                raise stop from None
            if message is None:
                error = RuntimeError("the scheduler's trio thread stopped")
                error.__cause__ = self._crash or stopped
                message = _Failure(error)
        except Exception as error:
            message = _Failure(error)
        return self._finish(message, variables, updates, time.perf_counter() - start)

    async def step(self, batch: Batch, variables: Variables, updates: int) -> dict[str, np.ndarray]:
        """The same call as `scheduler(batch, variables, updates)`, inside `async with`."""
        if self._mode != "async" or self._trio_thread != threading.get_ident():
            raise RuntimeError("`await scheduler.step(...)` runs inside `async with scheduler:`")
        with self._one_call():
            return await self._step(batch, variables, updates)

    async def _step(
        self, batch: Batch, variables: Variables, updates: int
    ) -> dict[str, np.ndarray]:
        self._check_usable()
        if not self.pool.is_first_reader():
            return self._read_share(variables, updates)
        start = trio.current_time()
        try:
            self._hand_over(self._prepare(batch, variables, updates))
        except Exception as error:
            return self._finish(_Failure(error), variables, updates, 0.0)
        try:
            message = await self._receive.receive()
        except trio.Cancelled:
            # Its groups, delivered later, would go to the next call: trained at later updates,
            # past max_lag, while that call's own batch is never delivered.
            self._failed = RuntimeError(
                f"the call at updates {updates} was cancelled while it waited for its rollouts"
            )
            if self._watch is not None:
                self._watch.cancel(reason="cancelled")
            raise
        return self._finish(message, variables, updates, trio.current_time() - start)

    def _left_behind(self) -> _Delivery | _Failure | None:
        """What the trio side sent this call before its thread stopped, if anything: a close()
        from another thread answers a call that is about to wait, then ends the run it would
        have waited in. Read once that thread has ended, so nothing else touches the channel."""
        self._thread.join()
        try:
            return self._receive.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return None

    @contextlib.contextmanager
    def _one_call(self):
        """Refuse a second call while one is in progress: the trainer makes one at a time, and
        a second would take the first's delivery, and leave its own batch undelivered."""
        if not self._calling.acquire(blocking=False):
            raise RuntimeError("the scheduler is already serving a call: make one at a time")
        try:
            yield
        finally:
            self._calling.release()

    def _check_usable(self) -> None:
        """Refuse a call to a closed or stopped scheduler, before it meets the pool: a failure
        met at the agreement point stopped every process's scheduler alike."""
        if self._closed:
            raise RuntimeError("the scheduler is closed")
        if self._failed is not None:
            raise RuntimeError(
                f"the scheduler stopped after an earlier call failed: {self._failed!r}"
            ) from self._failed

    def _check_updates(self, updates: int) -> int:
        updates = check_int("updates", updates, low=0)
        if self._updates is not None and updates < self._updates:
            raise ValueError(f"updates went backwards: {updates} after {self._updates}")
        return updates

    def _agree(self, error: BaseException | None) -> None:
        """Meet the pool where a failure on any process raises on every one. What it raises
        stops this scheduler too, so each process refuses its next call alike, before the
        pool, where a stopped process would never come."""
        try:
            self.pool.agree(error)
        except BaseException as failure:
            self._failed = failure
            raise

    def _read_share(self, variables: Variables, updates: int) -> dict[str, np.ndarray]:
        """A share's later reader: it samples nothing and logs nothing, but meets the pool
        where the first reader does (the push, the agreement, the rows, the rescoring)."""
        error = None
        try:
            updates = self._updates = self._check_updates(updates)
            if core.push_due(self._served, updates, self.sync_every):
                self.weights.load(variables, updates)
                self._served = updates
        except Exception as problem:
            error = problem
        self._agree(error)
        empty = pack(
            [],
            width=self.width,
            rows=self.rows,
            estimator=self.estimator,
            truncation=self.truncation,
            support_capacity=self.support_capacity,
        )
        batch = first_reader_batch(empty.batch, share_size=self.pool.share_size)
        batch["proximal_logprobs"] = self.pool.rescore(self.objective, variables, batch)
        return batch

    def _prepare(self, batch: Batch, variables: Variables, updates: int) -> _HandOver:
        """Match the batch to the stream's registry and decide the push, on the trainer's side."""
        updates = self._check_updates(updates)
        with self._lock:
            registered = bool(self._registry)
            if not registered and self._generation > 0:
                raise ValueError(
                    "the batch handed over was not read from the current tasks() stream (the "
                    "stream was reopened, or has not yielded it yet): hand over what it yields"
                )
            if registered:
                index, expected = self._registry[0]
                if not _same_batch(expected, batch):
                    raise ValueError(
                        "the batch handed over is not the next one the tasks() stream yielded; "
                        "hand batches over in the order the stream yields them"
                    )
            else:
                index = self._next_batch
            upcoming = [(index, batch)] + self._registry[1 : 1 + self.ahead]
            # Each batch's tasks are made once, and before the registry moves on, so that a
            # refusal leaves it as it was.
            tasks = tuple((i, self._tasks_of(b)) for i, b in upcoming if i > self._tasked)
            if registered:
                self._registry.pop(0)
            else:
                self._next_batch += 1
            self._tasked = max(self._tasked, upcoming[-1][0])
        self._updates = updates
        pushed = core.push_due(self._served, updates, self.sync_every)
        if pushed:
            self._served = updates
        fields = dict(batch=index, updates=updates, served=self._served, pushed=pushed, tasks=tasks)
        return _HandOver(fields, variables if pushed else None)

    def _tasks_of(self, batch: Batch) -> tuple[Task, ...]:
        tasks = tuple(self.task_fn(batch))
        if not all(isinstance(t, Task) for t in tasks):
            raise ValueError("tasks must turn a batch into a sequence of dew.data.Task")
        if len(tasks) * self.config.samples > MAX_IN_FLIGHT:
            raise ValueError(
                f"tasks per batch must keep tasks x (groups + oversample) <= {MAX_IN_FLIGHT} "
                f"rollouts in flight, got {len(tasks)} x {self.config.samples}"
            )
        if self.admit is not None and self.admit > len(tasks):
            raise ValueError(
                f"admit must be within 1..{len(tasks)} (the task batch size), got {self.admit}"
            )
        return tasks

    def _finish(
        self, message: _Delivery | _Failure, variables: Variables, updates: int, waited: float
    ) -> dict[str, np.ndarray]:
        """Meet the pool, pack the delivered groups, rescore them, and record the call."""
        if isinstance(message, _Failure):
            self.last_record, self.last_events = None, message.events
            self._agree(message.error)
        self._agree(None)
        packed = pack(
            message.groups,
            width=self.width,
            rows=self.rows,
            estimator=self.estimator,
            truncation=self.truncation,
            support_capacity=self.support_capacity,
        )
        batch = first_reader_batch(packed.batch, share_size=self.pool.share_size)
        batch["proximal_logprobs"] = self.pool.rescore(self.objective, variables, batch)
        now = message.events[-1].time if message.events else 0.0
        cuts = tuple(
            LogEvent(
                "cut", now, group=group[0].label.group, task=group[0].task.name, reason=cut.reason
            )
            for cut in packed.cut
            for group in [message.groups[cut.group]]
        )
        events = message.events + cuts
        sessions = [s for i in packed.packed for s in message.groups[i]]
        versions = [v for s in sessions if (v := s.min_version) is not None]
        version = min(versions, default=self._served)
        resubmitted = {cause: 0 for cause in core.CAUSES}
        for e in events:
            if e.kind == "submitted" and e.reason is not None:
                resubmitted[e.reason] += 1
        record = SchedulerRecord(
            updates=updates,
            version=version,
            lag=updates - version,
            groups=len(packed.packed),
            resubmitted=resubmitted,
            cancelled=sum(
                e.kind == "cancelled" and e.reason in ("surplus", "stale", "abandoned")
                for e in events
            ),
            abandoned=sum(e.kind == "abandoned" for e in events),
            cut=len(packed.cut),
            waited=float(waited),
            metrics=session_metrics(sessions, packed, version=updates),
        )
        self.last_record, self.last_events = record, events
        if self.log is not None:
            self.log(record)
        self._report_too_long(message.groups, packed.cut)
        self._report_empty(record, events)
        return batch

    def _report_too_long(self, groups, cuts) -> None:
        """Log a warning, once per scheduler, of the first chain longer than a row: its group
        can never be packed, nor can any like it, so `width` is likely too small for the task."""
        if self._reported_too_long:
            return
        for cut in cuts:
            if cut.reason != "too_long":
                continue
            longest, session = max(
                ((len(chain), s) for s in groups[cut.group] for chain in chains(s)),
                key=lambda found: found[0],
            )
            self._reported_too_long = True
            logger.warning(
                "task %r %s: a chain of %d tokens is longer than a row (width %d), so its group "
                "is cut; raise width, or bound the task's length",
                session.task.name,
                session.label,
                longest,
                self.width,
            )
            return

    def _report_empty(self, record: SchedulerRecord, events: tuple[LogEvent, ...]) -> None:
        """Log a warning once per streak of `empty_streak` calls in a row that trained on no
        group, with what happened to their groups and the errors most often behind it."""
        if self.empty_streak is None:
            return
        if record.groups:
            self._empty.clear()
            return
        if len(self._empty) == self.empty_streak:
            return  # this streak was reported
        self._empty.append((record, events))
        if len(self._empty) < self.empty_streak:
            return
        records = [r for r, _ in self._empty]
        resubmitted = collections.Counter()
        for r in records:
            resubmitted.update(r.resubmitted)
        logged = [e for _, log in self._empty for e in log]
        cuts = collections.Counter(e.reason for e in logged if e.kind == "cut")
        errors = collections.Counter(
            e.error for e in logged if e.kind == "failed" and e.error is not None
        )
        counted = ", ".join(f"{cause} {n}" for cause, n in resubmitted.items() if n) or "none"
        text = (
            f"{len(records)} calls in a row trained on nothing (updates {records[0].updates}.."
            f"{records[-1].updates}): cut {sum(cuts.values())}"
            + "".join(f" ({reason} {n})" for reason, n in sorted(cuts.items()))
            + f", abandoned {sum(r.abandoned for r in records)}, resubmitted: {counted}"
        )
        if errors:
            text += "; most frequent errors: " + ", ".join(
                f"{error!r} x{n}" for error, n in errors.most_common(3)
            )
        logger.warning(text)

    def status(self) -> SchedulerStatus:
        """Which groups are in play, which batch the trainer waits on, how old each rollout is
        and what it is doing, and the most frequent errors of failed sessions."""
        state = self._state
        now = self._now()
        return SchedulerStatus(
            time=now,
            waiting=state.waiting,
            updates=state.updates,
            served=state.served,
            groups=tuple(
                GroupStatus(
                    g.id,
                    g.task.name,
                    g.batch,
                    g.state.value,
                    tuple(
                        SampleStatus(
                            s.index, s.attempt, s.failures, s.state.value, now - s.submitted
                        )
                        for s in g.samples
                    ),
                )
                for g in state.groups.values()
            ),
            # A copy first: another thread's status() must not iterate the live counter.
            errors=tuple(collections.Counter(dict(self._errors)).most_common(ERRORS_SHOWN)),
        )

    # --- running the trio side ----------------------------------------------------------------

    async def __aenter__(self) -> _Scheduler:
        if self._mode is not None:
            raise RuntimeError("the scheduler is already running")
        self._mode = "async"
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self._running())
        self._exit_stack = stack
        return self

    async def __aexit__(self, *exc_info) -> bool | None:
        stack, self._exit_stack = self._exit_stack, None
        return await exit_unwrapped(stack, *exc_info)

    @contextlib.asynccontextmanager
    async def _running(self):
        """The trio side in the current run, beside the caller's block, which close() leaves
        running."""
        if self._closed:
            raise RuntimeError("the scheduler is closed")
        async with trio.open_nursery() as nursery:
            self._nursery = await nursery.start(self._serve)
            try:
                yield
            finally:
                self.close()

    async def _serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The scheduler's own tasks: the driver, the deadline watch, and one nursery per task
        batch, in a nursery of their own that close() cancels."""
        self._trio_thread = threading.get_ident()
        self._token = trio.lowlevel.current_trio_token()
        self._clock = trio.lowlevel.current_clock()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._drive)
            if self.timeout is not None:
                nursery.start_soon(self._watch_deadlines)
            task_status.started(nursery)

    def close(self) -> None:
        """Cancel every rollout in flight; the source belongs to the caller."""
        if self._closed:
            return
        self._closed = True
        if self._trio_thread == threading.get_ident():
            self._close_in_trio()
        elif self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._close_in_trio, trio_token=self._token)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def dropped(self) -> None:
        """Close a scheduler whose `RolloutScheduler` was collected unclosed, and warn as an
        unclosed file does: its thread and rollouts would otherwise run until the process ends.
        Collection may run on the trio thread itself, mid-step: there the close is posted to
        run after the step."""
        if self._closed or self._thread is None:
            return  # closed, or its trio side never started: it holds nothing
        warnings.warn(
            f"a RolloutScheduler was dropped unclosed with {len(self._scopes)} rollouts in "
            "flight; they are cancelled and its thread ends (call close(), or use `with`)",
            ResourceWarning,
            stacklevel=2,
        )
        if self._trio_thread == threading.get_ident():
            self._token.run_sync_soon(self.close)
        else:
            self.close()

    def _close_in_trio(self) -> None:
        self._apply([core.Closed(trio.current_time())])
        self.closing_events, self._events = tuple(self._events), []
        self._fail_trainer(RuntimeError("the scheduler was closed while the trainer waited"))
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel(reason="closed")

    def _start_thread(self) -> None:
        if self._thread is not None:
            return
        self._mode = "thread"
        ready = threading.Event()

        async def serve():
            async with trio.open_nursery() as nursery:
                self._nursery = await nursery.start(self._serve)
                ready.set()

        def main():
            try:
                trio.run(serve)
            except BaseException as error:  # kept for the trainer, which is told the thread died
                self._crash = error
                ready.set()

        self._thread = threading.Thread(target=main, name="dew-scheduler", daemon=True)
        self._thread.start()
        ready.wait()
        if self._crash is not None:
            raise RuntimeError("the scheduler's trio thread failed to start") from self._crash

    def _now(self) -> float:
        """The scheduler's clock, from any thread; NaN while no trio side runs.

        Read off the run's clock object rather than through the run, so that status() answers
        even while a source blocks the trio thread (the stuck environment it is there to show).
        """
        if self._clock is None or self._closed:
            return float("nan")
        return self._clock.current_time()

    def _post_anywhere(self, make_event: Callable[[], core.Event]) -> None:
        """Post an event from any thread to a running trio side; nothing if none runs."""
        if self._token is None or self._closed:
            return
        if self._trio_thread == threading.get_ident():
            self._post(make_event())
            return
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(lambda: self._post(make_event()), trio_token=self._token)

    def _post(self, event: core.Event) -> None:
        self._pending.append(event)
        self._wake.set()

    def _settled(self) -> bool:
        """Whether the driver has applied everything posted: with every task waiting, the
        instant is over (replay's clock keeper moves the clock only then)."""
        return not self._pending

    def _hand_over(self, handover: _HandOver) -> None:
        """Push the weights when due, then post the hand-over. The push lands at the trainer's
        call, before its instant settles: an engine that starts the calls arriving at an
        instant once it has settled (as the simulated one does) starts them all under the new
        version, whatever order trio runs the instant's tasks in."""
        now = trio.current_time()
        if handover.event_fields["pushed"]:
            self.weights.load(handover.variables, handover.event_fields["served"])
            # The newest ever: a resumed trainer pushes an older version again, while rollouts
            # of the old stream may still finish with the newer one before their cancel.
            served = handover.event_fields["served"]
            self._newest_pushed = max(served, self._newest_pushed or served)
        self._waiting = True
        self._post(core.HandedOver(time=now, **handover.event_fields))
        if self.long_wait is not None:
            self._watch = trio.CancelScope()
            self._nursery.start_soon(self._watch_wait, self._watch, self.long_wait)

    async def _watch_wait(self, scope: trio.CancelScope, long_wait: float) -> None:
        """Log what the trainer waits on when a wait grows long."""
        with scope:
            waited = 0.0
            while True:
                await trio.sleep(max(long_wait, waited))
                waited = max(long_wait, 2 * waited)
                logger.warning("the trainer has waited %.0fs\n%s", waited, self.status())

    async def _watch_deadlines(self) -> None:
        """Post a rollout's timeout at its deadline. Deadlines are submission + timeout, so they
        come due in submission order and a queue is enough; the core ignores those of rollouts
        that already ended."""
        while True:
            if not self._deadlines:
                self._deadline_added = trio.Event()
                await self._deadline_added.wait()
            deadline, label = self._deadlines[0]
            await trio.sleep_until(deadline)
            self._deadlines.popleft()
            self._post(core.TimedOut(deadline, label))

    async def _drive(self) -> None:
        """Apply each instant's happenings in their documented order, then carry out the
        commands."""
        while True:
            await self._wake.wait()
            await trio.testing.wait_all_tasks_blocked()
            events = [event for _, event in sorted(enumerate(self._pending), key=_event_order)]
            self._pending = []
            self._wake = trio.Event()
            for event in events:
                if isinstance(event, core.HandedOver):
                    for batch, _ in event.tasks:
                        if batch > self._state.last_submitted and batch not in self._batches:
                            self._batches[batch] = await self._nursery.start(self._run_batch, batch)
            self._apply(events)

    def _apply(self, events: list[core.Event]) -> None:
        self._state, commands = core.run(self._state, events)
        for command in commands:
            self._carry_out(command)
        for batch, (_, done) in list(self._batches.items()):
            if batch not in self._state.batches:
                done.set()

    def _carry_out(self, command: core.Command) -> None:
        if isinstance(command, LogEvent):
            self._events.append(command)
            if command.error is not None:
                self._count_error(command.error)
        elif isinstance(command, core.Submit):
            scope = trio.CancelScope()
            self._scopes[command.label] = scope
            nursery, _ = self._batches[command.batch]
            nursery.start_soon(self._rollout, scope, command)
            if self.timeout is not None:
                self._deadlines.append((command.time + self.timeout, command.label))
                self._deadline_added.set()
        elif isinstance(command, core.Cancel):
            scope = self._scopes.get(command.label)
            if scope is not None:
                scope.cancel(reason=command.reason)
        elif isinstance(command, core.Deliver):
            events, self._events = tuple(self._events), []
            self._deliver(_Delivery(command.groups, events))
        elif isinstance(command, core.Fail):
            if self._failure is not None:
                logger.error("a failure after the one the trainer gets", exc_info=command.error)
                return
            self._failure = command
            if command.batch is None:
                self._fail(command.error)

    def _count_error(self, error: str) -> None:
        """Count an error text for status(); past ERRORS_KEPT distinct texts (a source whose
        messages carry ids), the rarer half is forgotten, so the count stays bounded."""
        self._errors[error] += 1
        if len(self._errors) > ERRORS_KEPT:
            self._errors = collections.Counter(dict(self._errors.most_common(ERRORS_KEPT // 2)))

    def _deliver(self, message: _Delivery | _Failure) -> None:
        self._waiting = False
        if self._watch is not None:
            self._watch.cancel(reason="delivered")
            self._watch = None
        self._send.send_nowait(message)

    def _fail(self, error: BaseException) -> None:
        """Hand the trainer a failure, with the event log so far."""
        events, self._events = tuple(self._events), []
        self._deliver(_Failure(error, events))

    def _fail_trainer(self, error: BaseException) -> None:
        if self._waiting:
            self._fail(error)

    async def _run_batch(self, batch: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """One task batch's nursery: its rollouts run inside, each in its own cancel scope."""
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            task_status.started((nursery, done))
            await done.wait()
        del self._batches[batch]
        if self._failure is not None and self._failure.batch == batch:
            self._fail(self._failure.error)

    async def _rollout(self, scope: trio.CancelScope, submission: core.Submit) -> None:
        task, label, submitted = submission.task, submission.label, submission.time
        try:
            with scope:
                try:
                    session = await self.source.run(task, label)
                except Exception as error:
                    self._post(core.SourceFailed(trio.current_time(), label, error))
                    return
            if scope.cancelled_caught:
                return
            now = trio.current_time()
            if isinstance(session, Session):
                session = session.stamped(task, label, submitted, now)
            try:
                check_session(session, vocab=self.vocab)
                self._check_versions(session, submission)
                if self.support_capacity is None and any(c.support for c in session.calls):
                    raise SessionError(
                        f"task {task.name!r} {label}: calls carry support (a filtered sampler); "
                        "the scheduler needs support_capacity to train on it"
                    )
            except SessionError as error:
                self._post(core.SourceFailed(now, label, error))
                return
            self._post(core.Finished(now, label, session))
        finally:
            del self._scopes[label]

    def _check_versions(self, session: Session, submission: core.Submit) -> None:
        """Refuse calls outside the versions served while the rollout ran: one older than its
        submission's, or one newer than any pushed (its lag would come out negative).

        Raises:
            SessionError: naming task, label and the version.
        """
        if not session.calls:
            return
        where = f"task {submission.task.name!r} {submission.label}"
        oldest = session.min_version
        if oldest < submission.version:
            raise SessionError(
                f"{where}: a call reports version {oldest}, older than the version "
                f"{submission.version} served when it was submitted (does the engine ignore load?)"
            )
        newest = max(call.version for call in session.calls)
        if self._newest_pushed is not None and newest > self._newest_pushed:
            raise SessionError(
                f"{where}: a call reports version {newest}, newer than the newest version "
                f"{self._newest_pushed} pushed (does the engine number versions itself?)"
            )


class RolloutScheduler:
    """Train on complete rollout groups from source, ahead task batches early.

    The trainer's Rollout, twice: `scheduler(batch, variables, updates)` from the trainer's
    thread (the trio machinery then runs in a background thread the scheduler owns), or
    `await scheduler.step(batch, variables, updates)` inside `async with scheduler:` in the
    caller's own trio run (what tests and notebooks drive under a mock clock; packing and
    rescoring then run inline in that run).

    Ties are broken by one documented key, so that a run is a function of its seed, its
    source's behaviour and trio's clock: at one instant, rollouts' finishes apply by (group,
    sample, attempt), then their deadlines, then the trainer's hand-over, reopen or close; a
    batch's groups are admitted, and packed, in order of (completion time, group id), and
    `oversample` and `admit` keep the first to complete in that order. A weight push lands at
    the trainer's call, before anything else of its instant.

    A call that fails (a broken source, a refused batch, a failed push, another process's
    failure met at the pool's agreement point) stops the scheduler: later calls raise,
    naming it.

    close() it, or use it in `with`/`async with`: a scheduler dropped unclosed is closed when
    it is collected (its thread ends, its rollouts are cancelled) with a ResourceWarning, as an
    unclosed file is; its trio thread holds only its workings (`_Scheduler`), never it.

    Args:
        objective: rescores the packed rows under the trainer's weights (proximal policy).
        source: runs one rollout of a task.
        weights: where pushed weights go.
        width, rows: the packed batch's shape, rows for this process's share.
        tasks: turns one registered batch into its tasks.
        groups: rollouts per task that train together.
        oversample: extra rollouts per group; the first `groups` to finish are admitted.
        admit: admit the first `admit` groups of a batch to complete, cancel the others.
        max_lag: the most updates a rollout's oldest call may be behind at consumption.
        ahead: batches submitted before the trainer hands them over.
        sync_every: push weights when the served version falls this many updates behind.
        max_attempts: failures per sample before its group is abandoned.
        timeout: each rollout's deadline in seconds from its submission.
        estimator, truncation, support_capacity: pack's advantage family, truncation policy and
            per-row support length.
        log: receives a SchedulerRecord per call.
        vocab: the model's vocabulary size. The scheduler cannot read it off the objective (whose
            model is any callable), so the caller says it: a session holding a token id at or
            above it is refused as broken (`SessionError`, naming task, label and field) rather
            than rescored into NaN log-probs. None checks only that ids are not negative.
        empty_streak: after this many consecutive calls that train on no group (every group
            cut, abandoned or failed), log a warning that gives the streak's counts and most
            frequent errors, once per streak; None never warns. A healthy run rarely
            has even one such call, and 5 wastes few steps before saying so.

    Limits: width <= MAX_WIDTH, rows * width <= MAX_CELLS, groups <= rows * width (a larger
    group could never be packed), groups + oversample <= MAX_SAMPLES, rows * support_capacity
    <= MAX_CELLS, and at each call a task batch of at most MAX_IN_FLIGHT rollouts.

    Raises:
        ValueError: naming the argument and the bound it broke.
        TypeError: naming a collaborator (objective, source, weights, tasks, log) that lacks
            what it needs.
    """

    def __init__(
        self,
        objective: GRPOObjective,
        source: SessionSource,
        weights: Publisher,
        *,
        width: int,
        rows: int,
        tasks: Callable[[Batch], Sequence[Task]] = task_ids,
        groups: int = 4,
        oversample: int = 0,
        admit: int | None = None,
        max_lag: int = 1,
        ahead: int = 1,
        sync_every: int = 1,
        max_attempts: int = 3,
        timeout: float | None = None,
        estimator: str = "group",
        truncation: str = "mask",
        support_capacity: int | None = None,
        log: Callable[[SchedulerRecord], None] | None = None,
        vocab: int | None = None,
        empty_streak: int | None = 5,
    ):
        inner = _Scheduler(
            objective,
            source,
            weights,
            width=width,
            rows=rows,
            tasks=tasks,
            groups=groups,
            oversample=oversample,
            admit=admit,
            max_lag=max_lag,
            ahead=ahead,
            sync_every=sync_every,
            max_attempts=max_attempts,
            timeout=timeout,
            estimator=estimator,
            truncation=truncation,
            support_capacity=support_capacity,
            log=log,
            vocab=vocab,
            empty_streak=empty_streak,
        )
        object.__setattr__(self, "_inner", inner)
        finalizer = weakref.finalize(self, inner.dropped)
        # At interpreter exit the process frees the thread; joining it could wait on a stuck
        # environment step.
        finalizer.atexit = False
        object.__setattr__(self, "_finalizer", finalizer)

    # Everything else (records, events, settings such as long_wait) lives on the workings.
    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._inner, name, value)

    def tasks(self, dataset: Dataset) -> Dataset:
        """dataset with a training stream that registers each task batch ahead of the step.

        Opening the stream again, as a resume does, cancels every rollout the previous stream
        left in flight.
        """
        return self._inner.tasks(dataset)

    def __call__(self, batch: Batch, variables: Variables, updates: int) -> dict[str, np.ndarray]:
        """Hand batch over from the trainer's thread; return its packed, rescored rows."""
        return self._inner(batch, variables, updates)

    async def step(self, batch: Batch, variables: Variables, updates: int) -> dict[str, np.ndarray]:
        """The same call as `scheduler(batch, variables, updates)`, inside `async with`."""
        return await self._inner.step(batch, variables, updates)

    def status(self) -> SchedulerStatus:
        """Which groups are in play, which batch the trainer waits on, how old each rollout is
        and what it is doing, and the most frequent errors of failed sessions."""
        return self._inner.status()

    def close(self) -> None:
        """Cancel every rollout in flight; the source belongs to the caller."""
        self._finalizer.detach()
        self._inner.close()

    def __enter__(self) -> RolloutScheduler:
        """`with scheduler:` around the synchronous facade's calls closes it at the block's
        end: its trio thread runs until close(), holding the source and what is in flight."""
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    async def __aenter__(self) -> RolloutScheduler:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info) -> bool | None:
        self._finalizer.detach()  # the block's end closes the workings
        return await self._inner.__aexit__(*exc_info)


@attrs.frozen
class _RegisteringDataset:
    """A dataset whose training stream registers each batch with the scheduler as it is read."""

    scheduler: RolloutScheduler
    dataset: Dataset

    def stream(self, start: int = 0) -> Iterator[Batch]:
        generation = self.scheduler._open_stream()
        return self._registering(self.dataset.stream(start), generation)

    def _registering(self, batches: Iterator[Batch], generation: int) -> Iterator[Batch]:
        for batch in batches:
            self.scheduler._register(generation, batch)
            yield batch

    def __len__(self) -> int:
        return len(self.dataset)


def _same_batch(a: Batch, b: Batch) -> bool:
    if a is b:
        return True
    if set(a) != set(b):
        return False
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)
