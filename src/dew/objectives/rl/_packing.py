"""Fixed-shape packing of admitted groups.

The objective compiles once for one `[rows, width]` shape, so every step's rollouts are laid into
that shape: each chain of a training rollout is one *segment* of a row (positions restart at 0,
attention stays inside it), groups go in whole, in admission order, or are *cut* and counted. A
group is the unit because its advantages are relative to each other: training half a group would
train on a baseline its other half set.

Public through `dew.objectives.rl.sessions`, which re-exports `Cut`, `Packed` and `pack`; this
module builds on `_session`, `_chains` and `_rewards` (each group's advantages), which import
neither it nor `sessions`. Where the chains go in the rows is `_row_layout`'s; the step's figures
over what it packed are `_session_metrics`'.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from dew._checks import check_int
from dew.objectives.rl._chains import _Run, _runs
from dew.objectives.rl._rewards import (
    _advantages,
    _seat_advantages,
    _training_reward,
    _training_statuses,
)
from dew.objectives.rl._row_layout import _lay_out, _Layout, _length, _Piece
from dew.objectives.rl._session import ESTIMATORS, TRUNCATION, Session, Status, _fail

CUT_REASONS = ("no_room", "too_long", "support")
"""Why `pack` leaves a complete group out (see `Cut`)."""
PACKABLE = (Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED)
"""The statuses `pack` takes: the scored ones and truncations."""


@attrs.frozen
class Cut:
    """A complete group left out of a step, and why.

    Args:
        group: index into the `groups` given to `pack`.
        reason: `no_room` (its chains do not fit beside earlier groups), `too_long` (one of its
            chains is longer than a row), `support` (its chains fit but their support does not
            fit `support_capacity` beside earlier groups).
    """

    group: int
    reason: str = attrs.field(validator=attrs.validators.in_(CUT_REASONS))


@attrs.frozen(eq=False)
class Packed:
    """One step's rollouts laid into fixed `[rows, width]` arrays.

    Args:
        batch: name -> array, `[rows, width]` unless said: `tokens` int32; `positions` int32
            (restarting at 0 in each segment); `segment_ids` int32 (0 = padding, each chain one
            segment, ids 1.. within a row); `loss_mask` float32 (1 at trained tokens, never at a
            segment's first position); `advantages` float32 (the rollout's advantage where
            `loss_mask` is 1, else 0); `behavior_logprobs` float32 (`[r, p]` is the log-prob of
            `tokens[r, p]` given its segment's tokens before p; 0 where not sampled); `versions`
            int32 (a completion token's call version, -1 elsewhere); with a support capacity S,
            `support_tokens` and `support_positions` int32[rows, S]: each row's (position in
            row, kept token id) pairs for every trained position that carried support, in
            position order, -1 where unused.
        packed: indices into `groups` of the groups packed, in admission order (a group none
            of whose rollouts trains takes no cells and counts as packed).
        cut: the groups left out, in admission order.
        fill: share of the `rows * width` cells that hold a token.
        estimator: the advantage family used.
        truncation: the truncation policy used.
    """

    batch: dict[str, np.ndarray]
    packed: tuple[int, ...]
    cut: tuple[Cut, ...]
    fill: float
    estimator: str
    truncation: str


def _extent(run: _Run, support: bool) -> tuple[int, int, int]:
    """A chain's length, its trained positions but its first, and the support tokens kept there
    (0 unless `support`), read off its parts without building its arrays.

    The first position of a segment has nothing before it to be predicted from, so it never
    trains and its support is never kept.
    """
    length = trained = kept = 0
    for context, call in run:
        start = length + len(context)
        completion = len(call.completion)
        length = start + completion
        first = 1 if start == 0 and completion else 0
        trained += completion - first
        if support and call.support is not None:
            kept += sum(map(len, call.support[first:]))
    return length, trained, kept


def _pieces(
    training: Sequence[Session],
    advantages: Sequence[float],
    seated: Sequence[dict[str, float] | None],
    support: bool,
) -> list[_Piece]:
    """The chains a group trains on, in session and chain order, each with its advantage: its
    session's, or where the session gives its agents rewards of their own (`Session.seats`),
    that of the seat of the chain's first call (a chain of a seat with no reward trains
    nothing, and is left out)."""
    pieces = []
    for session, advantage, seats in zip(training, advantages, seated, strict=True):
        for run in _runs(session):
            seat = run[0][1].seat
            if seats is not None and seat is not None:
                if seat not in seats:
                    continue
                chain_advantage = seats[seat]
            else:
                chain_advantage = advantage
            length, trained, kept = _extent(run, support)
            # A segment that trains nothing would only take cells from one that does.
            if trained:
                pieces.append((length, kept, run, chain_advantage))
    return pieces


def pack(
    groups: Sequence[Sequence[Session]],
    *,
    width: int,
    rows: int,
    estimator: str = "group",
    truncation: str = "mask",
    support_capacity: int | None = None,
) -> Packed:
    """Lay admitted groups, in admission order, into fixed `[rows, width]` arrays to train on.

    Each training rollout's chains become segments; a group goes in whole (its chains placed
    longest first, each into the fullest row that still holds it; if that fails though the
    rows have the cells, every chain laid so far and the group's are laid again, longest first
    over all of them, else row by row, each row as full as the chains left can make it) or is
    cut, and later groups may still go in. TRUNCATED rollouts under
    `mask` take no rows. The result depends only on the input.

    A chain trains on its rollout's advantage, except in a session that gives its agents
    rewards of their own (`Session.seats`, a multi-agent episode): there a chain whose first
    call has a seat takes that seat's advantage, the estimator run over the seat's rewards in
    the group's training rollouts that give it one (seats `NAME.0`, `NAME.1`, ..., several
    traces of one agent, pool together), and a chain of a seat with no reward is left out (it
    trains nothing).

    Args:
        groups: admitted groups in admission order, each a sequence of checked Sessions of
            status COMPLETED, AGENT_ERROR or TRUNCATED.
        width: cells per row.
        rows: rows in the batch.
        estimator: advantage family over a group's training rollouts: `group` ((r - mean) /
            (std + 1e-6), 0 when all rewards are equal), `batch` ((r - mean) / (std of every
            training reward of the groups packed together + 1e-6); a seat's pool is its own
            batch), `mean` (r - mean), `rloo` (r - mean of the others, 0 for a lone rollout).
        truncation: what a TRUNCATED rollout trains on: `mask` (nothing: no loss weight, and it
            leaves the baseline), `score` (its reward), `zero` (reward 0).
        support_capacity: support slots per row; None leaves support out.

    Returns:
        The packed batch (see `Packed`).

    Raises:
        ValueError: a bad argument, naming it and its value.
        SessionError: (a ValueError) a session of another status, or a TRUNCATED one without
            a reward under `score`; naming its task and label.
    """
    check_int("width", width, low=1)
    check_int("rows", rows, low=1)
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
    if support_capacity is not None:
        check_int("support_capacity", support_capacity, low=1)
    with_support = support_capacity is not None
    # Every group is checked before any is placed, so whether pack raises never depends on fit.
    trains = _training_statuses(truncation)
    trainings: list[list[Session]] = []
    rewards: list[float] = []
    for group in groups:
        for session in group:
            if session.status not in PACKABLE:
                raise _fail(session, "status", f"is {session.status.name}, which pack cannot train")
        training = [s for s in group if s.status in trains]
        rewards += [_training_reward(s, truncation) for s in training]
        trainings.append(training)
    advantages = _advantages(rewards, [len(t) for t in trainings], estimator).tolist()

    layout = _Layout.empty(width=width, rows=rows, capacity=support_capacity or 0)
    packed: list[int] = []
    cut: list[Cut] = []
    at = 0
    for g, training in enumerate(trainings):
        seated = _seat_advantages(training, truncation, estimator)
        pieces = _pieces(training, advantages[at : at + len(training)], seated, with_support)
        at += len(training)
        if any(length > width for length, _, _, _ in pieces):
            cut.append(Cut(g, "too_long"))
            continue
        pieces.sort(key=_length, reverse=True)
        if layout.admit(pieces):
            packed.append(g)
        else:
            cut.append(Cut(g, "support" if layout.admits_without_support(pieces) else "no_room"))

    cells = width * rows
    return Packed(
        batch=_lay_out(layout.laid, width=width, support_capacity=support_capacity),
        packed=tuple(packed),
        cut=tuple(cut),
        fill=(cells - sum(layout.rows.free)) / cells,
        estimator=estimator,
        truncation=truncation,
    )


NARROWINGS = 4
"""How many times `pack_narrow` may halve a batch's width: at most 5 widths a run, each compiled
once by the trainer's step and the rescoring."""


def pack_narrow(
    groups: Sequence[Sequence[Session]],
    *,
    width: int,
    rows: int,
    estimator: str = "group",
    truncation: str = "mask",
    support_capacity: int | None = None,
) -> Packed:
    """`pack` into the narrowest of `width`, width / 2, ... width / 2**`NARROWINGS` that packs
    and cuts the same groups as `width`, among those that divide `width`: rows as many times
    more, so each shape has the cells of `rows x width` (and support slots as many times fewer
    a row).

    A row's attention costs its width squared, so the same cells in narrower rows cost the
    step width / narrower times less in compute and in memory: a batch of short chains (a
    game's early episodes, a policy's short replies) trains as its tokens need, not as the
    longest chain the run allows. Narrowing never cuts a group the full width would pack.

    Args:
        groups, width, rows, estimator, truncation, support_capacity: as `pack` takes them,
            `width` the widest rows (the run's).

    Returns:
        The packed batch of the narrowest such width (`width` itself when no narrower fits).

    Raises:
        As `pack`.
    """
    full = pack(
        groups,
        width=width,
        rows=rows,
        estimator=estimator,
        truncation=truncation,
        support_capacity=support_capacity,
    )
    for halvings in range(NARROWINGS, 0, -1):
        narrow = width >> halvings
        # Only a width that halves evenly: the same cells, so `constant` aggregation's divisor
        # (rows x width) and the fill are the full width's.
        if width % (1 << halvings) or not full.packed:
            continue
        packed = pack(
            groups,
            width=narrow,
            rows=rows << halvings,
            estimator=estimator,
            truncation=truncation,
            support_capacity=None
            if support_capacity is None
            else max(1, -(-support_capacity >> halvings)),
        )
        if packed.packed == full.packed and packed.cut == full.cut:
            return packed
    return full
