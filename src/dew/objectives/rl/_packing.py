"""Fixed-shape packing of admitted groups.

The objective compiles once for one `[rows, width]` shape, so every step's rollouts are laid into
that shape: each chain of a training rollout is one *segment* of a row (positions restart at 0,
attention stays inside it), groups go in whole, in admission order, or are *cut* and counted. A
group is the unit because its advantages are relative to each other: training half a group would
train on a baseline its other half set.

Public through `dew.objectives.rl.sessions`, which re-exports `Cut`, `Packed` and `pack`; this
module builds on `_session`, `_chains` and `_rewards` (each group's advantages), which import
neither it nor `sessions`. The step's figures over what it packed are `_session_metrics`'.
"""

from __future__ import annotations

from bisect import bisect_left, insort
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


# One chain of a training rollout, ready to lay into a row: its length, the support tokens it
# keeps, its run, its rollout's advantage. A plain tuple: a step makes one per rollout, and
# building records would cost more than placing them.
_Piece = tuple[int, int, _Run, float]


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


def _length(piece: _Piece) -> int:
    return piece[0]


@attrs.define(eq=False)
class _Rows:
    """The free cells and support slots of the batch's rows as groups fill them.

    Best fit puts a piece in the row with the least free cells that still holds it (the lowest
    such row on ties), so large gaps stay open for large chains. Every row's key
    `free * count + row` sits in one ascending list, so that row is the first key at or above
    `length * count` whose row has the support room: one bisection, not a pass over every row.

    Args:
        count: rows.
        free: free cells per row.
        free_support: free support slots per row (0 without support: no piece then keeps any).
        order: the rows' keys, ascending.
    """

    count: int
    free: list[int]
    free_support: list[int]
    order: list[int]

    @classmethod
    def empty(cls, *, width: int, count: int, capacity: int) -> _Rows:
        return cls.of([width] * count, [capacity] * count)

    @classmethod
    def of(cls, free: list[int], free_support: list[int]) -> _Rows:
        """Rows with these free cells and support slots."""
        count = len(free)
        return cls(
            count=count,
            free=free,
            free_support=free_support,
            order=sorted(room * count + row for row, room in enumerate(free)),
        )

    def place(self, pieces: Sequence[_Piece], *, support: bool = True) -> list[int] | None:
        """Best-fit rows for a group's pieces taken in order, or None if one does not fit.

        A group goes in whole or not at all: when a piece does not fit, the rows its earlier
        pieces took are given back, and the rows are as before.

        Args:
            pieces: in the order to place them (longest first packs densest).
            support: False to place them as if they kept no support.
        """
        taken: list[int] = []
        for length, kept, _, _ in pieces:
            row = self._take(length, kept if support else 0)
            if row is None:
                self._give_back(pieces[: len(taken)], taken, support=support)
                return None
            taken.append(row)
        return taken

    def fits_without_support(self, pieces: Sequence[_Piece]) -> bool:
        """Whether pieces would fit if they kept no support; leaves the rows as they are."""
        taken = self.place(pieces, support=False)
        if taken is not None:
            self._give_back(pieces, taken, support=False)
        return taken is not None

    def _take(self, length: int, kept: int) -> int | None:
        order, count = self.order, self.count
        i = bisect_left(order, length * count)
        if kept:
            while i < len(order) and self.free_support[order[i] % count] < kept:
                i += 1
        if i == len(order):
            return None
        key = order.pop(i)
        row = key % count
        self.free[row] -= length
        self.free_support[row] -= kept
        insort(order, key - length * count)
        return row

    def _give_back(self, pieces: Sequence[_Piece], taken: Sequence[int], *, support: bool) -> None:
        order, count = self.order, self.count
        for (length, kept, _, _), row in zip(pieces, taken, strict=True):
            key = self.free[row] * count + row
            del order[bisect_left(order, key)]
            insort(order, key + length * count)
            self.free[row] += length
            self.free_support[row] += kept if support else 0


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


@attrs.define(eq=False)
class _Layout:
    """The pieces laid in each row so far, and the rows' free room.

    A group is first placed beside what is laid, best fit, longest chain first: the common case,
    one bisection per chain. When that fails but the rows still have the cells for it, every
    laid chain and the group's are laid again from empty rows: best fit, longest first over all
    of them (placing the earlier groups' chains knowing the later, longer ones leaves far fewer
    gaps too small for anything), and if that too fails, row by row, each row the longest chain
    left and the subset of the others that fills it best (minimum bin slack, which finds the
    near-perfect layouts a batch offered its capacity needs). Only which row a chain goes to and
    where in it changes; which groups go in still follows admission order.

    Args:
        width: cells per row.
        capacity: support slots per row.
        rows: the rows' free room.
        laid: per row, its pieces left to right.
    """

    width: int
    capacity: int
    rows: _Rows
    laid: list[list[_Piece]]

    @classmethod
    def empty(cls, *, width: int, rows: int, capacity: int) -> _Layout:
        return cls(
            width=width,
            capacity=capacity,
            rows=_Rows.empty(width=width, count=rows, capacity=capacity),
            laid=[[] for _ in range(rows)],
        )

    def admit(self, pieces: Sequence[_Piece]) -> bool:
        """Lay a group's pieces (longest first) beside the others, relaying all if need be.

        Returns:
            Whether the group went in; if not, nothing changed.
        """
        taken = self.rows.place(pieces)
        if taken is not None:
            for piece, row in zip(pieces, taken, strict=True):
                self.laid[row].append(piece)
            return True
        relaid = self._relay(pieces, support=True)
        if relaid is None:
            return False
        self.rows, self.laid = relaid
        return True

    def admits_without_support(self, pieces: Sequence[_Piece]) -> bool:
        """Whether a group `admit` refused would go in if its chains kept no support (neither
        way changes anything)."""
        if self.capacity == 0:
            return False
        return self.rows.fits_without_support(pieces) or bool(self._relay(pieces, support=False))

    def _relay(
        self, pieces: Sequence[_Piece], *, support: bool
    ) -> tuple[_Rows, list[list[_Piece]]] | None:
        """The rows and their pieces with every laid piece and `pieces` laid again from empty
        rows, or None if neither way holds them all."""
        if not self._has_room(pieces, support=support):
            return None
        # A stable sort keeps equal lengths in row order, so the result stays a function of the
        # input alone.
        laid = [piece for row in self.laid for piece in row]
        everything = sorted([*laid, *pieces], key=_length, reverse=True)
        rows = _Rows.empty(width=self.width, count=self.rows.count, capacity=self.capacity)
        taken = rows.place(everything, support=support)
        if taken is not None:
            relaid: list[list[_Piece]] = [[] for _ in range(rows.count)]
            for piece, row in zip(everything, taken, strict=True):
                relaid[row].append(piece)
            return rows, relaid
        relaid = _fill_rows(everything, width=self.width, count=self.rows.count)
        if relaid is None:
            return None
        free_support = [self.capacity - sum(kept for _, kept, _, _ in row) for row in relaid]
        if support and min(free_support) < 0:
            return None
        free = [self.width - sum(map(_length, row)) for row in relaid]
        return _Rows.of(free, free_support), relaid

    def _has_room(self, pieces: Sequence[_Piece], *, support: bool) -> bool:
        """Whether the rows' free cells (and support slots) add up to what pieces need: no
        layout can hold them otherwise, so most groups a full batch cuts skip the relaying."""
        if sum(map(_length, pieces)) > sum(self.rows.free):
            return False
        return not support or sum(kept for _, kept, _, _ in pieces) <= sum(self.rows.free_support)


def _fill_rows(pieces: Sequence[_Piece], *, width: int, count: int) -> list[list[_Piece]] | None:
    """Minimum bin slack: `count` rows filled one after another, each with the longest piece
    left and the subset of the rest that fills the row best; None if pieces are left over.

    Args:
        pieces: longest first.
    """
    left = list(pieces)
    laid: list[list[_Piece]] = []
    for _ in range(count):
        if not left:
            laid.append([])
            continue
        first, rest = left[0], left[1:]
        chosen = set(_densest_subset([length for length, _, _, _ in rest], width - first[0]))
        laid.append([first, *(piece for i, piece in enumerate(rest) if i in chosen)])
        left = [piece for i, piece in enumerate(rest) if i not in chosen]
    return None if left else laid


def _densest_subset(lengths: Sequence[int], room: int) -> list[int]:
    """Indices of lengths whose sum is the largest at most `room`.

    A subset-sum table as one Python int, bit s set once some subset sums to s, each sum
    remembering the item that first reached it: the subset is read back from the best sum by
    those items, each earlier than the last, so none twice.
    """
    within = (1 << (room + 1)) - 1
    reached = 1
    first_item: dict[int, int] = {}
    for item, length in enumerate(lengths):
        new = (reached << length) & within & ~reached
        reached |= new
        while new:
            lowest = new & -new
            first_item[lowest.bit_length() - 1] = item
            new ^= lowest
        if reached >> room:
            break
    total, chosen = reached.bit_length() - 1, []
    while total:
        item = first_item[total]
        chosen.append(item)
        total -= lengths[item]
    return chosen


def _lay_out(
    laid: Sequence[Sequence[_Piece]], *, width: int, support_capacity: int | None
) -> dict[str, np.ndarray]:
    """The batch arrays of the pieces laid in each row, left to right in placement order.

    Walked in row order with each row's padding as one more stretch, every array comes out of
    one numpy call over the whole batch (joining the parts' arrays, or repeating a value per
    part or per piece) rather than slices written per piece: a step lays out thousands of
    small chains.
    """
    rows = len(laid)
    # Views of these stand for context and padding.
    blank = np.zeros(width, np.int32)
    silent = np.zeros(width, np.float32)
    tokens: list[np.ndarray] = []  # per part its context, then its completion
    logprobs: list[np.ndarray] = []  # the same stretches
    versions: list[int] = []  # per part
    lengths: list[int] = []  # per piece, then the row's padding
    offsets: list[int] = []
    segments: list[int] = []
    advantages: list[float] = []
    for pieces in laid:
        used = 0
        for segment, (length, _, run, advantage) in enumerate(pieces, start=1):
            for context, call in run:
                tokens += (context, call.completion)
                logprobs += (silent[: len(context)], call.logprobs)
                versions.append(call.version)
            lengths.append(length)
            offsets.append(used)
            segments.append(segment)
            advantages.append(advantage)
            used += length
        # The padding is a part of context only and a piece of segment 0.
        tokens += (blank[: width - used], blank[:0])
        logprobs += (silent[: width - used], silent[:0])
        versions.append(-1)
        lengths.append(width - used)
        offsets.append(used)
        segments.append(0)
        advantages.append(0.0)

    part_lengths = np.fromiter(map(len, tokens), np.intp, len(tokens))
    completion = np.zeros(len(tokens), bool)
    completion[1::2] = True
    part_versions = np.full(len(tokens), -1, np.int32)
    part_versions[1::2] = versions
    segment_ids = np.repeat(np.array(segments, np.int32), lengths)
    positions = np.tile(np.arange(width, dtype=np.int32), rows)
    positions -= np.repeat(np.array(offsets, np.int32), lengths)
    positions[segment_ids == 0] = 0
    # The first token of a segment has nothing before it to be predicted from.
    loss_mask = (np.repeat(completion, part_lengths) & (positions > 0)).astype(np.float32)
    batch = {
        "tokens": np.concatenate(tokens, dtype=np.int32),
        "positions": positions,
        "segment_ids": segment_ids,
        "loss_mask": loss_mask,
        "advantages": loss_mask * np.repeat(np.array(advantages, np.float32), lengths),
        "behavior_logprobs": np.concatenate(logprobs, dtype=np.float32),
        "versions": np.repeat(part_versions, part_lengths),
    }
    if support_capacity is not None:
        batch["support_tokens"], batch["support_positions"] = _support(laid, support_capacity)
    return {name: array.reshape(rows, -1) for name, array in batch.items()}


def _support(laid: Sequence[Sequence[_Piece]], capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's kept support, flat: int32[rows * capacity] token ids and positions in row.

    A row's entries are its pieces' in placement order, each piece's by position: every trained
    position's kept tokens, then -1 in the slots left over.
    """
    unused = np.full(capacity, -1, np.int32)
    tokens: list[np.ndarray] = []  # per kept position its tokens, then a row's unused slots
    at: list[int] = []  # the position in its row of each, -1 for unused slots
    for pieces in laid:
        offset = used = 0
        for length, kept, run, _ in pieces:
            if kept:
                position = offset
                for context, call in run:
                    position += len(context)
                    if call.support is not None:
                        # A segment's first position never trains, so its support is not kept.
                        first = 1 if position == offset else 0
                        at += range(position + first, position + len(call.support))
                        tokens += call.support[first:]
                    position += len(call.completion)
                used += kept
            offset += length
        tokens.append(unused[: capacity - used])
        at.append(-1)
    sizes = np.fromiter(map(len, tokens), np.intp, len(tokens))
    return np.concatenate(tokens, dtype=np.int32), np.repeat(np.array(at, np.int32), sizes)
