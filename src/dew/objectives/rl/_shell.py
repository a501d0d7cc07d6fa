"""The scheduler's workings (`_Scheduler`): the trio shell around the pure admission core.

It turns happenings into the core's events and carries out the core's commands, with one cancel
scope per rollout inside one nursery per task batch, and serves the trainer's calls from its
thread or from the caller's own trio run. `RolloutScheduler` (in `scheduler`) is the front the
caller holds; this object is what its trio side holds, so a dropped front can be collected.

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
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

import attrs
import numpy as np
import trio
import trio.testing

from dew._checks import check_int
from dew._errors import ErrorCounts
from dew._trio import exit_unwrapped, stop_in
from dew.data import Batch, Dataset, Task
from dew.objectives.rl import _admission as core
from dew.objectives.rl._admission import LogEvent
from dew.objectives.rl._arguments import (
    MAX_IN_FLIGHT,
    check_arguments,
    check_carry_over,
    check_filtering,
    check_hedge,
    check_waste_budget,
    resolve_vocab,
)
from dew.objectives.rl._packing import _percentile, pack_narrow, uniform_group
from dew.objectives.rl._records import (
    GroupStatus,
    Publisher,
    SampleStatus,
    SchedulerRecord,
    SchedulerStatus,
    Variables,
)
from dew.objectives.rl._reports import EmptyStreak, NoRoom, OverBudget, TooLongChain
from dew.objectives.rl._session import Progress, track_progress, waits
from dew.objectives.rl.grpo import GRPOObjective, mismatch_metrics
from dew.objectives.rl.sessions import (
    Label,
    Packed,
    Session,
    SessionError,
    SessionSource,
    check_session,
    pack,
    session_metrics,
)
from dew.parallel import LocalPool, Pool, default_pool, first_reader_batch

# Logged under the public module's name, where a user configures the scheduler's logging.
logger = logging.getLogger("dew.objectives.rl.scheduler")


@attrs.frozen
class _HandOver:
    """What the trainer side prepared for one call."""

    event_fields: dict
    variables: Variables = attrs.field(eq=False)


@attrs.frozen
class _Delivery:
    groups: tuple[tuple[Session, ...], ...]
    events: tuple[LogEvent, ...]
    uniform: int = 0  # the batch's groups discarded as uniform
    # (tokens, calls, seconds) of every submission the batch started: finished ones exactly,
    # cancelled ones as far as they got (lower bounds).
    started: tuple[tuple[float, float, float], ...] = ()
    carried: tuple[int, ...] = ()  # under carry_over: the age in calls of each carried group
    in_play: int = 0  # carried groups still in play after the delivery
    choice: core.Choice | None = None  # under admit="auto": the call's cut and its estimate


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


# What a closed scheduler answers a call, a stream or a block; a call that waited when close()
# came says so after it.
CLOSED = "the scheduler is closed"
CLOSED_WAITING = f"{CLOSED}: close() came while the trainer waited"

# Distinct error texts status() counts, and how many of the most frequent it shows.
ERRORS_KEPT = 64
ERRORS_SHOWN = 5


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
        filter_uniform: bool = False,
        reference: Variables | None = None,
        carry_over: bool = False,
        waste_budget: float = 0.2,
        hedge: bool = True,
        narrow: bool = False,
    ):
        if not isinstance(narrow, bool):
            raise ValueError(f"narrow must be a bool, got {narrow!r}")
        check_carry_over(carry_over, admit)
        check_waste_budget(waste_budget)
        check_hedge(hedge)
        check_arguments(
            objective,
            source,
            weights,
            tasks,
            log,
            width=width,
            rows=rows,
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
            vocab=vocab,
            empty_streak=empty_streak,
        )
        check_filtering(
            objective, groups=groups, filter_uniform=filter_uniform, reference=reference
        )
        if admit is not None and admit != "auto":
            admit = int(admit)  # a numpy integer, checked, is an int to every later check
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
        self.vocab = resolve_vocab(objective, vocab)
        self.empty_streak = empty_streak
        self.filter_uniform = filter_uniform
        # The frozen reference policy rescored over the rows beside the proximal one, for the
        # objective's KL term.
        self.reference = reference
        self.config = core.Config(
            groups=groups,
            oversample=oversample,
            admit=admit,
            max_lag=max_lag,
            max_attempts=max_attempts,
            truncation=truncation,
            filter_uniform=filter_uniform,
            carry_over=carry_over,
            waste_budget=float(waste_budget),
            hedge=hedge,
        )
        # While the trainer waits, what it waits on is logged after this many seconds, then
        # after twice as many, and so on; None logs nothing (simulations that wait by design).
        self.long_wait: float | None = 60.0
        # Where this process meets the others of a multi-process trainer, twice a call; its
        # share_size says how many consecutive processes read one data share (a tensor or
        # sequence axis across processes): only a share's first reader samples, the others
        # train on its rows.
        self.pool: Pool = default_pool()
        # A pool's processes must agree on one shape (the rescoring and the step span them).
        self.narrow = narrow and isinstance(self.pool, LocalPool)
        self.last_record: SchedulerRecord | None = None
        self.last_events: tuple[LogEvent, ...] = ()
        # The newest push this process made: (version, wall seconds it took, bytes of tensors
        # the engine's servers read, None for an engine that reads none), None before the
        # first. The trainer's metrics lines show it (`push/version`, `push/seconds`,
        # `push/bytes`); not part of the record, so that replay, which pushes to no server,
        # compares none.
        self.last_push: tuple[int, float, int | None] | None = None
        # The rest of the event log at close(): what came after the last call's delivery, and
        # the `closed` cancellations that end every submission still in flight.
        self.closing_events: tuple[LogEvent, ...] = ()

        self._state = core.initial(self.config)
        # The trainer's side: what its stream registered, what it handed over, what it pushed.
        self._lock = threading.Lock()
        self._calling = threading.Lock()
        # Held while the trio thread starts and while close() marks the scheduler closed.
        self._life = threading.Lock()
        self._tasked = -1  # the newest batch whose tasks the trio side has
        self._registry: list[tuple[int, Batch]] = []
        # Under carry_over, for a checkpoint: each registered batch's stream position, the
        # newest batch handed over, each group's (position, index in its batch), and the
        # origins of a resumed run's carried groups in the order the core submits them.
        self._positions: dict[int, int] = {}
        self._handed = -1
        self._origins: dict[int, tuple[int, int] | None] = {}
        self._resuming: collections.deque[tuple[int, int]] = collections.deque()
        self._restored: tuple[tuple[int, int, int], ...] = ()
        self._resume: tuple[tuple[tuple[int, int], Task, int], ...] = ()
        self._next_batch = 0
        self._generation = 0
        self._updates: int | None = None
        self._served: int | None = None
        self._failed: BaseException | None = None
        self._closed = False  # set by close(), from any thread
        self._ended = False  # set by close() on the trio side, where the close is carried out
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
        # For the selection bias: each live submission's batch and submission time, its
        # progress, and per batch the lengths of the submissions it started that have ended.
        self._batch_of: dict[Label, tuple[int, float]] = {}
        self._progress: dict[Label, Progress] = {}
        self._started: dict[int, dict[Label, tuple[float, float, float]]] = {}
        self._deadlines: collections.deque[tuple[float, Label]] = collections.deque()
        self._deadline_added = trio.Event()
        self._batches: dict[int, tuple[trio.Nursery, trio.Event]] = {}
        # The first failure in the core's order goes to the trainer; the next is logged in one
        # line and the rest counted, said at close: an engine that dies fails every rollout in
        # flight at once, and each traceback would bury the one error that matters.
        self._failure: core.Fail | None = None
        self._later_failures = 0
        self._events: list[LogEvent] = []
        self._watch: trio.CancelScope | None = None
        self._training: trio.CancelScope | None = None  # watches the trainer keeping its batch
        self._waiting = False  # a hand-over waits for its delivery
        self._delivered = False  # whether any call was answered: the first waits on compiles
        self._newest_pushed: int | None = None  # the newest version ever pushed to the engines
        # Failed sessions' error texts and how often each came, for status().
        # Failed sessions' error texts, for status(); the trainer's side reports a streak of
        # calls that trained on nothing, groups cut for room, and the first chain too long for
        # any row.
        self._errors = ErrorCounts(ERRORS_KEPT)
        self._empty = EmptyStreak(empty_streak, truncation)
        self._too_long = TooLongChain(width)
        self._no_room = NoRoom(rows, width)
        self._over_budget = OverBudget(float(waste_budget), max_lag)
        self._send, self._receive = trio.open_memory_channel[_Delivery | _Failure](math.inf)

    # --- the data stream ----------------------------------------------------------------------

    def tasks(self, dataset: Dataset) -> Dataset:
        """dataset with a training stream that registers each task batch ahead of the step.

        Opening the stream again, as a resume does, cancels every rollout the previous stream
        left in flight.
        """
        return _RegisteringDataset(self, dataset)

    def _open_stream(self) -> int:
        self.check_open()
        with self._lock:
            self._generation += 1
            self._registry.clear()
            generation = self._generation
            # A resumed trainer may go back in updates, and its restored weights must be pushed.
            self._updates = self._served = None
        self._post_anywhere(lambda: core.Reopened(trio.current_time()))
        return generation

    def _register(self, generation: int, batch: Batch, position: int) -> None:
        with self._lock:
            if generation == self._generation:
                self._positions[self._next_batch] = position
                self._registry.append((self._next_batch, batch))
                self._next_batch += 1

    # --- checkpoints under carry_over ---------------------------------------------------------

    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps for this scheduler: the carried groups of the batches handed
        over so far, as [stream position, index in its batch] of each one's task (the batches
        not yet handed over are read again by the resumed stream), and the stale cycles each
        has run (see HOLD_AFTER in the admission core), which a resumed run counts on from: a
        task that always outlives the window is held as soon as it would have been."""
        state = self._state
        carried, stale = [], []
        for group_id in state.carried:
            group = state.groups.get(group_id)
            origin = self._origins.get(group_id)
            if group is not None and origin is not None and group.batch <= self._handed:
                carried.append(list(origin))
                stale.append(group.stale)
        return {"carried": carried, "stale": stale}

    def restore_state(self, state: dict) -> None:
        """Take a checkpoint's `checkpoint_state`: the next stream opened resubmits its carried
        groups' tasks, read again from the dataset at their positions, each counting on from
        its stale cycles. A state without "stale" (a checkpoint written before they were kept)
        counts from 0.

        Raises:
            ValueError: when state is not what checkpoint_state writes.
        """
        carried = state.get("carried") if isinstance(state, dict) else None
        stale = state.get("stale", [0] * len(carried)) if isinstance(carried, list) else None
        if (
            not isinstance(carried, list)
            or not all(
                isinstance(c, list | tuple) and len(c) == 2 and all(type(x) is int for x in c)
                for c in carried
            )
            or not isinstance(stale, list)
            or len(stale) != len(carried)
            or not all(type(n) is int and n >= 0 for n in stale)
        ):
            raise ValueError(
                "a scheduler's checkpoint state must be {'carried': [[position, index], ...], "
                f"'stale': [count >= 0 for each carried group]}}, got {state!r}"
            )
        self._restored = tuple(
            (int(p), int(i), int(n)) for (p, i), n in zip(carried, stale, strict=True)
        )

    def _resolve_restored(self, dataset: Dataset) -> None:
        """Read the restored carried groups' tasks again: each one's batch from the dataset at
        its position, its task by index."""
        restored, self._restored = self._restored, ()
        resume = []
        for position, index, stale in restored:
            batch = next(iter(dataset.stream(position)), None)
            tasks = () if batch is None else self._tasks_of(batch)
            if not 0 <= index < len(tasks):
                raise ValueError(
                    f"the checkpoint carries task {index} of the batch at position {position}, "
                    f"which the dataset does not have (a different dataset?)"
                )
            resume.append(((position, index), tasks[index], stale))
        with self._lock:
            self._resume = tuple(resume)

    def _resumed(self) -> tuple[tuple[tuple[int, int], Task, int], ...]:
        """The restored carried groups the next hand-over submits again, each as ((stream
        position, index in its batch), task, stale cycles): `restore_state`'s, their tasks read
        when the stream opened. A replay recorder writes them into its trace."""
        with self._lock:
            return self._resume

    def _resume_groups(self, groups: Sequence[tuple[tuple[int, int], Task, int]]) -> None:
        """Submit `groups` (as `_resumed` gives them) again at the next hand-over, their tasks
        as given rather than read from a dataset: a replay's, whose trace holds the tasks and
        no dataset. Call it after opening the stream, which replaces them with
        `restore_state`'s."""
        with self._lock:
            self._resume = tuple(groups)

    # --- the trainer's side -------------------------------------------------------------------

    def __call__(self, batch: Batch, variables: Variables, updates: int) -> dict[str, np.ndarray]:
        """Hand batch over from the trainer's thread; return its packed, rescored rows."""
        self.check_open()
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
            # One trip into the trio thread hands over and waits: each trip costs a wake-up of
            # that thread and a hand-back of the GIL.
            message = trio.from_thread.run(
                self._hand_over_and_wait, handover, trio_token=self._token
            )
        except (trio.RunFinishedError, trio.Cancelled) as stopped:
            message = self._left_behind()
            if message is None and (stop := stop_in(self._crash)) is not None:
                # A KeyboardInterrupt or SystemExit inside a source stops the program, as itself.
                self._failed = stop
                raise stop from None
            if message is None and self._closed:
                # close() from another thread ended the run before this call's trip reached it.
                message = _Failure(RuntimeError(CLOSED_WAITING))
            if message is None:
                error = RuntimeError("the scheduler's trio thread stopped")
                error.__cause__ = self._crash or stopped
                message = _Failure(error)
        except Exception as error:
            message = _Failure(error)
        return self._finish(message, variables, updates, time.perf_counter() - start)

    async def step(self, batch: Batch, variables: Variables, updates: int) -> dict[str, np.ndarray]:
        """The same call as `scheduler(batch, variables, updates)`, inside `async with`."""
        self.check_open()
        if self._mode != "async" or self._trio_thread != threading.get_ident():
            raise RuntimeError("`await scheduler.step(...)` runs inside `async with scheduler:`")
        with self._one_call():
            return await self._step(batch, variables, updates)

    async def _step(
        self, batch: Batch, variables: Variables, updates: int
    ) -> dict[str, np.ndarray]:
        self._check_usable()
        if not self.pool.is_first_reader():
            return await self._read_share_async(variables, updates)
        start = trio.current_time()
        try:
            await self._hand_over(self._prepare(batch, variables, updates))
        except trio.Cancelled:
            # An async push cut short: what the engines serve is unknown.
            self._failed = RuntimeError(
                f"the call at updates {updates} was cancelled while it pushed its weights"
            )
            raise
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

    async def _hand_over_and_wait(self, handover: _HandOver) -> _Delivery | _Failure:
        # close() from another thread sets the flag before it posts the close here, so a flag
        # still down means the scheduler's nursery is still open for the hand-over's tasks,
        # and the close, when it comes, answers the wait.
        if self._closed:
            return _Failure(RuntimeError(CLOSED))
        await self._hand_over(handover)
        return await self._receive.receive()

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

    def check_open(self) -> None:
        """Refuse to use a closed scheduler: a call, a stream, a `with` or `async with` block.

        Raises:
            RuntimeError: `the scheduler is closed`.
        """
        if self._closed:
            raise RuntimeError(CLOSED)

    def _check_usable(self) -> None:
        """Refuse a call to a closed or stopped scheduler, before it meets the pool: a failure
        met at the agreement point stopped every process's scheduler alike."""
        self.check_open()
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
        where the first reader does (the push, the agreement, the rows, the rescoring). From
        the trainer's thread: its push blocks that thread alone."""
        error = None
        try:
            updates = self._updates = self._check_updates(updates)
            if core.push_due(self._served, updates, self.sync_every):
                self.weights.load(variables, updates)
                self._served = updates
        except Exception as problem:
            error = problem
        self._agree(error)
        return self._pack_and_rescore([], variables)[1]

    async def _read_share_async(self, variables: Variables, updates: int) -> dict:
        """`_read_share` inside the caller's trio run, whose push the run awaits."""
        error = None
        try:
            updates = self._updates = self._check_updates(updates)
            if core.push_due(self._served, updates, self.sync_every):
                await self._push(variables, updates)
                self._served = updates
        except Exception as problem:
            error = problem
        self._agree(error)
        return self._pack_and_rescore([], variables)[1]

    def _pack_and_rescore(self, groups, variables: Variables) -> tuple[Packed, dict]:
        """Pack `groups` into this process's rows, take the share's first reader's rows, and
        rescore them under `variables` over the pool; return the packing and the batch."""
        packed = (pack_narrow if self.narrow else pack)(
            groups,
            width=self.width,
            rows=self.rows,
            estimator=self.estimator,
            truncation=self.truncation,
            support_capacity=self.support_capacity,
        )
        batch = first_reader_batch(packed.batch, share_size=self.pool.share_size)
        # An objective whose loss takes the proximal log-probs from its own forward pass
        # (GRPOObjective(proximal="current")) needs no rescoring.
        if getattr(self.objective, "proximal", "rescore") != "current":
            batch["proximal_logprobs"] = self.pool.rescore(self.objective, variables, batch)
        if self.reference is not None:
            # A callable reference moves (`dew train --ref-sync-every`): read as of this batch.
            reference = self.reference() if callable(self.reference) else self.reference
            batch["reference_logprobs"] = self.pool.rescore(self.objective, reference, batch)
        return packed, batch

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
            tasks = tuple((i, self._tasks_at(i, b)) for i, b in upcoming if i > self._tasked)
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
        with self._lock:
            self._handed = max(self._handed, index)
            if self._resume:
                fields["carried"] = tuple(task for _, task, _ in self._resume)
                fields["stale"] = tuple(stale for _, _, stale in self._resume)
                self._resuming.extend(origin for origin, _, _ in self._resume)
                self._resume = ()
        return _HandOver(fields, variables if pushed else None)

    def _tasks_at(self, index: int, batch: Batch) -> tuple[Task, ...]:
        """`_tasks_of` the registered batch `index`; a refusal names its stream position, since
        a batch submitted ahead is refused at the call of an earlier one."""
        try:
            return self._tasks_of(batch)
        except ValueError as error:
            position = self._positions.get(index)
            if position is None:
                raise
            raise ValueError(
                f"the batch at position {position} of the tasks() stream: {error}"
            ) from error

    def _tasks_of(self, batch: Batch) -> tuple[Task, ...]:
        made = self.task_fn(batch)
        if not isinstance(made, Iterable) or isinstance(made, str | bytes):
            raise ValueError(
                f"tasks must turn a batch into a sequence of dew.data.Task, got {made!r:.80}"
            )
        tasks = tuple(made)
        for task in tasks:
            if not isinstance(task, Task):
                raise ValueError(
                    "tasks must turn a batch into a sequence of dew.data.Task, got an element "
                    f"{task!r:.80} ({type(task).__name__})"
                )
        if len(tasks) * self.config.samples > MAX_IN_FLIGHT:
            raise ValueError(
                f"tasks per batch must keep tasks x (groups + oversample) <= {MAX_IN_FLIGHT} "
                f"rollouts in flight, got {len(tasks)} x {self.config.samples}"
            )
        if isinstance(self.admit, int) and self.admit > len(tasks):
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
        packed, batch = self._pack_and_rescore(message.groups, variables)
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
            metrics=session_metrics(sessions, packed, version=updates)
            | self._step_metrics(message, packed, batch, updates),
        )
        self.last_record, self.last_events = record, events
        if self.log is not None:
            self.log(record)
        self._too_long.observe(message.groups, packed.cut)
        self._no_room.observe(message.groups, packed.cut)
        self._empty.observe(record, events)
        self._over_budget.observe(record)
        return batch

    def _step_metrics(
        self, message: _Delivery, packed: Packed, batch: dict, updates: int
    ) -> dict[str, float]:
        """The record's figures beyond `session_metrics`: the batch's complete groups whose
        rewards were all equal (`groups/uniform`: discarded under filter_uniform, else trained
        or cut) and those of them trained on (`groups/uniform_trained`); the behaviour
        importance (`GRPOObjective.importance_metrics`) and the mismatch split by version,
        where the batch was rescored."""
        trained = [message.groups[i] for i in packed.packed]
        uniform_trained = sum(uniform_group(g, self.truncation) for g in trained)
        cut = [message.groups[c.group] for c in packed.cut]
        uniform_cut = sum(uniform_group(g, self.truncation) for g in cut)
        metrics = {}
        # Counted over the batch's complete groups: a batch that completed none leaves them out.
        if message.groups or message.uniform:
            metrics["groups/uniform"] = float(message.uniform + uniform_trained + uniform_cut)
            metrics["groups/uniform_trained"] = float(uniform_trained)
        admitted = [_length(s) for group in message.groups for s in group]
        metrics |= selection_bias(admitted, message.started)
        if self.config.carry_over:
            ages = message.carried
            metrics["carry/admitted"] = float(len(ages))
            metrics["carry/in_play"] = float(message.in_play)
            metrics["carry/held"] = float(sum(e.kind == "held" for e in message.events))
            metrics["carry/hedged"] = float(
                sum(
                    e.kind == "submitted"
                    and e.label.attempt == 0
                    and e.label.sample >= self.config.samples
                    for e in message.events
                )
            )
            if ages:
                metrics["carry/age_mean"] = float(np.mean(ages))
                metrics["carry/age_max"] = float(max(ages))
        if message.choice is not None:
            metrics |= message.choice.metrics()
        if "proximal_logprobs" not in batch:
            importance = {}  # the update reports what it can (GRPOObjective.loss)
        elif isinstance(self.objective, GRPOObjective):
            importance = self.objective.importance_metrics(batch, version=updates)
        else:
            importance = mismatch_metrics(batch, version=updates)
        # A record's figures are finite (see session_metrics): a log-prob that is not leaves
        # its figures out here, and the loss, NaN too, stops the trainer naming the step.
        return metrics | {k: v for k, v in importance.items() if math.isfinite(v)}

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
            errors=self._errors.most_common(ERRORS_SHOWN),
        )

    # --- running the trio side ----------------------------------------------------------------

    async def __aenter__(self) -> _Scheduler:
        self.check_open()
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
            self._nursery = nursery
            nursery.start_soon(self._drive)
            if self.timeout is not None:
                nursery.start_soon(self._watch_deadlines)
            task_status.started(nursery)
            # close() from another thread marks the scheduler closed, then posts its close
            # here if it finds the token set above: one that came before found none to post
            # to, so this side closes itself.
            if self._closed:
                self._close_in_trio()

    def close(self) -> None:
        """Cancel every rollout in flight; the source belongs to the caller.

        Safe at any instant of a call from another thread: the trio thread is either not
        started (and never will be) or started with its token (`_life`), and the call is
        answered `the scheduler is closed`, or returns what it was delivered.
        """
        with self._life:
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
        if self._ended:
            return  # closed here already, by the close() of another thread or by `_serve`
        self._ended = True
        if self._later_failures > 1:
            logger.error(
                "%d more failures after the one the trainer gets", self._later_failures - 1
            )
        self._apply([core.Closed(trio.current_time())])
        self.closing_events, self._events = tuple(self._events), []
        self._fail_trainer(RuntimeError(CLOSED_WAITING))
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel(reason="closed")

    def _start_thread(self) -> None:
        """Start the trio thread on the first call, and wait until it serves; under `_life`,
        so that a close() from another thread finds it either not started or serving."""
        with self._life:
            self.check_open()
            if self._thread is None:
                self._start_thread_now()

    def _start_thread_now(self) -> None:
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

    async def _hand_over(self, handover: _HandOver) -> None:
        """Push the weights when due, then post the hand-over. A synchronous push lands at the
        trainer's call, before its instant settles: an engine that starts the calls arriving at
        an instant once it has settled (as the simulated one does) starts them all under the
        new version, whatever order trio runs the instant's tasks in. An async push
        (`load_async`) lets the run go on meanwhile; the hand-over, and the submissions it
        makes, come after it, at the instant it ends."""
        if self._training is not None:
            self._training.cancel(reason="handed over")
            self._training = None
        now = trio.current_time()
        if handover.event_fields["pushed"]:
            if await self._push(handover.variables, handover.event_fields["served"]):
                now = trio.current_time()
            if self._ended:
                # close() came during the push: the batches' nurseries are going.
                raise RuntimeError(CLOSED_WAITING)
        self._waiting = True
        self._post(
            core.HandedOver(
                time=now,
                started=self._oldest_calls(now),
                slots=self._slot_starts(now),
                **handover.event_fields,
            )
        )
        if self.long_wait is not None:
            self._watch = trio.CancelScope()
            first = not self._delivered
            self._nursery.start_soon(self._watch_wait, self._watch, self.long_wait, first)

    def _oldest_calls(self, now: float) -> tuple[tuple[Label, int], ...]:
        """The running rollouts whose oldest call started before `now`, with its version (see
        note_progress). One whose call started at `now` itself counts from its submission, as
        before: trio may run that start before or after this hand-over, so only an earlier one
        is the same in every run and in its replay."""
        started = [
            (label, progress.oldest[1])
            for label, progress in self._progress.items()
            if progress.oldest is not None and progress.oldest[0] < now
        ]
        return tuple(sorted(started, key=lambda item: (item[0].group, item[0].sample)))

    def _slot_starts(self, now: float) -> tuple[tuple[Label, float], ...]:
        """The running rollouts whose oldest call started before `now`, with when it started:
        their start on an engine slot (see `_oldest_calls`, whose rollouts these are)."""
        started = [
            (label, progress.oldest[0])
            for label, progress in self._progress.items()
            if progress.oldest is not None and progress.oldest[0] < now
        ]
        return tuple(sorted(started, key=lambda item: (item[0].group, item[0].sample)))

    async def _push(self, variables: Variables, version: int) -> bool:
        """Serve `variables` under `version`: awaits the publisher's `load_async` where it has
        one, so that the rollouts in flight and the gateway go on during the push, else calls
        its `load`, which holds this run until it returns (and checkpoints nowhere). Returns
        whether the push was awaited."""
        # The newest ever, and set first: a rollout may finish under the new version before an
        # async push returns; a resumed trainer pushes an older version again, while rollouts
        # of the old stream may still finish with the newer one before their cancel.
        self._newest_pushed = max(version, self._newest_pushed or version)
        load_async = getattr(self.weights, "load_async", None)
        began = time.perf_counter()
        if load_async is None:
            self.weights.load(variables, version)
        else:
            await load_async(variables, version)
        pushed = getattr(self.weights, "push_bytes", None)
        self.last_push = (version, time.perf_counter() - began, pushed[-1] if pushed else None)
        return load_async is not None

    async def _watch_wait(self, scope: trio.CancelScope, long_wait: float, first: bool) -> None:
        """Log what the trainer waits on when a wait grows long, naming where its rollouts in
        flight are (the engine, the environment's step, the verifier: `waiting_on`): in full,
        but for the wait on the scheduler's first batch, which is said in one line, since it
        may hold the engine's first compilations (a minute or more on a small CPU)."""
        with scope:
            waited = 0.0
            while True:
                await trio.sleep(max(long_wait, waited))
                waited = max(long_wait, 2 * waited)
                where = waits(self._progress.values())
                if first:
                    # The engine compiles its steps on its first calls: a wait there is that.
                    compiles = "the engine" in where and "the engine compiles on its first calls; "
                    logger.warning(
                        "the trainer has waited %.0fs for its first batch (%s), its rollouts "
                        "in flight waiting: %s; %sstatus() says more",
                        waited,
                        self._first_wait_progress(),
                        where,
                        compiles or "",
                    )
                else:
                    logger.warning(
                        "the trainer has waited %.0fs, its rollouts in flight waiting: %s\n%s",
                        waited,
                        where,
                        self.status(),
                    )

    async def _watch_trainer(self, scope: trio.CancelScope, long_wait: float) -> None:
        """Log a trainer that keeps its batch long (from delivery to its next hand-over): the
        wait is then the trainer's step, not the engine's or the environment's."""
        with scope:
            waited = 0.0
            while True:
                await trio.sleep(max(long_wait, waited))
                waited = max(long_wait, 2 * waited)
                logger.warning(
                    "the trainer has spent %.0fs on the batch of updates %d since it was "
                    "delivered (its update, logs and checkpoint; the first update compiles): the "
                    "scheduler waits on the trainer, its rollouts in flight waiting: %s",
                    waited,
                    self._state.updates,
                    waits(self._progress.values()),
                )

    def _first_wait_progress(self) -> str:
        """How far the batch the trainer waits on has come: its rollouts finished of all."""
        status = self.status()
        samples = [s for g in status.groups if g.batch == status.waiting for s in g.samples]
        finished = sum(s.state == core.SampleState.FINISHED.value for s in samples)
        return f"{finished} of {len(samples)} rollouts finished"

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
            if self._ended:
                # close() came while a batch's nursery started: the batches' nurseries are
                # gone, so what these events would submit has nowhere to run.
                return
            self._apply(events)

    def _apply(self, events: list[core.Event]) -> None:
        for event in events:
            if isinstance(event, core.Finished) and event.label in self._batch_of:
                batch, _ = self._batch_of[event.label]
                self._started[batch][event.label] = _length(event.session)
        self._state, commands = core.run(self._state, events)
        for command in commands:
            self._carry_out(command)
        for batch, (_, done) in list(self._batches.items()):
            if batch not in self._state.batches:
                done.set()
        for batch in [b for b in self._started if b not in self._state.batches]:
            self._forget_lengths(batch)
        if self.config.carry_over:
            for group in [g for g in self._origins if g not in self._state.groups]:
                del self._origins[group]

    def _note_origin(self, submission: core.Submit) -> None:
        """Remember where a group's task came from, for a checkpoint of its carrying."""
        group = submission.label.group
        if group in self._origins:
            return
        ids = self._state.batches.get(submission.batch, ())
        if group in ids:
            position = self._positions.get(submission.batch)
            self._origins[group] = None if position is None else (position, ids.index(group))
        else:
            self._origins[group] = self._resuming.popleft() if self._resuming else None

    def _forget_lengths(self, batch: int) -> tuple[tuple[int, int], ...]:
        """Drop a batch that left the state from the length books; return its lengths."""
        lengths = self._started.pop(batch, {})
        for label in [x for x, (b, _) in self._batch_of.items() if b == batch]:
            del self._batch_of[label]
        return tuple(lengths.values())

    def _carry_out(self, command: core.Command) -> None:
        if isinstance(command, LogEvent):
            self._events.append(command)
            if command.error is not None:
                self._errors.add(command.error)
        elif isinstance(command, core.Submit):
            self._batch_of[command.label] = (command.batch, command.time)
            self._started.setdefault(command.batch, {})
            scope = trio.CancelScope()
            self._scopes[command.label] = scope
            if command.batch in self._state.batches:
                nursery, _ = self._batches[command.batch]
            else:
                # A carried group whose batch was delivered, or a resumed run's: its rollouts
                # run beside the batches'.
                nursery = self._nursery
            if self.config.carry_over:
                self._note_origin(command)
            nursery.start_soon(self._rollout, scope, command)
            if self.timeout is not None:
                self._deadlines.append((command.time + self.timeout, command.label))
                self._deadline_added.set()
        elif isinstance(command, core.Cancel):
            if command.label in self._batch_of:
                batch, submitted = self._batch_of[command.label]
                tokens, calls = self._progress.get(command.label, Progress()).length()
                ran = trio.current_time() - submitted
                self._started[batch].setdefault(command.label, (tokens, calls, ran))
            scope = self._scopes.get(command.label)
            if scope is not None:
                scope.cancel(reason=command.reason)
        elif isinstance(command, core.Deliver):
            events, self._events = tuple(self._events), []
            started = self._forget_lengths(command.batch)
            carried, in_play = command.carried, len(self._state.carried)
            message = _Delivery(
                command.groups, events, command.uniform, started, carried, in_play, command.choice
            )
            self._deliver(message)
        elif isinstance(command, core.Fail):
            if self._failure is not None:
                self._later_failures += 1
                if self._later_failures == 1:
                    error = command.error
                    said = (str(error).splitlines() or [""])[0]
                    logger.error(
                        "a failure after the one the trainer gets (any more are counted): %s: %s",
                        type(error).__name__,
                        said,
                    )
                return
            self._failure = command
            if command.batch is None:
                self._fail(command.error)

    def _deliver(self, message: _Delivery | _Failure) -> None:
        self._waiting = False
        self._delivered = True
        if self._watch is not None:
            self._watch.cancel(reason="delivered")
            self._watch = None
        if self.long_wait is not None and isinstance(message, _Delivery):
            self._training = trio.CancelScope()
            self._nursery.start_soon(self._watch_trainer, self._training, self.long_wait)
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
        self._progress[label] = track_progress()  # this task's own: its engine calls count here
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
            oldest = self._progress[label].oldest
            self._post(core.Finished(now, label, session, None if oldest is None else oldest[0]))
        finally:
            del self._scopes[label]
            del self._progress[label]

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


def _length(session: Session) -> tuple[float, float, float]:
    """A finished session's tokens, calls and seconds from submission to finish."""
    return session.tokens, len(session.calls), session.finished - session.submitted


def selection_bias(
    admitted: Sequence[tuple[float, ...]], started: Sequence[tuple[float, ...]]
) -> dict[str, float]:
    """The price of cutting the long tail: the lengths of the rollouts a batch admitted beside
    those of every rollout it started, in tokens, in turns (model calls) and in seconds (from
    submission to finish, slot queueing included).

    Args:
        admitted: (tokens, calls, seconds) of each admitted rollout.
        started: the same of each submission the batch started, finished or cancelled; a
            cancelled one's as far as it got (tokens and calls where its engine reports them
            through note_progress, else 0), a lower bound.

    Returns:
        For `kind` in tokens, turns and seconds, `bias/<kind>/admitted_<stat>` and
        `bias/<kind>/started_<stat>` for the stats mean, p50 and p90, and
        `bias/<kind>/ratio_<stat>`, admitted over started (present where started is above 0):
        below 1, the admitted rollouts are shorter than what the batch ran, the bias the cut
        pays. Empty when either side is.
    """
    metrics: dict[str, float] = {}
    if not admitted or not started:
        return metrics
    for kind, column in (("tokens", 0), ("turns", 1), ("seconds", 2)):
        stats = {}
        for side, lengths in (("admitted", admitted), ("started", started)):
            ordered = sorted(float(length[column]) for length in lengths)
            stats[side] = {
                "mean": math.fsum(ordered) / len(ordered),
                "p50": _percentile(ordered, 50),
                "p90": _percentile(ordered, 90),
            }
            metrics |= {f"bias/{kind}/{side}_{s}": v for s, v in stats[side].items()}
        for s, below in stats["started"].items():
            if below > 0:
                metrics[f"bias/{kind}/ratio_{s}"] = stats["admitted"][s] / below
    return metrics


@attrs.frozen
class _RegisteringDataset:
    """A dataset whose training stream registers each batch with the scheduler as it is read."""

    scheduler: _Scheduler
    dataset: Dataset

    def stream(self, start: int = 0) -> Iterator[Batch]:
        generation = self.scheduler._open_stream()
        self.scheduler._resolve_restored(self.dataset)
        return self._registering(self.dataset.stream(start), generation, start)

    def _registering(
        self, batches: Iterator[Batch], generation: int, start: int
    ) -> Iterator[Batch]:
        for position, batch in enumerate(batches, start):
            self.scheduler._register(generation, batch, position)
            yield batch

    def __len__(self) -> int:
        return len(self.dataset)


def _same_batch(a: Batch, b: Batch) -> bool:
    if a is b:
        return True
    if set(a) != set(b):
        return False
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)
