"""What passes between the scheduler's two sides (`_shell_trio`, `_shell_trainer`): the trainer's
hand-over of a call, and the delivery or failure that answers it, with what a closed scheduler
answers.

Apart from both sides because each side builds one and reads the other: values alone, no trio.
"""

from __future__ import annotations

import attrs

from dew.objectives.rl._admission import LogEvent
from dew.objectives.rl._auto import Choice
from dew.objectives.rl._records import Variables
from dew.objectives.rl.sessions import Session

# What a closed scheduler answers a call, a stream or a block; a call that waited when close()
# came says so after it.
CLOSED = "the scheduler is closed"
CLOSED_WAITING = f"{CLOSED}: close() came while the trainer waited"


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
    choice: Choice | None = None  # under admit="auto": the call's cut and its estimate
    # Under align_starts: the starts that waited for a push since the last delivery, and the
    # slot-seconds held idle for pushes.
    aligned: tuple[int, float] | None = None


@attrs.frozen
class _Failure:
    """A call that fails, with the event log up to its failure."""

    error: BaseException = attrs.field(eq=False)
    events: tuple[LogEvent, ...] = ()


def _length(session: Session) -> tuple[float, float, float]:
    """A finished session's tokens, calls and seconds from submission to finish."""
    return session.tokens, len(session.calls), session.finished - session.submitted
