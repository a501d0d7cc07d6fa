"""The trio side of the scheduler's workings (`_shell._Scheduler`): events in, commands out.

It turns happenings into the admission core's events and carries out the core's commands, with
one cancel scope per rollout inside one nursery per task batch: it runs in the caller's trio run
(`async with scheduler:`) or in a thread of its own started at the trainer's first call, and
close() from any thread ends it. What passes between it and the trainer's side
(`_shell_trainer`), the hand-over and the delivery or failure that answers it, is
`_shell_messages`'; the slots of `align_starts` are `_shell_slots`'. `_TrioSide` is a part of
`_Scheduler`, kept in a module of its own so that each part reads in one sitting: its methods
use the state `_Scheduler.__init__` sets.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Self

import attrs
import trio
import trio.testing

from dew._trio import exit_unwrapped
from dew.objectives.rl import _admission as core
from dew.objectives.rl import _align
from dew.objectives.rl._admission import LogEvent
from dew.objectives.rl._records import Variables
from dew.objectives.rl._session import Progress, track_progress, waits
from dew.objectives.rl._shell_messages import (
    CLOSED_WAITING,
    _Delivery,
    _Failure,
    _HandOver,
    _length,
)
from dew.objectives.rl._shell_slots import _AlignedSlots
from dew.objectives.rl.sessions import Label, Session, SessionError, check_session

# Logged under the public module's name, where a user configures the scheduler's logging.
logger = logging.getLogger("dew.objectives.rl.scheduler")


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


class _TrioSide(_AlignedSlots):
    """The trio side of `_Scheduler`: its run, close, the driver, the rollouts and pushes."""

    async def __aenter__(self) -> Self:
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
        # A checkpoint's group ids (`restore_state`) for a stream opened before this side ran,
        # whose `Reopened` found no trio side to post to.
        self._state = attrs.evolve(
            self._state, next_group=max(self._state.next_group, self._next_group)
        )
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
        instant is over (replay's clock keeper moves the clock only then). Under align_starts
        the driver is also woken with nothing posted, to start a queued rollout on a freed slot:
        until it has, the instant is not over either."""
        if self.align_starts is not None and self._wake.is_set() and not self._ended:
            return False
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
            if self.align_starts is not None:
                self._start_queued()

    def _apply(self, events: list[core.Event]) -> None:
        for event in events:
            if isinstance(event, core.Finished) and event.label in self._batch_of:
                batch, submitted = self._batch_of[event.label]
                self._started[batch][event.label] = _length(event.session)
                if self.align_starts is not None:
                    start = self._on_slots.get(event.label, submitted)
                    start = start if event.slot is None else max(start, event.slot)
                    self._seen = _align.ran(self._seen, event.time - start, True)
            elif isinstance(event, core.HandedOver) and self.align_starts is not None:
                self._seen = _align.handed_over(self._seen, event.time)
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
            if command.label in self._on_slots:
                self._seen_cancelled(command.label)
            scope = self._scopes.get(command.label)
            if scope is not None:
                scope.cancel(reason=command.reason)
        elif isinstance(command, core.Deliver):
            events, self._events = tuple(self._events), []
            started = self._forget_lengths(command.batch)
            carried, in_play = command.carried, len(self._state.carried)
            aligned = None
            if self.align_starts is not None:
                self._seen = _align.delivered(self._seen, trio.current_time())
                aligned, self._aligned = self._aligned, (0, 0.0)
            message = _Delivery(
                command.groups,
                events,
                command.uniform,
                started,
                carried,
                in_play,
                command.choice,
                aligned,
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
                if self.align_starts is not None:
                    await self._slot(label, submitted)
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
            if self._on_slots.pop(label, None) is not None:
                self._wake.set()  # a slot is free: the driver starts the next, or holds it

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
