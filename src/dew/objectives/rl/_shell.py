"""The scheduler's workings (`_Scheduler`): the trio shell around the pure admission core.

It turns happenings into the core's events and carries out the core's commands, with one cancel
scope per rollout inside one nursery per task batch, and serves the trainer's calls from its
thread or from the caller's own trio run. `RolloutScheduler` (in `scheduler`) is the front the
caller holds; this object is what its trio side holds, so a dropped front can be collected.

`_Scheduler` is made of three parts, a module each, so that each reads in one sitting: this one
holds its state (`__init__`), the data stream that registers each task batch, and the carried
groups a checkpoint keeps; `_shell_trainer` the trainer's calls (hand over, wait, pack, rescore,
record); `_shell_trio` the trio side (its run and close, the driver, the rollouts, the pushes)
and what passes between it and the trainer's side.

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
import math
import threading
from collections.abc import Callable, Iterator, Sequence

import attrs
import trio

from dew._errors import ErrorCounts
from dew.data import Batch, Dataset, Task
from dew.objectives.rl import _admission as core
from dew.objectives.rl import _align
from dew.objectives.rl._admission import LogEvent
from dew.objectives.rl._arguments import (
    check_align_starts,
    check_arguments,
    check_carry_over,
    check_filtering,
    check_hedge,
    check_waste_budget,
    resolve_vocab,
)
from dew.objectives.rl._records import Publisher, SchedulerRecord, Variables
from dew.objectives.rl._reports import EmptyStreak, NoRoom, OverBudget, TooLongChain
from dew.objectives.rl._session import Progress
from dew.objectives.rl._shell_messages import _Delivery, _Failure
from dew.objectives.rl._shell_trainer import _TrainerSide
from dew.objectives.rl._shell_trio import _TrioSide
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.sessions import Label, SessionSource
from dew.parallel import LocalPool, Pool, default_pool

# Distinct error texts status() counts.
ERRORS_KEPT = 64


class _Scheduler(_TrainerSide, _TrioSide):
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
        align_starts: int | None = None,
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
        self.align_starts = check_align_starts(align_starts)
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
        self._next_group = 0  # a checkpoint's: the id its run would have given its next group
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
        # Under align_starts: the rollouts submitted and waiting for a slot, each as (its
        # submission's time, group, sample, attempt, label, the event that starts it); those
        # holding a slot, with when each got it; what the run has seen that a start's wait
        # rests on; and the wait under way: since when its slots were last counted, how many,
        # and the push it waits for.
        self._queued: list[tuple] = []
        self._on_slots: dict[Label, float] = {}
        self._seen = _align.Seen()
        self._holding: tuple[float, int, float] | None = None
        # The starts that waited for a push and the slot-seconds held idle, since the last
        # delivery (the record's align/waited and align/wait_seconds).
        self._aligned = (0, 0.0)

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
        # A trio side that runs takes the restored group ids with the reopening; one that starts
        # later takes them as it starts (`_serve`).
        next_group = self._next_group
        self._post_anywhere(lambda: core.Reopened(trio.current_time(), next_group))
        return generation

    def _register(self, generation: int, batch: Batch, position: int) -> None:
        with self._lock:
            if generation == self._generation:
                self._positions[self._next_batch] = position
                self._registry.append((self._next_batch, batch))
                self._next_batch += 1

    # --- checkpoints: the group ids, and the carried groups under carry_over -----------------

    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps for this scheduler: the id of the next group, and the carried
        groups of the batches handed over so far, as [stream position, index in its batch] of
        each one's task (the batches not yet handed over are read again by the resumed stream),
        and the stale cycles each has run (see HOLD_AFTER in the admission core), which a
        resumed run counts on from: a task that always outlives the window is held as soon as
        it would have been.

        The next group's id is the least of the groups of batches not yet handed over (the
        resumed stream submits those batches again), else the next the core would give: a
        resumed run numbers its groups on from there as the checkpointed run did, so their
        sampling keys (`Sampling(seed=...)` draws each call's from its label) are not the
        first steps' again."""
        state = self._state
        carried, stale = [], []
        for group_id in state.carried:
            group = state.groups.get(group_id)
            origin = self._origins.get(group_id)
            if group is not None and origin is not None and group.batch <= self._handed:
                carried.append(list(origin))
                stale.append(group.stale)
        ahead = [group_id for group_id, group in state.groups.items() if group.batch > self._handed]
        next_group = min(ahead, default=state.next_group)
        return {"carried": carried, "stale": stale, "next_group": next_group}

    def restore_state(self, state: dict) -> None:
        """Take a checkpoint's `checkpoint_state`: the next stream opened resubmits its carried
        groups' tasks, read again from the dataset at their positions, each counting on from
        its stale cycles, and numbers its groups from the state's `next_group` on. A state
        without "stale" (a checkpoint written before they were kept) counts from 0, one without
        "next_group" numbers from 0.

        Raises:
            ValueError: when state is not what checkpoint_state writes.
        """
        carried = state.get("carried") if isinstance(state, dict) else None
        stale = state.get("stale", [0] * len(carried)) if isinstance(carried, list) else None
        next_group = state.get("next_group", 0) if isinstance(state, dict) else None
        if (
            not isinstance(carried, list)
            or not all(
                isinstance(c, list | tuple) and len(c) == 2 and all(type(x) is int for x in c)
                for c in carried
            )
            or not isinstance(stale, list)
            or len(stale) != len(carried)
            or not all(type(n) is int and n >= 0 for n in stale)
            or type(next_group) is not int
            or next_group < 0
        ):
            raise ValueError(
                "a scheduler's checkpoint state must be {'carried': [[position, index], ...], "
                "'stale': [count >= 0 for each carried group], 'next_group': int >= 0}, "
                f"got {state!r}"
            )
        self._next_group = next_group
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
