"""The trio side's slots under `align_starts`: rollouts queued for a slot, and the slots held
idle for a coming push (`_align.hold`) rather than started on weights about to be replaced.

`_AlignedSlots` is a part of `_TrioSide` (and so of `_Scheduler`), kept in a module of its own
so that each part reads in one sitting: its methods use the state `_Scheduler.__init__` sets.
"""

from __future__ import annotations

import trio

from dew.objectives.rl import _admission as core
from dew.objectives.rl import _align
from dew.objectives.rl._session import waiting_on
from dew.objectives.rl.sessions import Label


class _AlignedSlots:
    """`_TrioSide`'s slots under align_starts."""

    async def _slot(self, label: Label, submitted: float) -> None:
        """Wait until the driver gives this rollout one of align_starts' slots; a rollout
        cancelled while it waits leaves the queue."""
        started = trio.Event()
        # Ordered by submission, whatever order trio runs the rollouts' tasks in.
        entry = (submitted, label.group, label.sample, label.attempt, label, started)
        self._queued.append(entry)
        self._wake.set()
        progress = self._progress[label]
        try:
            with waiting_on("a slot of align_starts"):
                await started.wait()
        finally:
            if not started.is_set():
                self._queued.remove(entry)
        progress.released = self._on_slots[label]

    def _start_queued(self) -> None:
        """Give the free slots to the queued rollouts, oldest submission first, unless the
        slots wait for the coming push (`_align.hold`); count what waited. A wait's end is the
        next hand-over, or the push's expected time, when the driver looks again."""
        now = trio.current_time()
        if self._holding is not None:
            since, slots, _ = self._holding
            waited, seconds = self._aligned
            self._aligned = (waited, seconds + slots * (now - since))
        ready = min(self.align_starts - len(self._on_slots), len(self._queued))
        push = None
        if ready > 0:
            state = self._state
            push = _align.hold(
                self._seen,
                now,
                max_lag=self.config.max_lag,
                behind=state.updates - state.served,
                pushes=core.push_due(state.served, state.updates + 1, self.sync_every),
            )
        if push is not None:
            if self._holding is None or self._holding[2] != push:
                self._nursery.start_soon(self._look_again, push)
            self._holding = (now, ready, push)
            return
        if self._holding is not None:
            waited, seconds = self._aligned
            self._aligned = (waited + min(ready, self._holding[1]), seconds)
            self._holding = None
        for entry in sorted(self._queued)[:ready]:
            self._queued.remove(entry)
            *_, label, started = entry
            self._on_slots[label] = now
            started.set()

    async def _look_again(self, time: float) -> None:
        """Wake the driver at `time`, the push a wait expects: a late push ends the wait."""
        await trio.sleep_until(time)
        self._wake.set()

    def _seen_cancelled(self, label: Label) -> None:
        """Count a rollout cancelled on its slot as censored at its seconds there (from its
        first call's start where its engine said it before this instant)."""
        now = trio.current_time()
        start = self._on_slots[label]
        oldest = self._progress[label].oldest if label in self._progress else None
        if oldest is not None and oldest[0] < now:
            start = max(start, oldest[0])
        self._seen = _align.ran(self._seen, now - start, False)
