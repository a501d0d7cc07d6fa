"""Rows as narrow as a batch's tokens (issue 42 item 2): `pack_narrow` packs a batch into the
narrowest of `width`, width / 2, ... width / 2**NARROWINGS that holds the same groups, with as
many times more rows, and `RolloutScheduler(narrow=True)` (as `dew train` builds it) hands the
trainer those rows. A row's attention costs its width squared: a batch of short chains laid in
rows of the run's longest chain paid for that chain, in compute and in memory.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from _scripted import OBJECTIVE, ROWS, WIDTH, Engine, Plan, Scripted, dataset
from dew.objectives.rl._packing import NARROWINGS, pack_narrow
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import ESTIMATORS, TRUNCATION, Call, Session, Status, pack
from test_pack import PROPERTY, groups_strategy, laid_segments, scorable
from test_scheduler import train


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
def test_a_narrowed_batch_trains_the_same_chains_as_the_full_width(
    groups, width, rows, estimator, truncation, support_capacity
):
    groups = scorable(groups, truncation)
    arguments = dict(estimator=estimator, truncation=truncation, support_capacity=support_capacity)
    full = pack(groups, width=width, rows=rows, **arguments)
    narrow = pack_narrow(groups, width=width, rows=rows, **arguments)
    got_rows, got_width = narrow.batch["tokens"].shape
    halvings = (got_rows // rows).bit_length() - 1
    assert got_rows == rows << halvings and got_width == width >> halvings
    assert 0 <= halvings <= NARROWINGS
    assert (narrow.packed, narrow.cut) == (full.packed, full.cut)
    assert laid_segments(narrow.batch) == laid_segments(full.batch)
    # The same cells: the fill, and `constant` aggregation's rows x width, are the full width's.
    assert got_rows * got_width == rows * width and narrow.fill == full.fill


def session(length: int, reward: float) -> Session:
    """A one-call session whose chain is `length` tokens: a 2-token prompt and its reply."""
    completion = np.full(length - 2, 7, np.int32)
    call = Call(np.array([1, 2], np.int32), completion, np.full(length - 2, -1.0, np.float32), 0)
    return Session(Status.COMPLETED, [call], reward=reward)


def test_short_chains_in_wide_rows_pack_into_the_narrowest_rows_that_hold_them():
    groups = [[session(10, 0.0), session(12, 1.0)], [session(9, 1.0), session(11, 0.0)]]
    packed = pack_narrow(groups, width=256, rows=2)
    # 256 / 16 = 16 cells a row, each chain in its own: 32 rows hold the 4 chains.
    assert packed.batch["tokens"].shape == (32, 16)
    assert packed.packed == (0, 1) and packed.cut == ()


def test_a_chain_of_the_full_width_keeps_the_full_width():
    groups = [[session(256, 0.0), session(12, 1.0)]]
    assert pack_narrow(groups, width=256, rows=2).batch["tokens"].shape == (2, 256)


def test_a_narrower_width_that_would_cut_a_group_is_not_taken():
    """Narrowing never cuts a group the full width packs: 4 chains of 40 in 2 rows of 128
    take 4 rows of 64 (one chain a row; 8 rows of 32 would hold none), and 3 chains of 40 in
    one row of 128 stay there (2 rows of 64 hold only 2 of them)."""
    groups = [[session(40, 0.0), session(40, 1.0)], [session(40, 1.0), session(40, 0.0)]]
    packed = pack_narrow(groups, width=128, rows=2)
    assert packed.batch["tokens"].shape == (4, 64)
    assert packed.packed == (0, 1)
    crowded = [[session(40, 0.0), session(40, 1.0), session(40, 0.5)]]
    full = pack(crowded, width=128, rows=1)
    assert full.packed == (0,) and pack_narrow(crowded, width=128, rows=1).batch[
        "tokens"
    ].shape == (1, 128)


async def test_the_scheduler_hands_over_narrow_rows_when_asked(autojump_clock):
    """Two-token replies of the scripted source over rows of 64: narrowed, the trainer gets
    rows of 64 / 16 = 4 cells, 16 times as many, with the proximal log-probs of the same
    tokens as the full width's."""
    results = {}
    for narrow in (False, True):
        engine = Engine()
        source = Scripted(engine, lambda task, label: Plan(tokens=2))
        sched = RolloutScheduler(
            OBJECTIVE,
            source,
            engine,
            width=WIDTH,
            rows=ROWS,
            groups=2,
            ahead=0,
            max_lag=0,
            narrow=narrow,
        )
        async with sched:
            _, batches = await train(sched, dataset(batches=1), 1)
        results[narrow] = batches[0]
    assert results[False]["tokens"].shape == (ROWS, WIDTH)
    assert results[True]["tokens"].shape == (ROWS * 16, WIDTH // 16)
    for name in ("tokens", "proximal_logprobs"):
        plain = np.sort(results[False][name][results[False]["loss_mask"] > 0])
        narrowed = np.sort(results[True][name][results[True]["loss_mask"] > 0])
        np.testing.assert_allclose(narrowed, plain, rtol=1e-6, atol=1e-6)


def test_narrow_must_be_a_bool():
    engine = Engine()
    with pytest.raises(ValueError, match="narrow must be a bool, got 'yes'"):
        RolloutScheduler(OBJECTIVE, Scripted(engine), engine, width=WIDTH, rows=ROWS, narrow="yes")


@pytest.mark.medium
def test_dew_train_builds_a_narrowing_scheduler(monkeypatch, tmp_path):
    """`dew train` asks its scheduler to narrow (its rows are the task's longest chain)."""
    import dew.train._run as run_module

    built = {}

    class Spy(RolloutScheduler):
        def __init__(self, *args, **kwargs):
            built.update(kwargs)
            raise trio.TooSlowError("built")

    monkeypatch.setattr(run_module, "RolloutScheduler", Spy)
    from dew.train import TrainConfig, train

    with pytest.raises(trio.TooSlowError):
        train(TrainConfig(steps=1, batch_size=2, groups=2, tasks=4, eval_every=0), tmp_path / "r")
    assert built["narrow"] is True
