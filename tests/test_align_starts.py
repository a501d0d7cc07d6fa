"""Push-aligned starts (`align_starts`, issue 46 item 1): a freed slot waits for the coming push
where a rollout started now would likely spend its slot-seconds for nothing.

The decision (`_align.hold`) is checked by hypothesis over what a run may have seen: it waits
only while the trainer holds its batch and the next hand-over pushes, never past that push's
expected time, and only where a start now has a shorter window than one at the push. A run of the
real scheduler over the simulated engine, on a mix of short and long rollouts whose long ones fit
a window begun at a push but not one begun just before it, waits, keeps exactly-once and the lag
bound, says so in its records, and replays exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.envs.simulated import ObservedRollout, SimulatedConfig
from dew.objectives.rl import _align
from dew.objectives.rl.sessions import Status
from dew.simulate import WIDTH
from dew.testing import assert_exactly_once, assert_replays, run_simulated


def _seen(durations, complete, periods, steps, delivered_at) -> _align.Seen:
    seen = _align.Seen()
    for seconds, done in zip(durations, complete, strict=True):
        seen = _align.ran(seen, seconds, done)
    return _align.Seen(
        seconds=seen.seconds,
        complete=seen.complete,
        fresh=seen.fresh,
        times=seen.times,
        survive=seen.survive,
        periods=tuple(periods),
        steps=tuple(steps),
        handed_at=0.0,
        delivered_at=delivered_at,
    )


seconds = st.floats(0.01, 100.0, allow_nan=False)


@st.composite
def seens(draw):
    n = draw(st.integers(0, 3 * _align.REFRESH))
    durations = draw(st.lists(seconds, min_size=n, max_size=n))
    complete = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    periods = draw(st.lists(st.floats(0.1, 50.0), min_size=0, max_size=4))
    steps = draw(st.lists(st.floats(0.1, 50.0), min_size=0, max_size=4))
    delivered_at = draw(st.none() | st.floats(0.0, 100.0))
    return _seen(durations, complete, periods, steps, delivered_at)


@settings(max_examples=300, deadline=None)
@given(
    seen=seens(),
    now=st.floats(0.0, 200.0),
    max_lag=st.integers(0, 8),
    behind=st.integers(0, 3),
    pushes=st.booleans(),
)
@pytest.mark.medium
def test_a_slot_waits_only_for_a_push_that_needs_none_of_its_rollouts_and_never_past_it(
    seen, now, max_lag, behind, pushes
):
    push = _align.hold(seen, now, max_lag=max_lag, behind=behind, pushes=pushes)
    if push is None:
        return
    # The trainer holds its batch, so its next hand-over needs no rollout held back, and that
    # hand-over pushes: the wait ends there.
    assert pushes and seen.delivered_at is not None
    # It waits for the push expected, a median step after the delivery, and not past it.
    assert push == seen.delivered_at + float(np.median(seen.steps))
    assert now < push
    # A start now has a shorter window than one at the push, or none.
    period = float(np.median(seen.periods))
    assert push - now + (max_lag - behind - 1) * period < max_lag * period
    assert sum(seen.complete) >= _align.LEAST


def test_near_a_push_a_slot_waits_where_a_long_rollout_would_outlive_a_window_begun_now():
    # 80 % of rollouts take 1 s, 20 % take 9 s; a period of 5 s and max_lag 2: begun at the push
    # a long one has 10 s and finishes, begun r seconds before it only r + 5 s.
    durations = [9.0 if i % 5 == 0 else 1.0 for i in range(2 * _align.LEAST)]
    seen = _seen(durations, [True] * len(durations), [5.0] * 4, [4.0] * 4, delivered_at=100.0)
    waits = {r: _align.hold(seen, 104.0 - r, max_lag=2, behind=0, pushes=True) for r in (0.5, 2)}
    # Expected waste 0.2 (r + 5) against nothing at the push: worth the r idle seconds below
    # 1.25 s.
    assert waits == {0.5: 104.0, 2: None}
    # Nothing waits while the trainer waits on the scheduler, nor for a hand-over that does not
    # push.
    waiting = _seen(durations, [True] * len(durations), [5.0] * 4, [4.0] * 4, delivered_at=None)
    assert _align.hold(waiting, 103.5, max_lag=2, behind=0, pushes=True) is None
    assert _align.hold(seen, 103.5, max_lag=2, behind=0, pushes=False) is None


def _bimodal() -> SimulatedConfig:
    """One call a rollout: half take 0.5 s, half 7 s."""
    pool = tuple(
        ObservedRollout((7.0 if i % 2 == 0 else 0.5,), Status.COMPLETED) for i in range(50)
    )
    return SimulatedConfig(seed=3, calls=(1, 1), observed=pool)


async def test_a_run_with_aligned_starts_waits_keeps_its_rules_and_replays_exactly(
    autojump_clock, tmp_path
):
    trace = await run_simulated(
        tmp_path / "aligned.trace",
        updates=list(range(40)),
        config=_bimodal(),
        slots=14,
        gap=5.0,
        width=WIDTH,
        rows=16,
        groups=4,
        ahead=2,
        max_lag=2,
        align_starts=14,
    )
    assert trace.config["align_starts"] == 14
    # The scheduler starts at most align_starts rollouts at once, the others queued until a
    # slot is theirs.
    spans = [(s.started, s.ended) for s in trace.sessions.values()]
    assert all(start is not None for start, _ in spans)
    running = max(sum(b <= t < e for b, e in spans) for t, _ in spans)
    assert running == 14
    assert any(s.started > s.submitted for s in trace.sessions.values())
    records = [call.record for call in trace.calls]
    waited = sum(r.metrics["align/waited"] for r in records)
    held = sum(r.metrics["align/wait_seconds"] for r in records)
    assert waited > 0 and held > 0, (waited, held)
    assert all(r.lag <= 2 for r in records)
    events = [e for call in trace.calls for e in call.events]
    assert_exactly_once([*events, *trace.closing_events])
    result = await assert_replays(trace)
    assert result.steps == 40


def test_align_starts_is_refused_unless_a_count_of_slots():
    from dew.objectives.rl._arguments import check_align_starts

    for bad in (0, -1, True, 2.5, "8"):
        with pytest.raises(ValueError, match=r"^align_starts must be an int >= 1, got "):
            check_align_starts(bad)
    assert check_align_starts(np.int64(8)) == 8 and check_align_starts(None) is None
