"""pack and session_metrics: chains laid into fixed rows whole, advantages, truncation, support."""

from __future__ import annotations

import math
from collections import Counter

import attrs
import numpy as np
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from dew.data import Task
from dew.objectives.rl._rewards import uniform_group
from dew.objectives.rl._session_metrics import _percentile
from dew.objectives.rl.sessions import (
    ESTIMATORS,
    TRUNCATION,
    TRUNCATION_REASONS,
    Call,
    Chain,
    Cut,
    Label,
    Session,
    SessionError,
    Status,
    chains,
    check_session,
    pack,
    session_metrics,
)

VOCAB = 40
PACKABLE = (Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED)
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, database=None)


@st.composite
def session_strategy(draw, group: int, sample: int) -> Session:
    """A checked session of random multi-call structure: some calls extend the chain before
    them, others start a new one; some carry support."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    calls, seen = [], None
    for _ in range(draw(st.integers(0, 4))):
        extend = seen is not None and draw(st.booleans())
        context = rng.integers(0, VOCAB, size=draw(st.integers(0, 4)), dtype=np.int32)
        prompt = np.concatenate([seen, context]) if extend else context
        completion = rng.integers(0, VOCAB, size=draw(st.integers(0, 5)), dtype=np.int32)
        support = None
        if draw(st.booleans()):
            support = tuple(
                np.unique(np.append(rng.integers(0, VOCAB, size=rng.integers(0, 4)), token)).astype(
                    np.int32
                )
                for token in completion
            )
        calls.append(
            Call(
                prompt=prompt,
                completion=completion,
                logprobs=-rng.exponential(size=len(completion)).astype(np.float32),
                version=draw(st.integers(0, 3)),
                support=support,
            )
        )
        seen = np.concatenate([prompt, completion])
    status = draw(st.sampled_from(PACKABLE))
    truncated = status is Status.TRUNCATED
    reward = None
    if not truncated or draw(st.booleans()):
        reward = draw(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(-5, 5))
    return check_session(
        Session(
            status=status,
            calls=calls,
            reward=reward,
            truncation=draw(st.sampled_from(TRUNCATION_REASONS)) if truncated else None,
            task=Task(f"task-{group}"),
            label=Label(group, sample, 0),
        )
    )


@st.composite
def groups_strategy(draw, max_groups: int = 5, max_size: int = 4) -> list[list[Session]]:
    return [
        [draw(session_strategy(g, s)) for s in range(draw(st.integers(1, max_size)))]
        for g in range(draw(st.integers(0, max_groups)))
    ]


def scorable(groups: list[list[Session]], truncation: str) -> list[list[Session]]:
    """The groups with a reward on every TRUNCATED session under `score`, as the scheduler
    hands them over (it resubmits the others)."""
    if truncation != "score":
        return groups
    return [
        [s if s.reward is not None else attrs.evolve(s, reward=0.25) for s in g] for g in groups
    ]


def training_reward(session: Session, truncation: str) -> float | None:
    """What a session trains on under a truncation policy; None when it does not train."""
    if session.status is not Status.TRUNCATED:
        return session.reward
    return {"mask": None, "score": session.reward, "zero": 0.0}[truncation]


def reference_advantages(
    rewards: list[float], estimator: str, batch: list[float] | None = None
) -> np.ndarray:
    """One group's advantages by the estimators' definitions (rloo: less the others' mean;
    batch: scaled by the std of `batch`, every training reward packed together, or of the
    group's own when it is packed alone)."""
    r = np.asarray(rewards, np.float64)
    if len(r) < 2 or np.ptp(r) == 0:
        return np.zeros(len(r))
    if estimator == "rloo":
        return np.array([r[i] - np.mean(np.delete(r, i)) for i in range(len(r))])
    if estimator == "mean":
        return r - r.mean()
    if estimator == "batch":
        return (r - r.mean()) / (np.std(r if batch is None else batch) + 1e-6)
    return (r - r.mean()) / (r.std() + 1e-6)


def loss_positions(chain: Chain) -> np.ndarray:
    mask = chain.trained.copy()
    mask[:1] = False
    return mask


def chain_key(chain: Chain, with_support: bool) -> tuple:
    """A chain as pack must lay it: tokens, log-probs, versions, loss mask, kept support."""
    mask = loss_positions(chain)
    kept = ()
    if with_support and chain.support is not None:
        kept = tuple(
            (int(p), chain.support[p].astype(np.int32).tobytes())
            for p in np.flatnonzero(mask)
            if chain.support[p] is not None
        )
    return (
        chain.tokens.tobytes(),
        chain.logprobs.tobytes(),
        chain.versions.tobytes(),
        mask.tobytes(),
        kept,
    )


def laid_segments(batch: dict[str, np.ndarray]) -> Counter:
    """The segments of a batch as chain keys, checking each segment's own layout on the way."""
    found: Counter = Counter()
    for r, ids in enumerate(batch["segment_ids"]):
        used = np.unique(ids[ids > 0])
        assert np.array_equal(used, np.arange(1, len(used) + 1)), "segment ids are 1.. in a row"
        for segment in used:
            where = np.flatnonzero(ids == segment)
            start, stop = int(where[0]), int(where[-1]) + 1
            assert len(where) == stop - start, "a segment is contiguous"
            cells = slice(start, stop)
            assert np.array_equal(batch["positions"][r, cells], np.arange(stop - start))
            mask = batch["loss_mask"][r, cells]
            assert np.isin(mask, [0.0, 1.0]).all()
            advantages = batch["advantages"][r, cells]
            assert np.all(advantages[mask == 0] == 0)
            assert len(np.unique(advantages[mask == 1])) <= 1, "one advantage per rollout"
            kept = ()
            if "support_positions" in batch:
                at, tokens = batch["support_positions"][r], batch["support_tokens"][r]
                inside = (at >= start) & (at < stop)
                kept = tuple(
                    (int(p) - start, tokens[at == p].tobytes()) for p in np.unique(at[inside])
                )
            key = (
                batch["tokens"][r, cells].tobytes(),
                batch["behavior_logprobs"][r, cells].tobytes(),
                batch["versions"][r, cells].tobytes(),
                (mask == 1).tobytes(),
                kept,
            )
            found[key] += 1
    return found


@PROPERTY
@given(
    groups=groups_strategy(),
    width=st.integers(1, 40),
    rows=st.integers(1, 4),
    estimator=st.sampled_from(ESTIMATORS),
    truncation=st.sampled_from(TRUNCATION),
    support_capacity=st.none() | st.integers(1, 30),
)
@pytest.mark.medium
def test_each_trained_chain_is_laid_once_whole(
    groups, width, rows, estimator, truncation, support_capacity
):
    groups = scorable(groups, truncation)
    packed = pack(
        groups,
        width=width,
        rows=rows,
        estimator=estimator,
        truncation=truncation,
        support_capacity=support_capacity,
    )
    batch = packed.batch

    with_support = support_capacity is not None
    expected: Counter = Counter()
    for g in packed.packed:
        for session in groups[g]:
            if training_reward(session, truncation) is not None:
                for chain in chains(session):
                    if loss_positions(chain).any():
                        expected[chain_key(chain, with_support)] += 1
    assert laid_segments(batch) == expected

    assert sorted(packed.packed + tuple(c.group for c in packed.cut)) == list(range(len(groups)))
    assert list(packed.packed) == sorted(packed.packed)
    for c in packed.cut:
        longest = max(
            (
                len(chain)
                for s in groups[c.group]
                if training_reward(s, truncation) is not None
                for chain in chains(s)
                if loss_positions(chain).any()
            ),
            default=0,
        )
        assert (c.reason == "too_long") == (longest > width)
        assert c.reason != "support" or with_support

    padding = batch["segment_ids"] == 0
    assert packed.fill == pytest.approx(1 - padding.mean())
    assert np.all(batch["tokens"][padding] == 0)
    assert np.all(batch["loss_mask"][padding] == 0)
    assert np.all(batch["versions"][padding] == -1)
    assert np.all(batch["versions"][batch["loss_mask"] == 1] >= 0)
    assert np.all(batch["loss_mask"][batch["positions"] == 0] == 0)

    shapes = {key: (value.shape, value.dtype) for key, value in batch.items()}
    cells = {"tokens", "positions", "segment_ids", "versions"}
    floats = {"loss_mask", "advantages", "behavior_logprobs"}
    expect_shapes = {k: ((rows, width), np.dtype(np.int32)) for k in cells}
    expect_shapes |= {k: ((rows, width), np.dtype(np.float32)) for k in floats}
    if with_support:
        at = batch["support_positions"]
        expect_shapes |= {
            k: ((rows, support_capacity), np.dtype(np.int32))
            for k in ("support_tokens", "support_positions")
        }
        for r in range(rows):
            used = at[r] >= 0
            n = int(used.sum())
            assert used[:n].all(), "a row's support entries come first"
            assert np.all(np.diff(at[r, :n]) >= 0), "in position order"
            assert np.all(batch["support_tokens"][r, n:] == -1)
            assert np.all(batch["loss_mask"][r, at[r, :n]] == 1), "support only where trained"
    assert shapes == expect_shapes

    again = pack(
        groups,
        width=width,
        rows=rows,
        estimator=estimator,
        truncation=truncation,
        support_capacity=support_capacity,
    )
    assert again.packed == packed.packed and again.cut == packed.cut
    for key, value in batch.items():
        np.testing.assert_array_equal(again.batch[key], value)


class Rejected(Exception):
    """The session and field the reference refuses, as pack's SessionError must name them."""

    def __init__(self, session: Session, field: str):
        super().__init__(f"{session.label}: {field}")
        self.session, self.field = session, field


def formula_advantages(
    rewards: list[float], estimator: str, batch: list[float] | None = None
) -> np.ndarray:
    """One group's advantages by its float64 formulas, as pack must give them bit for bit
    (`batch`: every training reward of the pack, in order, for the batch std)."""
    r = np.array(rewards, np.float64)
    if len(r) < 2 or np.ptp(r) == 0:
        return np.zeros_like(r)
    if estimator == "rloo":
        return r - (r.sum() - r) / (len(r) - 1)
    if estimator == "mean":
        return r - r.mean()
    if estimator == "batch":
        return (r - r.mean()) / (np.array(batch, np.float64).std() + 1e-6)
    return (r - r.mean()) / (r.std() + 1e-6)


def batch_rewards(groups, truncation: str) -> list[float]:
    """Every training reward of the groups, in order (those pack would refuse left out: the
    reference raises for them before the batch std matters)."""
    rewards = []
    for group in groups:
        for session in group:
            if session.status is Status.TRUNCATED and truncation == "zero":
                rewards.append(0.0)
            elif session.status is Status.TRUNCATED and truncation == "mask":
                continue
            elif session.reward is not None:
                rewards.append(float(session.reward))
    return rewards


def reference_fit(pieces: list[dict], free: np.ndarray, free_support: np.ndarray | None):
    """Best-fit rows by a pass over every row per piece, or None if one does not fit."""
    free, rows = free.copy(), []
    free_support = None if free_support is None else free_support.copy()
    for piece in pieces:
        fits = free >= len(piece["tokens"])
        if free_support is not None:
            fits &= free_support >= len(piece["support_at"])
        if not fits.any():
            return None
        row = int(np.argmin(np.where(fits, free, np.iinfo(np.int64).max)))
        free[row] -= len(piece["tokens"])
        if free_support is not None:
            free_support[row] -= len(piece["support_at"])
        rows.append(row)
    return rows


def reference_pieces(group, *, estimator, truncation, with_support, batch=None) -> list[dict]:
    """A group's trained chains, each with its arrays, advantage and kept support.

    Raises:
        Rejected: the group's first session pack must refuse, statuses before rewards.
    """
    for session in group:
        if session.status not in PACKABLE:
            raise Rejected(session, "status")
    training = [s for s in group if s.status is not Status.TRUNCATED or truncation != "mask"]
    rewards = []
    for session in training:
        if session.status is Status.TRUNCATED and truncation == "zero":
            rewards.append(0.0)
        elif session.reward is None:
            raise Rejected(session, "reward")
        else:
            rewards.append(float(session.reward))
    pieces = []
    advantages = formula_advantages(rewards, estimator, batch)
    for session, advantage in zip(training, advantages, strict=True):
        for chain in chains(session):
            mask = loss_positions(chain)
            if not mask.any():
                continue
            at = []
            if with_support and chain.support is not None:
                at = [p for p in np.flatnonzero(mask) if chain.support[p] is not None]
            pieces.append(
                {
                    "tokens": chain.tokens,
                    "logprobs": chain.logprobs,
                    "versions": chain.versions,
                    "loss_mask": mask,
                    "advantage": np.float32(advantage),
                    "support_at": [p for p in at for _ in chain.support[p]],
                    "support_tokens": [t for p in at for t in chain.support[p]],
                }
            )
    return pieces


def reference_lay_out(laid, *, width, support_capacity) -> dict[str, np.ndarray]:
    """The batch arrays of the pieces laid per row, written slice by slice."""
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
    for r, pieces in enumerate(laid):
        offset = used = 0
        for segment, piece in enumerate(pieces, start=1):
            n = len(piece["tokens"])
            cells = slice(offset, offset + n)
            batch["tokens"][r, cells] = piece["tokens"]
            batch["positions"][r, cells] = np.arange(n)
            batch["segment_ids"][r, cells] = segment
            batch["loss_mask"][r, cells] = piece["loss_mask"]
            batch["advantages"][r, cells] = piece["loss_mask"] * piece["advantage"]
            batch["behavior_logprobs"][r, cells] = piece["logprobs"]
            batch["versions"][r, cells] = piece["versions"]
            if support_capacity is not None:
                k = len(piece["support_at"])
                batch["support_positions"][r, used : used + k] = np.add(piece["support_at"], offset)
                batch["support_tokens"][r, used : used + k] = piece["support_tokens"]
                used += k
            offset += n
    return batch


def by_row(pieces, rows_for, laid):
    """Each row's pieces after `pieces` are added to `laid` at rows `rows_for`."""
    laid = [list(row) for row in laid]
    for piece, row in zip(pieces, rows_for, strict=True):
        laid[row].append(piece)
    return laid


def minimum_bin_slack(pieces, *, width, rows, length):
    """Rows filled one after another, each with the longest piece left and, of the subsets of
    the rest, the one with the largest sum that fits (the first reached, item by item); None
    if pieces are left over."""
    left, laid = list(pieces), []
    for _ in range(rows):
        if not left:
            laid.append([])
            continue
        first, rest = left[0], left[1:]
        room = width - length(first)
        best = {0: ()}  # each reachable sum, and the subset that first reached it
        for i, piece in enumerate(rest):
            for total in sorted(best):
                if total + length(piece) <= room and total + length(piece) not in best:
                    best[total + length(piece)] = best[total] + (i,)
        chosen = set(best[max(best)])
        laid.append([first] + [piece for i, piece in enumerate(rest) if i in chosen])
        left = [piece for i, piece in enumerate(rest) if i not in chosen]
    return None if left else laid


def reference_pack(
    groups, *, width, rows, estimator, truncation, support_capacity, relay=("best_fit", "slack")
):
    """pack written plainly: each group's advantages on their own, each chain's own arrays,
    best fit by a pass over every row (beside the laid chains, else all laid again longest
    first), slices written per piece. Slow, and the yardstick for pack. `relay` names the
    ways of laying all chains again to try, so that tests can find the cases where each of
    them keeps a group.

    Returns:
        (batch, packed, cut as (group, reason) pairs, fill).

    Raises:
        Rejected: the first session, group by group, pack must refuse.
    """
    with_support = support_capacity is not None
    plans = [
        reference_pieces(
            group,
            estimator=estimator,
            truncation=truncation,
            with_support=with_support,
            batch=batch_rewards(groups, truncation),
        )
        for group in groups
    ]
    laid = [[] for _ in range(rows)]

    def length(piece) -> int:
        return len(piece["tokens"])

    def kept(piece) -> int:
        return len(piece["support_at"])

    def fit(pieces, *, support: bool):
        """The rows' pieces with `pieces` beside the laid ones; else all laid again from empty
        rows, best fit longest first, else by minimum bin slack; None if none holds them."""
        free = np.array([width - sum(map(length, row)) for row in laid], np.int64)
        free_support = np.array([(support_capacity or 0) - sum(map(kept, row)) for row in laid])
        rows_for = reference_fit(pieces, free, free_support if support else None)
        if rows_for is not None:
            return by_row(pieces, rows_for, laid)
        if not relay or sum(map(length, pieces)) > free.sum():
            return None
        everything = sorted(
            [piece for row in laid for piece in row] + pieces, key=lambda piece: -length(piece)
        )
        empty = np.full(rows, width, np.int64)
        full_support = np.full(rows, support_capacity or 0, np.int64)
        rows_for = None
        if "best_fit" in relay:
            rows_for = reference_fit(everything, empty, full_support if support else None)
        if rows_for is not None:
            return by_row(everything, rows_for, [[] for _ in range(rows)])
        if "slack" not in relay:
            return None
        relaid = minimum_bin_slack(everything, width=width, rows=rows, length=length)
        if relaid is None or (
            support and max(sum(map(kept, row)) for row in relaid) > support_capacity
        ):
            return None
        return relaid

    packed, cut = [], []
    for g, pieces in enumerate(plans):
        if any(len(piece["tokens"]) > width for piece in pieces):
            cut.append((g, "too_long"))
            continue
        ordered = sorted(pieces, key=lambda piece: -len(piece["tokens"]))
        relaid = fit(ordered, support=with_support)
        if relaid is None:
            fits = with_support and fit(ordered, support=False) is not None
            cut.append((g, "support" if fits else "no_room"))
            continue
        laid = relaid
        packed.append(g)
    batch = reference_lay_out(laid, width=width, support_capacity=support_capacity)
    used = sum(len(piece["tokens"]) for row in laid for piece in row)
    return batch, tuple(packed), tuple(cut), float(used / (width * rows))


@st.composite
def pack_cases(draw) -> tuple[list[list[Session]], dict]:
    """Groups and pack's arguments: cuts of every reason, merged chains with support, and now
    and then a session pack must refuse (a status it cannot train, a reward missing under
    `score`)."""
    groups = draw(groups_strategy(max_groups=6, max_size=5))
    arguments = {
        "width": draw(st.integers(1, 40)),
        "rows": draw(st.integers(1, 4)),
        "estimator": draw(st.sampled_from(ESTIMATORS)),
        "truncation": draw(st.sampled_from(TRUNCATION)),
        "support_capacity": draw(st.none() | st.integers(1, 30)),
    }
    if draw(st.integers(0, 3)):
        groups = scorable(groups, arguments["truncation"])
    if groups and not draw(st.integers(0, 9)):
        g = draw(st.integers(0, len(groups) - 1))
        s = draw(st.integers(0, len(groups[g]) - 1))
        status = draw(st.sampled_from([Status.INFRA_ERROR, Status.CANCELLED]))
        groups[g][s] = attrs.evolve(groups[g][s], status=status)
    return groups, arguments


def assert_packs_as_the_reference(groups: list[list[Session]], arguments: dict) -> None:
    try:
        batch, packed, cut, fill = reference_pack(groups, **arguments)
    except Rejected as rejected:
        task = rejected.session.task.name
        with pytest.raises(SessionError) as raised:
            pack(groups, **arguments)
        assert str(raised.value).startswith(f"task {task!r} {rejected}")
        return
    result = pack(groups, **arguments)
    assert result.packed == packed
    assert tuple((c.group, c.reason) for c in result.cut) == cut
    assert result.fill == fill
    assert result.batch.keys() == batch.keys()
    for name, expected in batch.items():
        assert result.batch[name].dtype == expected.dtype, name
        np.testing.assert_array_equal(result.batch[name], expected, err_msg=name, strict=True)


@pytest.mark.medium
@PROPERTY
@given(case=pack_cases())
def test_pack_lays_out_exactly_what_the_reference_does(case):
    assert_packs_as_the_reference(*case)


def packs_merged_support(case) -> bool:
    groups, arguments = case
    if arguments["support_capacity"] is None:
        return False
    try:
        packed = pack(groups, **arguments)
    except SessionError:
        return False
    return any(
        chain.calls > 1 and chain.support is not None and loss_positions(chain).any()
        for g in packed.packed
        for session in groups[g]
        if training_reward(session, arguments["truncation"]) is not None
        for chain in chains(session)
    )


def cuts_for(reason: str):
    def cuts(case) -> bool:
        try:
            return any(c.reason == reason for c in pack(case[0], **case[1]).cut)
        except SessionError:
            return False

    return cuts


@pytest.mark.parametrize(
    "condition",
    [
        cuts_for("too_long"),
        cuts_for("no_room"),
        cuts_for("support"),
        packs_merged_support,
    ],
    ids=["too_long", "no_room", "support", "merged_support"],
)
def test_the_reference_cases_reach_every_cut_reason_and_merged_chains(condition):
    # The first case found is enough: shrinking it would only cost time.
    case = find(pack_cases(), condition, settings=settings(PROPERTY, phases=[Phase.generate]))
    assert_packs_as_the_reference(*case)


def test_advantages_of_groups_of_many_sizes_match_the_formulas_bit_for_bit():
    # Numpy sums 8 or more rewards pairwise, not in order. Rewards that cancel far above the
    # others make any other order show, even after rounding to float32: 1e17 + 1 is 1e17.
    rng = np.random.default_rng(7)
    sizes = [1, 2, 3, 5, 8, 9, 16, 17, 33, 2, 8, 33]
    groups = []
    for g, size in enumerate(sizes):
        small = rng.choice([1.0, -0.5, 0.1, 3.0], size=size).tolist()
        rewards = rng.permutation([1e17, -1e17, *small[2:]]) if size >= 3 else small
        groups.append([one_call(Status.COMPLETED, float(r), group=g) for r in rewards])
    groups.append([one_call(Status.COMPLETED, 0.5, group=len(sizes)) for _ in range(9)])
    for estimator in ESTIMATORS:
        arguments = {"width": 150, "rows": 3, "estimator": estimator, "truncation": "mask"}
        assert_packs_as_the_reference(groups, arguments | {"support_capacity": None})
        assert pack(groups, **arguments).packed == tuple(range(len(groups)))


@pytest.mark.parametrize("size", [2, 4, 9, 17])
def test_advantages_of_groups_all_of_one_size_match_the_formulas_bit_for_bit(size):
    # Groups of one size take pack's path without indexing; the same cancelling rewards as above.
    rng = np.random.default_rng(size)
    groups = []
    for g in range(5):
        small = rng.choice([1.0, -0.5, 0.1, 3.0], size=size).tolist()
        rewards = rng.permutation([1e17, -1e17, *small[2:]]) if size >= 3 else small
        groups.append([one_call(Status.COMPLETED, float(r), group=g) for r in rewards])
    for estimator in ESTIMATORS:
        arguments = {"width": 5 * size, "rows": 3, "estimator": estimator, "truncation": "mask"}
        assert_packs_as_the_reference(groups, arguments | {"support_capacity": None})


@pytest.mark.parametrize("count", [1, 2, 3, 7, 8, 9, 100, 1001])
def test_latency_percentiles_are_numpys_bit_for_bit(count):
    rng = np.random.default_rng(count)
    latencies = (rng.lognormal(0.0, 2.0, count) * 1e3).round(rng.integers(0, 4)).tolist()
    ordered = sorted(latencies)
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert _percentile(ordered, q) == float(np.percentile(latencies, q))


def test_the_first_group_that_breaks_the_contract_is_named():
    # Group by group, statuses before rewards: pack names what a check in that order meets
    # first, before it places anything.
    unscored = [one_call(Status.COMPLETED, 1.0), one_call(Status.TRUNCATED, None, sample=1)]
    broken = [
        attrs.evolve(one_call(Status.COMPLETED, 1.0, group=1, sample=s), status=Status.CANCELLED)
        for s in range(2)
    ]
    with pytest.raises(SessionError, match=r"task-0' group 0 sample 1 attempt 0: reward"):
        pack([unscored, broken], width=8, rows=1, truncation="score")
    with pytest.raises(SessionError, match=r"task-1' group 1 sample 0 attempt 0: status"):
        pack([broken, unscored], width=8, rows=1, truncation="score")
    with pytest.raises(SessionError, match=r"task-1' group 1 sample 0 attempt 0: status"):
        pack([unscored + broken], width=8, rows=1, truncation="score")


@st.composite
def marked_groups(draw) -> list[list[Session]]:
    """Groups of one-call sessions whose prompt is (group, sample), so each segment says which
    rollout it is, and whose completion is trained."""
    groups = []
    for g in range(draw(st.integers(1, 4))):
        group = []
        for s in range(draw(st.integers(1, 6))):
            status = draw(st.sampled_from(PACKABLE))
            truncated = status is Status.TRUNCATED
            reward = None
            if not truncated or draw(st.booleans()):
                reward = draw(st.sampled_from([0.0, 1.0]) | st.floats(-5, 5))
            n = draw(st.integers(1, 3))
            call = Call(
                prompt=np.array([g, s], np.int32),
                completion=np.full(n, 7, np.int32),
                logprobs=np.full(n, -0.5, np.float32),
                version=0,
            )
            group.append(
                Session(
                    status=status,
                    calls=(call,),
                    reward=reward,
                    truncation="length" if truncated else None,
                    task=Task(f"task-{g}"),
                    label=Label(g, s, 0),
                )
            )
        groups.append(group)
    return groups


def advantages_by_rollout(packed) -> dict[tuple[int, int], float]:
    batch = packed.batch
    found = {}
    starts = (batch["positions"] == 0) & (batch["segment_ids"] > 0)
    for r, p in zip(*np.nonzero(starts), strict=True):
        rollout = (int(batch["tokens"][r, p]), int(batch["tokens"][r, p + 1]))
        assert rollout not in found
        assert batch["loss_mask"][r, p + 1] == 0 and batch["loss_mask"][r, p + 2] == 1
        found[rollout] = float(batch["advantages"][r, p + 2])
    return found


@PROPERTY
@given(
    groups=marked_groups(),
    estimator=st.sampled_from(ESTIMATORS),
    truncation=st.sampled_from(TRUNCATION),
)
def test_advantages_follow_the_estimator_over_training_rollouts(groups, estimator, truncation):
    groups = scorable(groups, truncation)
    packed = pack(groups, width=4 * 6 * 5, rows=4, estimator=estimator, truncation=truncation)
    assert packed.packed == tuple(range(len(groups))) and packed.cut == ()
    found = advantages_by_rollout(packed)

    expected = {}
    for g, group in enumerate(groups):
        training = [
            (s, training_reward(session, truncation))
            for s, session in enumerate(group)
            if training_reward(session, truncation) is not None
        ]
        batch = [training_reward(session, truncation) for one in groups for session in one]
        reference = reference_advantages(
            [reward for _, reward in training], estimator, [r for r in batch if r is not None]
        )
        expected |= {(g, s): a for (s, _), a in zip(training, reference, strict=True)}
        if estimator in ("group", "mean"):
            assert math.fsum(found[g, s] for s, _ in training) == pytest.approx(0, abs=1e-4)
    assert found.keys() == expected.keys()
    for rollout, advantage in expected.items():
        np.testing.assert_allclose(found[rollout], advantage, rtol=1e-5, atol=1e-5)


def one_call(
    status: Status,
    reward: float | None,
    *,
    sample: int = 0,
    group: int = 0,
    length: int = 3,
    support: bool = False,
    version: int = 0,
    truncation: str | None = None,
    **stamps,
) -> Session:
    """A session of one call: a one-token prompt and `length - 1` completion tokens, each
    with three kept support tokens where `support`."""
    completion = np.arange(1, length, dtype=np.int32)
    kept = tuple(np.array([t, 100, 101], np.int32) for t in completion)
    call = Call(
        prompt=np.array([50 + sample], np.int32),
        completion=completion,
        logprobs=np.full(length - 1, -0.25, np.float32),
        version=version,
        support=kept if support else None,
    )
    if status is Status.TRUNCATED and truncation is None:
        truncation = "length"
    return Session(
        status=status,
        calls=(call,),
        reward=reward,
        truncation=truncation,
        task=Task(f"task-{group}"),
        label=Label(group, sample, 0),
        **stamps,
    )


@pytest.mark.parametrize(
    ("truncation", "expected"),
    [
        ("mask", {50: 0.5, 51: -0.5}),
        ("score", {50: 1 / 3, 51: -2 / 3, 52: 1 / 3}),
        ("zero", {50: 2 / 3, 51: -1 / 3, 52: -1 / 3}),
    ],
)
def test_each_truncation_policy_sets_the_masks_and_rewards(truncation, expected):
    group = [
        one_call(Status.COMPLETED, 1.0, sample=0),
        one_call(Status.AGENT_ERROR, 0.0, sample=1),
        one_call(Status.TRUNCATED, 1.0, sample=2),
    ]
    packed = pack([group], width=12, rows=1, estimator="mean", truncation=truncation)
    batch = packed.batch
    starts = np.flatnonzero(batch["positions"][0] == 0)
    starts = starts[batch["segment_ids"][0, starts] > 0]
    found = {int(batch["tokens"][0, p]): float(batch["advantages"][0, p + 1]) for p in starts}
    assert found == pytest.approx(expected)
    assert batch["loss_mask"].sum() == 2 * len(expected)


def test_score_without_a_reward_names_the_rollout():
    group = [one_call(Status.COMPLETED, 1.0), one_call(Status.TRUNCATED, None, sample=3)]
    with pytest.raises(ValueError, match=r"task-0.*group 0 sample 3 attempt 0.*reward"):
        pack([group], width=8, rows=1, truncation="score")
    assert pack([group], width=8, rows=1, truncation="mask").packed == (0,)


def test_a_status_pack_cannot_train_names_the_rollout():
    group = [attrs.evolve(one_call(Status.COMPLETED, 1.0, sample=2), status=Status.INFRA_ERROR)]
    with pytest.raises(SessionError, match=r"task-0.*sample 2.*status.*INFRA_ERROR"):
        pack([group], width=8, rows=1)


def test_a_cut_group_does_not_stop_later_ones():
    groups = [
        [one_call(Status.COMPLETED, 1.0, length=5, group=0)],
        [one_call(Status.COMPLETED, 1.0, length=8, group=1)],
        [one_call(Status.COMPLETED, 1.0, length=11, group=2)],
        [one_call(Status.COMPLETED, 1.0, length=4, group=3)],
    ]
    packed = pack(groups, width=10, rows=1)
    assert packed.packed == (0, 3)
    assert packed.cut == (Cut(1, "no_room"), Cut(2, "too_long"))
    assert packed.fill == pytest.approx(0.9)
    np.testing.assert_array_equal(packed.batch["segment_ids"][0], [1] * 5 + [2] * 4 + [0])


def test_a_group_goes_in_whole_or_not_at_all():
    group = [one_call(Status.COMPLETED, float(s), sample=s, length=6) for s in range(3)]
    packed = pack([group], width=10, rows=2)
    assert packed.packed == () and packed.cut == (Cut(0, "no_room"),)
    assert packed.fill == 0 and not packed.batch["segment_ids"].any()


def test_a_group_is_placed_longest_chain_first():
    group = [
        one_call(Status.COMPLETED, float(s), sample=s, length=n) for s, n in enumerate([3, 3, 7, 7])
    ]
    packed = pack([group], width=10, rows=2)
    assert packed.packed == (0,) and packed.fill == 1.0
    np.testing.assert_array_equal(packed.batch["segment_ids"], [[1] * 7 + [2] * 3] * 2)


def test_a_chain_goes_to_the_fullest_row_that_holds_it():
    groups = [
        [one_call(Status.COMPLETED, 1.0, group=g, length=n)] for g, n in enumerate([4, 7, 3, 6])
    ]
    packed = pack(groups, width=10, rows=2)
    # First fit would put the 3 beside the 4, leaving no row for the 6.
    assert packed.packed == (0, 1, 2, 3) and packed.fill == 1.0
    np.testing.assert_array_equal(
        packed.batch["segment_ids"], [[1] * 4 + [2] * 6, [1] * 7 + [2] * 3]
    )


def test_a_group_that_fits_only_if_earlier_chains_move_lays_them_all_again():
    groups = [
        [one_call(Status.COMPLETED, 1.0, group=0, length=3)],
        [one_call(Status.COMPLETED, 1.0, group=1, length=3)],
        [one_call(Status.COMPLETED, float(s), group=2, sample=s, length=7) for s in range(2)],
    ]
    packed = pack(groups, width=10, rows=2)
    # Beside the 3s, both in the fuller row 0, the second 7 would find no row: laid again
    # longest first, each 7 takes a row and each 3 the gap beside it.
    assert packed.packed == (0, 1, 2) and packed.cut == () and packed.fill == 1.0
    np.testing.assert_array_equal(packed.batch["segment_ids"], [[1] * 7 + [2] * 3] * 2)
    np.testing.assert_array_equal(packed.batch["positions"][:, 7:], [[0, 1, 2]] * 2)
    arguments = {
        "width": 10,
        "rows": 2,
        "estimator": "group",
        "truncation": "mask",
        "support_capacity": None,
    }
    assert_packs_as_the_reference(groups, arguments)
    assert reference_pack(groups, **arguments, relay=())[1] == (0, 1)


@pytest.mark.parametrize(("capacity", "cut"), [(24, ()), (23, (Cut(2, "support"),))])
def test_relaying_keeps_each_row_within_its_support(capacity, cut):
    groups = [
        [one_call(Status.COMPLETED, 1.0, group=0, length=3, support=True)],
        [one_call(Status.COMPLETED, 1.0, group=1, length=3, support=True)],
        [
            one_call(Status.COMPLETED, float(s), group=2, sample=s, length=7, support=True)
            for s in range(2)
        ],
    ]
    # Laid again, each row holds a 7 and a 3: 6 and 2 trained positions, 3 kept tokens each.
    arguments = {
        "width": 10,
        "rows": 2,
        "estimator": "group",
        "truncation": "mask",
        "support_capacity": capacity,
    }
    assert pack(groups, **arguments).cut == cut
    assert_packs_as_the_reference(groups, arguments)


def test_chains_best_fit_cannot_hold_fill_the_rows_one_by_one():
    lengths = [5, 4, 4, 3, 2, 2]
    group = [
        one_call(Status.COMPLETED, float(s), sample=s, length=n) for s, n in enumerate(lengths)
    ]
    # Best fit, longest first: 5 and 4 in row 0, then 4, 3 and 2 in row 1, and 1 cell left in
    # each for the last 2. Row by row: 5 with the 3 and 2 that fill it, then 4, 4 and 2.
    packed = pack([group], width=10, rows=2)
    assert packed.packed == (0,) and packed.fill == 1.0
    np.testing.assert_array_equal(
        packed.batch["segment_ids"], [[1] * 5 + [2] * 3 + [3] * 2, [1] * 4 + [2] * 4 + [3] * 2]
    )
    arguments = {
        "width": 10,
        "rows": 2,
        "estimator": "group",
        "truncation": "mask",
        "support_capacity": None,
    }
    assert_packs_as_the_reference([group], arguments)
    assert reference_pack([group], **arguments, relay=("best_fit",))[1] == ()


def test_support_that_does_not_fit_cuts_its_group():
    groups = [
        [one_call(Status.COMPLETED, 1.0, group=0, length=2, support=True)],
        [one_call(Status.COMPLETED, 1.0, group=1, length=2, support=True)],
        [one_call(Status.COMPLETED, 1.0, group=2)],
    ]
    packed = pack(groups, width=20, rows=1, support_capacity=5)
    assert packed.packed == (0, 2)
    assert packed.cut == (Cut(1, "support"),)
    np.testing.assert_array_equal(packed.batch["support_positions"][0], [1, 1, 1, -1, -1])
    np.testing.assert_array_equal(packed.batch["support_tokens"][0], [1, 100, 101, -1, -1])

    unsupported = pack(groups, width=20, rows=1)
    assert unsupported.packed == (0, 1, 2)
    assert "support_tokens" not in unsupported.batch


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("width", 0),
        ("rows", -1),
        ("rows", 2.0),
        ("estimator", "ppo"),
        ("truncation", "drop"),
        ("support_capacity", 0),
    ],
)
def test_bad_arguments_are_named(argument, value):
    arguments = {"width": 8, "rows": 1} | {argument: value}
    with pytest.raises(ValueError, match=rf"{argument}.*{value!r}"):
        pack([], **arguments)


def test_session_metrics_of_a_known_step():
    sessions = [
        one_call(
            Status.COMPLETED,
            1.0,
            sample=0,
            version=3,
            components={"format": 1.0},
            submitted=0.0,
            finished=10.0,
        ),
        one_call(Status.AGENT_ERROR, 0.0, sample=1, version=5, submitted=5.0, finished=25.0),
        one_call(Status.TRUNCATED, None, sample=2, truncation="context", finished=4.0),
        one_call(Status.TRUNCATED, 0.5, sample=3, components={"format": 0.0}),
    ]
    packed = pack([sessions], width=6, rows=1)
    metrics = session_metrics(sessions, packed, version=6)

    assert metrics["merge_ratio"] == 0.0
    assert metrics["status/completed"] == metrics["status/agent_error"] == 0.25
    assert metrics["status/truncated"] == 0.5
    assert metrics["status/infra_error"] == metrics["status/cancelled"] == 0.0
    assert metrics["masked/share"] == 0.5
    assert metrics["masked/context"] == metrics["masked/length"] == 0.25
    assert metrics["masked/turns"] == metrics["masked/wall_clock"] == 0.0
    assert metrics["reward/mean"] == pytest.approx(0.5)
    assert metrics["reward/format"] == 0.5
    assert metrics["latency/p50"] == 15.0
    assert metrics["latency/p90"] == pytest.approx(19.0)
    assert metrics["latency/max"] == 20.0
    assert metrics["tokens/trained"] == 4.0
    assert metrics["lag/token_mean"] == 2.0 and metrics["lag/token_max"] == 3.0
    assert metrics["fill"] == 1.0

    masked_by_none = session_metrics(sessions, pack([sessions], width=8, rows=2, truncation="zero"))
    assert masked_by_none["masked/share"] == masked_by_none["masked/context"] == 0.0
    assert masked_by_none["tokens/trained"] == 8.0
    assert "lag/token_mean" not in masked_by_none


def test_session_metrics_of_nothing_leave_every_undefined_figure_out():
    """A mean, share or quantile over nothing is left out, not made 0.0 (a reward of 0 that
    no session had): only the counts remain."""
    metrics = session_metrics([], pack([], width=4, rows=2), version=0)
    assert metrics == {"tokens/trained": 0.0, "fill": 0.0}


def seated_group(rewards: list[dict[str, float]], seats: list[str | None]) -> list[Session]:
    """A group of sessions, each making one call per entry of `seats` (a chain each: no prompt
    extends another's), seat by seat, and giving the seats in its entry of `rewards` rewards of
    their own; every session's own reward is its sample number."""
    group = []
    for sample, seat_rewards in enumerate(rewards):
        calls = tuple(
            Call(
                prompt=np.array([10 + 4 * sample + k], np.int32),
                completion=np.array([1, 2], np.int32),
                logprobs=np.full(2, -0.25, np.float32),
                version=0,
                seat=seat,
            )
            for k, seat in enumerate(seats)
        )
        session = Session(
            Status.COMPLETED, calls, float(sample), seats=seat_rewards, task=Task("t"),
            label=Label(0, sample, 0),
        )  # fmt: skip
        group.append(check_session(session))
    return group


def advantages_by_prompt(packed) -> dict[int, float]:
    """Each laid chain's advantage by its one prompt token."""
    batch = packed.batch
    starts = (batch["positions"] == 0) & (batch["segment_ids"] > 0)
    return {
        int(batch["tokens"][r, p]): float(batch["advantages"][r, p + 1])
        for r, p in zip(*np.nonzero(starts), strict=True)
    }


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_a_seat_trains_on_its_own_reward_against_its_seat_in_the_group(estimator):
    """Seat "solver" trains on its rewards over the group's solvers, seat "judge" (no reward
    of its own) trains on nothing, and a call of no seat on its session's reward."""
    rewards = [{"solver": 1.0}, {"solver": 0.0}, {"solver": 0.5}]
    group = seated_group(rewards, ["solver", "judge", None])
    packed = pack([group], width=64, rows=4, estimator=estimator)
    found = advantages_by_prompt(packed)
    solver = reference_advantages([1.0, 0.0, 0.5], estimator)
    own = reference_advantages([0.0, 1.0, 2.0], estimator)  # the sessions' rewards
    expected = {}
    for sample in range(3):
        expected[10 + 4 * sample] = solver[sample]
        expected[10 + 4 * sample + 2] = own[sample]
    assert found.keys() == expected.keys()  # no judge chain laid
    for prompt, advantage in expected.items():
        np.testing.assert_allclose(found[prompt], advantage, rtol=1e-5, atol=1e-6)


def test_numbered_seats_of_one_agent_share_one_baseline_over_the_group():
    """Best-of-n's attempts `agent.0` and `agent.1` of two rollouts: one pool of four."""
    rewards = [{"agent.0": 1.0, "agent.1": 0.0}, {"agent.0": 0.5, "agent.1": 0.0}]
    group = seated_group(rewards, ["agent.0", "agent.1"])
    found = advantages_by_prompt(pack([group], width=64, rows=4))
    pooled = reference_advantages([1.0, 0.0, 0.5, 0.0], "group")
    expected = {10: pooled[0], 11: pooled[1], 14: pooled[2], 15: pooled[3]}
    assert found.keys() == expected.keys()
    for prompt, advantage in expected.items():
        np.testing.assert_allclose(found[prompt], advantage, rtol=1e-5, atol=1e-6)


def test_a_group_is_uniform_only_when_each_seat_scored_alike_too():
    alike = seated_group([{"solver": 1.0}, {"solver": 1.0}], ["solver"])
    apart = seated_group([{"solver": 1.0}, {"solver": 0.0}], ["solver"])
    # Their sessions' own rewards (0 and 1) differ, so make them alike to isolate the seats.
    same = [attrs.evolve(s, reward=1.0) for s in alike]
    assert uniform_group(same, "mask")
    assert not uniform_group([attrs.evolve(s, reward=1.0) for s in apart], "mask")


def test_seats_go_into_a_trace_and_come_back():
    from dew.replay._format import _encode_session
    from dew.replay._trace import _decode_session, _Line

    session = seated_group([{"solver": 1.0, "critic": -0.5}], ["solver", None])[0]
    encoded = _encode_session(session)
    back = _decode_session(_Line("t.trace", 1, encoded), encoded)
    assert back.seats == {"solver": 1.0, "critic": -0.5}
    assert [call.seat for call in back.calls] == ["solver", None]
    bad = {**encoded, "seats": {"solver": "one"}}
    with pytest.raises(ValueError, match="seat 'solver'"):
        _decode_session(_Line("t.trace", 1, bad), bad)
