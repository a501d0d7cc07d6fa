"""What `dew.calibrate` reads from a recorded run: the trainer calls that delivered a batch, the
window of rollouts after the warmup, each finished rollout as the simulation resamples it, the
engine's slots, the spans the contention fit compares, and the run's batch shape and admit.

Apart from `calibrate.py`, which fits these into the workload the simulation runs and reports
the fit, because each reads one trace and nothing else; the fits themselves are
`_calibration_fits`'.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from dew._calibration_fits import Busy
from dew.envs.simulated import ObservedRollout
from dew.objectives.rl.sessions import Status
from dew.replay import RecordedCall, RecordedSession, Trace


class CalibrationError(ValueError):
    """A trace that holds too little to calibrate from; the message names the trace."""


def delivered(trace: Trace) -> list[RecordedCall]:
    """The trainer calls that delivered a batch, with their times (a call that raised has
    no record, and from the trainer's thread no times)."""
    return [c for c in trace.calls if c.record is not None and c.handed_over is not None]


def window_start(trace: Trace, warmup: int) -> float:
    """The scheduler's clock at the hand-over of call `warmup`: where a trace's window opens.

    Raises:
        CalibrationError: when the trace has too few calls with times.
    """
    timed = delivered(trace)
    if len(timed) < warmup + 2:
        raise CalibrationError(
            f"{trace.path}: needs at least warmup + 2 = {warmup + 2} trainer calls that "
            f"delivered a batch, has {len(timed)}"
        )
    return timed[warmup].handed_over


def windowed(trace: Trace, warmup: int, tasks: int) -> tuple[list[RecordedSession], int]:
    """The rollouts of the batches that calls `warmup` on handed over and those read after,
    and how many groups those batches hold (the scheduler numbers a batch's groups in a row,
    `tasks` a batch, while the trainer keeps its one stream).

    Raises:
        CalibrationError: when the trace has too few calls, or no rollout of those batches.
    """
    window_start(trace, warmup)
    first = delivered(trace)[warmup].batch
    sessions = [s for s in trace.sessions.values() if s.label.group // tasks >= first]
    if not sessions:
        raise CalibrationError(f"{trace.path}: no rollout of batch {first} or later")
    last = max(s.label.group for s in sessions) // tasks
    return sessions, (last - first + 1) * tasks


def split_over_calls(recorded: RecordedSession) -> ObservedRollout:
    """A finished rollout as the simulation resamples it: its duration split over its calls
    by completion tokens (evenly where none has any)."""
    session = recorded.session
    duration = recorded.ended - recorded.submitted
    tokens = np.array([len(call.completion) for call in session.calls], np.float64)
    if len(tokens) and tokens.sum() > 0:
        seconds = duration * tokens / tokens.sum()
    else:
        seconds = np.full(len(tokens), duration / max(len(tokens), 1))
    failing = None
    if session.status is Status.INFRA_ERROR:
        # A failure that made no call still held the engine until it failed.
        failing = 0.0 if len(tokens) else duration
    return ObservedRollout(
        seconds=tuple(float(s) for s in seconds),
        status=session.status,
        truncation=session.truncation,
        failing=failing,
    )


def most_in_flight(sessions: Sequence[RecordedSession]) -> int:
    """The most rollouts running at once; one ending as another starts does not overlap it."""
    marks = sorted(
        [(s.submitted, 1) for s in sessions] + [(s.ended, -1) for s in sessions],
    )
    running = most = 0
    for _, change in marks:
        running += change
        most = max(most, running)
    return most


def shared_cpu(trace: Trace, warmup: int, finished: Sequence[RecordedSession]):
    """A trace's spans for the contention fit: its window's steps (seconds, engine overlap,
    instrument) and its finished rollouts (seconds, trainer overlap, instrument, calls)."""
    timed = delivered(trace)
    stepping = Busy([(a.returned, b.handed_over) for a, b in itertools.pairwise(timed)])
    engine = Busy([(s.submitted, s.ended) for s in trace.sessions.values()])
    steps = [(a.returned, b.handed_over) for a, b in itertools.pairwise(timed[warmup:])]
    begin, end = np.array(steps, np.float64).reshape(-1, 2).T
    stretch = float(np.median(end - begin)) if len(steps) else 0.0
    step = (
        end - begin,
        engine.covered(begin, end),
        engine.covered(begin, begin + stretch) / stretch if stretch > 0 else np.zeros(len(begin)),
    )
    submitted = np.array([s.submitted for s in finished], np.float64)
    ended = np.array([s.ended for s in finished], np.float64)
    stretch = float(np.median(ended - submitted)) if len(finished) else 0.0
    rollout = (
        ended - submitted,
        stepping.covered(submitted, ended),
        stepping.covered(submitted, submitted + stretch) / stretch
        if stretch > 0
        else np.zeros(len(finished)),
        np.array([max(len(s.session.calls), 1) for s in finished], np.float64),
    )
    return step, rollout


def alternating(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(sequence, index) pairs, one per index up to the longest: index i taken from the
    sequences long enough to hold it, in turn."""
    order = []
    for i in range(max(lengths, default=0)):
        holding = [j for j, length in enumerate(lengths) if length > i]
        order.append((holding[i % len(holding)], i))
    return order


def admitted_groups(trace: Trace, tasks: int) -> int:
    """The groups a step of the trace's run trains: see Calibration.admitted."""
    admit = trace.config.get("admit")
    if (
        isinstance(admit, int)
        and not isinstance(admit, bool)
        and not trace.config.get("carry_over")
    ):
        return admit
    return tasks


def tasks_per_batch(trace: Trace) -> int:
    """The tasks of the trace's first batch (the scheduler's batches have one size)."""
    if not trace.batches:
        raise CalibrationError(f"{trace.path}: holds no task batch")
    return len(trace.batches[min(trace.batches)])
