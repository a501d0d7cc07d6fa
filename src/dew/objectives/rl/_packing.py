"""Fixed-shape packing of admitted groups, and the metrics of a step's sessions.

The objective compiles once for one `[rows, width]` shape, so every step's rollouts are laid into
that shape: each chain of a training rollout is one *segment* of a row (positions restart at 0,
attention stays inside it), groups go in whole, in admission order, or are *cut* and counted. A
group is the unit because its advantages are relative to each other: training half a group would
train on a baseline its other half set.

Public through `dew.objectives.rl.sessions`, which re-exports `Cut`, `Packed`, `pack` and
`session_metrics` at its end; this module imports from it, never the other way round at import
time.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from dew.objectives.rl.sessions import (
    ESTIMATORS,
    TRUNCATION,
    TRUNCATION_REASONS,
    Session,
    Status,
    _fail,
    chains,
    merge_ratio,
)

CUT_REASONS = ("no_room", "too_long", "support")
PACKABLE = (Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED)
_EPSILON = 1e-6  # keeps GRPO's division finite for a group with a tiny reward spread


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


@attrs.frozen(eq=False)
class _Piece:
    """One chain of a training rollout, ready to lay into a row.

    Args:
        tokens, logprobs, versions: the chain's arrays.
        loss_mask: bool[L], the chain's trained positions but its first.
        advantage: its rollout's advantage.
        support_at: int32[K], the position in the chain of each kept support token.
        support_tokens: int32[K], the kept token ids, position by position.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray
    advantage: float
    support_at: np.ndarray
    support_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


# Shared by every piece without support (read-only).
_NO_SUPPORT = np.zeros(0, np.int32)


def _trains(session: Session, truncation: str) -> bool:
    """Whether a session carries loss weight under a truncation policy."""
    if session.status is Status.TRUNCATED:
        return truncation != "mask"
    return session.status in (Status.COMPLETED, Status.AGENT_ERROR)


def _training_reward(session: Session, truncation: str) -> float:
    """The reward a training session trains on under a truncation policy.

    Raises:
        SessionError: a TRUNCATED session without a reward under `score`.
    """
    if session.status is Status.TRUNCATED and truncation == "zero":
        return 0.0
    if session.reward is None:
        raise _fail(
            session,
            "reward",
            f"is missing on a {session.status.name} session under truncation={truncation!r} "
            "(the scheduler resubmits those as unscored before packing)",
        )
    return float(session.reward)


def _advantages(rewards: np.ndarray, estimator: str) -> np.ndarray:
    """Per-rollout advantages of one group's training rewards, float64[n]."""
    # A group whose rollouts all scored alike says nothing about which did better; exact zeros
    # keep rounding in the mean from turning into a spurious signal.
    if len(rewards) < 2 or np.ptp(rewards) == 0:
        return np.zeros_like(rewards)
    if estimator == "rloo":
        return rewards - (rewards.sum() - rewards) / (len(rewards) - 1)
    centered = rewards - rewards.mean()
    if estimator == "mean":
        return centered
    return centered / (rewards.std() + _EPSILON)


def _pieces(
    group: Sequence[Session], *, estimator: str, truncation: str, support: bool
) -> list[_Piece]:
    """The chains a group trains on, in session and chain order, each with its advantage.

    Raises:
        SessionError: a session pack cannot take (status, or a missing reward).
    """
    for session in group:
        if session.status not in PACKABLE:
            raise _fail(session, "status", f"is {session.status.name}, which pack cannot train")
    training = [s for s in group if _trains(s, truncation)]
    rewards = np.array([_training_reward(s, truncation) for s in training], np.float64)
    pieces = []
    for session, advantage in zip(training, _advantages(rewards, estimator), strict=True):
        for chain in chains(session):
            loss_mask = chain.trained.copy()
            # The first token of a segment has nothing before it to be predicted from.
            loss_mask[:1] = False
            if not loss_mask.any():
                # A segment that trains nothing would only take cells from one that does.
                continue
            at: list[int] = []
            if support and chain.support is not None:
                at = [i for i in np.flatnonzero(loss_mask) if chain.support[i] is not None]
            support_at = support_tokens = _NO_SUPPORT
            if at:
                support_at = np.repeat(np.array(at, np.int32), [len(chain.support[i]) for i in at])
                support_tokens = np.concatenate([chain.support[i] for i in at]).astype(np.int32)
            pieces.append(
                _Piece(
                    tokens=chain.tokens,
                    logprobs=chain.logprobs,
                    versions=chain.versions,
                    loss_mask=loss_mask,
                    advantage=float(advantage),
                    support_at=support_at,
                    support_tokens=support_tokens,
                )
            )
    return pieces


def _fit(
    pieces: Sequence[_Piece], free: np.ndarray, free_support: np.ndarray | None
) -> np.ndarray | None:
    """Best-fit rows for pieces taken in order, or None if one does not fit.

    Each piece goes to the row with the least free width that still holds it (the lowest such
    row on ties), so large gaps stay open for large chains.

    Args:
        pieces: in the order to place them (longest first packs densest).
        free: int64[rows] free cells per row.
        free_support: int64[rows] free support slots per row, or None to ignore support.

    Returns:
        intp[len(pieces)] the row of each piece.
    """
    free = free.copy()
    free_support = None if free_support is None else free_support.copy()
    unusable = np.iinfo(free.dtype).max
    rows = np.empty(len(pieces), np.intp)
    for k, piece in enumerate(pieces):
        fits = free >= len(piece)
        if free_support is not None:
            fits &= free_support >= len(piece.support_at)
        if not fits.any():
            return None
        row = int(np.argmin(np.where(fits, free, unusable)))
        free[row] -= len(piece)
        if free_support is not None:
            free_support[row] -= len(piece.support_at)
        rows[k] = row
    return rows


def _check_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


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
    longest first, each into the fullest row that still holds it) or is cut, and later groups
    may still go in. TRUNCATED rollouts under `mask` take no rows. The result depends only on
    the input.

    Args:
        groups: admitted groups in admission order, each a sequence of checked Sessions of
            status COMPLETED, AGENT_ERROR or TRUNCATED.
        width: cells per row.
        rows: rows in the batch.
        estimator: advantage family over a group's training rollouts: `group` ((r - mean) /
            (std + 1e-6), 0 when all rewards are equal), `mean` (r - mean), `rloo` (r - mean of
            the others, 0 for a lone rollout).
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
    _check_size("width", width)
    _check_size("rows", rows)
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
    if support_capacity is not None:
        _check_size("support_capacity", support_capacity)
    with_support = support_capacity is not None
    # Every group is checked before any is placed, so whether pack raises never depends on fit.
    plans = [
        _pieces(group, estimator=estimator, truncation=truncation, support=with_support)
        for group in groups
    ]

    free = np.full(rows, width, np.int64)
    free_support = np.full(rows, support_capacity, np.int64) if with_support else None
    laid: list[list[_Piece]] = [[] for _ in range(rows)]
    packed: list[int] = []
    cut: list[Cut] = []
    for g, pieces in enumerate(plans):
        if any(len(piece) > width for piece in pieces):
            cut.append(Cut(g, "too_long"))
            continue
        ordered = sorted(pieces, key=lambda piece: -len(piece))
        placement = _fit(ordered, free, free_support)
        if placement is None:
            fits_without_support = with_support and _fit(ordered, free, None) is not None
            cut.append(Cut(g, "support" if fits_without_support else "no_room"))
            continue
        for piece, row in zip(ordered, placement, strict=True):
            laid[row].append(piece)
            free[row] -= len(piece)
            if free_support is not None:
                free_support[row] -= len(piece.support_at)
        packed.append(g)

    batch = _lay_out(laid, width=width, support_capacity=support_capacity)
    return Packed(
        batch=batch,
        packed=tuple(packed),
        cut=tuple(cut),
        fill=float((width * rows - free.sum()) / (width * rows)),
        estimator=estimator,
        truncation=truncation,
    )


def _lay_out(
    laid: list[list[_Piece]], *, width: int, support_capacity: int | None
) -> dict[str, np.ndarray]:
    """The batch arrays of pieces placed per row, left to right in placement order."""
    rows = len(laid)
    batch = {
        "tokens": np.zeros((rows, width), np.int32),
        "positions": np.zeros((rows, width), np.int32),
        "segment_ids": np.zeros((rows, width), np.int32),
        "loss_mask": np.zeros((rows, width), np.float32),
        "advantages": np.zeros((rows, width), np.float32),
        "behavior_logprobs": np.zeros((rows, width), np.float32),
        "versions": np.full((rows, width), -1, np.int32),
    }
    if support_capacity is not None:
        batch["support_tokens"] = np.full((rows, support_capacity), -1, np.int32)
        batch["support_positions"] = np.full((rows, support_capacity), -1, np.int32)
    counting = np.arange(width, dtype=np.int32)
    for r, pieces in enumerate(laid):
        offset = used = 0
        for segment, piece in enumerate(pieces, start=1):
            n = len(piece)
            cells = slice(offset, offset + n)
            batch["tokens"][r, cells] = piece.tokens
            batch["positions"][r, cells] = counting[:n]
            batch["segment_ids"][r, cells] = segment
            batch["loss_mask"][r, cells] = piece.loss_mask
            batch["advantages"][r, cells] = piece.loss_mask * np.float32(piece.advantage)
            batch["behavior_logprobs"][r, cells] = piece.logprobs
            batch["versions"][r, cells] = piece.versions
            if support_capacity is not None:
                k = len(piece.support_at)
                batch["support_positions"][r, used : used + k] = piece.support_at + offset
                batch["support_tokens"][r, used : used + k] = piece.support_tokens
                used += k
            offset += n
    return batch


def _share(count: int, total: int) -> float:
    return count / total if total else 0.0


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def session_metrics(
    sessions: Sequence[Session], packed: Packed, *, version: int | None = None
) -> dict[str, float]:
    """Figures of one step's sessions and their packed batch, for the scheduler's record.

    Every figure is a float and an empty input gives 0.0, so a log always has the same keys
    (but the lag keys, present only with `version`) and never a NaN.

    Args:
        sessions: the step's rollouts.
        packed: their packed batch; its truncation policy decides which sessions are masked.
        version: the trainer's version at consumption, to measure each trained token's lag.

    Returns:
        `merge_ratio`; `status/<status>` shares; `masked/share` (sessions with no loss weight)
        and `masked/<truncation reason>` shares; `reward/mean` (over sessions with a reward)
        and `reward/<component>` means (a component named `mean` is shadowed by the overall
        mean); `latency/p50`, `/p90`, `/p99`, `/max` of finished - submitted (where both are
        stamped); `tokens/trained`; `lag/token_mean` and `lag/token_max` (with `version`);
        `fill`.
    """
    total = len(sessions)
    metrics = {"merge_ratio": merge_ratio(sessions)}
    for status in Status:
        metrics[f"status/{status.value}"] = _share(sum(s.status is status for s in sessions), total)
    masked = [s for s in sessions if not _trains(s, packed.truncation)]
    metrics["masked/share"] = _share(len(masked), total)
    for reason in TRUNCATION_REASONS:
        metrics[f"masked/{reason}"] = _share(sum(s.truncation == reason for s in masked), total)
    for name in sorted({name for s in sessions for name in s.components}):
        metrics[f"reward/{name}"] = _mean(
            [float(s.components[name]) for s in sessions if name in s.components]
        )
    metrics["reward/mean"] = _mean([float(s.reward) for s in sessions if s.reward is not None])
    latencies = [
        s.finished - s.submitted
        for s in sessions
        if s.finished is not None and s.submitted is not None
    ]
    quantiles = np.percentile(latencies, [50, 90, 99]) if latencies else np.zeros(3)
    metrics["latency/p50"], metrics["latency/p90"], metrics["latency/p99"] = map(float, quantiles)
    metrics["latency/max"] = float(max(latencies, default=0.0))
    trained = packed.batch["loss_mask"] > 0
    metrics["tokens/trained"] = float(trained.sum())
    if version is not None:
        lags = version - packed.batch["versions"][trained].astype(np.int64)
        metrics["lag/token_mean"] = float(lags.mean()) if lags.size else 0.0
        metrics["lag/token_max"] = float(lags.max()) if lags.size else 0.0
    metrics["fill"] = float(packed.fill)
    return metrics
