"""Push-aligned starts (`align_starts`): whether a freed engine slot waits for the next push.

A rollout takes the version served when it starts, and the hand-over `max_lag` calls after that
version's push is the last that may admit it. Started `r` seconds before the next push (one
version behind it), it has `W = r + (max_lag - 1) P` seconds to finish, `P` the trainer's period;
started right after the push it has `M = max_lag P`. One that outlives its window has spent the
whole window for nothing (it goes stale, or its hedge stands in), so a start now throws away
`W S(W)` slot-seconds in expectation, one at the push `M S(M)`, `S(x)` the chance a rollout
outlives `x` seconds on a slot. The slot waits when the difference exceeds the `r` seconds it
would idle: near a push, and more so the heavier the tail (docs/concepts.md, "The long tail").

`S` is this run's own: a Kaplan-Meier estimate (`_auto.survival`) over its recent rollouts'
seconds on a slot, a cancelled one censored at its seconds (its tail is what the window cut
off, and dropping it would favour short rollouts). The next push is expected a median step
(a delivery to the next hand-over) after the latest delivery, and `P` is the median period.

A slot waits only while the trainer holds its batch (delivered, its next hand-over not yet
come) and only for a hand-over that pushes: the push needs none of the rollouts held back, so a
wait cannot deadlock, and the next hand-over ends every wait (`Seen.delivered_at` is cleared).

Everything here is a pure function of times on the scheduler's clock and of the rollouts' ends,
so a run under the mock clock, and its replay, hold alike.
"""

from __future__ import annotations

import attrs
import numpy as np

from dew.objectives.rl import _auto

# Recent rollouts the survival estimate rests on: enough for the tail at a window of several
# periods (at max_lag 8 on the reference workload one rollout in 200 outlives it).
WINDOW = 1024
# Rollouts that must have finished before any slot waits: a batch or two of the reference
# workload, below which the tail is a guess.
LEAST = 128
# The estimate is redrawn after this many rollouts end, not at every end: a saturated engine
# frees a slot at almost every rollout's end, and one estimate over the window costs far more
# than the decision it serves.
REFRESH = 64


@attrs.frozen
class Seen:
    """What the run has seen that a start's decision rests on, in times of the scheduler's clock.

    seconds, complete: the recent rollouts' seconds on an engine slot (from their first call's
    start, or their submission where the engine said nothing) and whether each finished (False:
    cancelled then, censored). times, survive: the survival estimate over them (`_auto.survival`),
    redrawn every REFRESH ends; `fresh` counts the ends since. periods: recent hand-over to
    hand-over seconds; steps: recent delivery to next hand-over seconds; handed_at: the latest
    hand-over; delivered_at: the latest delivery while the trainer holds its batch, else None.
    """

    seconds: tuple[float, ...] = ()
    complete: tuple[bool, ...] = ()
    fresh: int = 0
    times: np.ndarray = attrs.field(factory=lambda: np.zeros(0), eq=False)
    survive: np.ndarray = attrs.field(factory=lambda: np.zeros(0), eq=False)
    periods: tuple[float, ...] = ()
    steps: tuple[float, ...] = ()
    handed_at: float | None = None
    delivered_at: float | None = None


def ran(seen: Seen, seconds: float, complete: bool) -> Seen:
    """`seen` with one more rollout ended after `seconds` on a slot, finished or cancelled."""
    kept = (*seen.seconds, max(0.0, seconds))[-WINDOW:]
    done = (*seen.complete, complete)[-WINDOW:]
    if seen.fresh + 1 < REFRESH:
        return attrs.evolve(seen, seconds=kept, complete=done, fresh=seen.fresh + 1)
    times, survive = _auto.survival(kept, done)
    return attrs.evolve(seen, seconds=kept, complete=done, fresh=0, times=times, survive=survive)


def handed_over(seen: Seen, time: float) -> Seen:
    """`seen` after a hand-over at `time`: the trainer waits on the scheduler again."""
    periods, steps = seen.periods, seen.steps
    if seen.handed_at is not None:
        periods = (*periods, time - seen.handed_at)[-_auto.STEP_WINDOW :]
    if seen.delivered_at is not None:
        steps = (*steps, time - seen.delivered_at)[-_auto.STEP_WINDOW :]
    return attrs.evolve(seen, periods=periods, steps=steps, handed_at=time, delivered_at=None)


def delivered(seen: Seen, time: float) -> Seen:
    """`seen` after a delivery at `time`: the trainer holds its batch until its next hand-over."""
    return attrs.evolve(seen, delivered_at=time)


def outlives(seen: Seen, seconds: float) -> float:
    """S(seconds): the chance a rollout runs longer than `seconds` on a slot, by the estimate."""
    return float(_auto._survive(seen.times, seen.survive, np.array([seconds]))[0])


def hold(seen: Seen, now: float, *, max_lag: int, behind: int, pushes: bool) -> float | None:
    """Whether a slot freed at `now` waits for the next push: the time that push is expected,
    or None to start a rollout now.

    Args:
        seen: what the run has seen.
        now: the scheduler's time.
        max_lag: the scheduler's bound.
        behind: the served version's updates behind the trainer's (0 when every hand-over
            pushes): a start now has that many calls less to finish in.
        pushes: whether the next hand-over pushes weights (`sync_every`): a slot waits for
            nothing else.
    """
    if not pushes or seen.delivered_at is None or not seen.steps or not seen.periods:
        return None
    if len(seen.survive) == 0 or sum(seen.complete) < LEAST:
        return None
    push = seen.delivered_at + float(np.median(seen.steps))
    idle = push - now
    if idle <= 0:
        return None  # the push is due any moment, or late: the estimate says nothing more
    period = float(np.median(seen.periods))
    at_push = max_lag * period
    started_now = idle + (max_lag - behind - 1) * period
    if started_now <= 0:
        return push  # the calls that could admit a rollout started now end before it can
    if started_now >= at_push:
        return None
    thrown = started_now * outlives(seen, started_now) - at_push * outlives(seen, at_push)
    return push if thrown > idle else None
