"""The trainer's side of the scheduler's workings (`_shell._Scheduler`): the trainer's calls.

A call hands its batch over to the trio side (`_shell_trio`), waits for the delivery, meets the
process pool, packs and rescores the delivered groups, and makes the call's record. From the
trainer's thread (`scheduler(batch, variables, updates)`) it makes one trip into the trio thread;
inside the caller's trio run (`await scheduler.step(...)`) it awaits the same steps there.
`_TrainerSide` is a part of `_Scheduler`, kept in a module of its own so that each part reads in
one sitting: its methods use the state `_Scheduler.__init__` sets.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np
import trio

from dew._checks import check_int
from dew._trio import run_from_thread, stop_in
from dew.data import Batch, Task
from dew.objectives.rl import _admission as core
from dew.objectives.rl._admission import LogEvent
from dew.objectives.rl._arguments import MAX_IN_FLIGHT
from dew.objectives.rl._packing import pack_narrow
from dew.objectives.rl._records import (
    GroupStatus,
    SampleStatus,
    SchedulerRecord,
    SchedulerStatus,
    Variables,
)
from dew.objectives.rl._rewards import uniform_group
from dew.objectives.rl._session_metrics import _percentile
from dew.objectives.rl._shell_messages import (
    CLOSED,
    CLOSED_WAITING,
    _Delivery,
    _Failure,
    _HandOver,
    _length,
)
from dew.objectives.rl.grpo import GRPOObjective, mismatch_metrics
from dew.objectives.rl.sessions import Packed, pack, session_metrics
from dew.parallel import first_reader_batch

# How many of failed sessions' most frequent error texts status() shows.
ERRORS_SHOWN = 5


class _TrainerSide:
    """The trainer's calls of `_Scheduler`: hand a batch over, wait, pack, rescore, record."""

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
            message = run_from_thread(self._hand_over_and_wait, handover, trio_token=self._token)
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
        where the batch was rescored; under align_starts, the starts that waited for a push
        and the slot-seconds held for pushes (`align/*`)."""
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
        if message.aligned is not None:
            metrics["align/waited"] = float(message.aligned[0])
            metrics["align/wait_seconds"] = float(message.aligned[1])
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


def _same_batch(a: Batch, b: Batch) -> bool:
    if a is b:
        return True
    if set(a) != set(b):
        return False
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)
