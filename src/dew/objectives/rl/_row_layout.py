"""Where a step's chains go in its `[rows, width]` rows, and the arrays of the rows laid.

`pack` decides which groups a step trains and cuts the rest; this module places their chains:
best fit into the rows' free cells (`_Rows`), a relaying of every chain so far when best fit
leaves no room (`_Layout`, `_fill_rows`), and the batch's arrays of the laid rows (`_lay_out`),
with the support tokens each position kept. Apart from `_packing` because it knows chains only
as lengths and runs: no group, reward or status.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

import attrs
import numpy as np

from dew.objectives.rl._chains import _Run

# One chain of a training rollout, ready to lay into a row: its length, the support tokens it
# keeps, its run, its rollout's advantage. A plain tuple: a step makes one per rollout, and
# building records would cost more than placing them.
_Piece = tuple[int, int, _Run, float]


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
