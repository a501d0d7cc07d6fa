"""check_session names task, label and field for each broken part; chains and merge ratio."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.data import Task
from dew.objectives.rl.sessions import (
    Call,
    Label,
    Session,
    SessionError,
    Status,
    chains,
    check_session,
    merge_ratio,
)


def call(prompt, completion, *, version: int = 0, support=None) -> Call:
    completion = np.array(completion, np.int32)
    return Call(
        prompt=np.array(prompt, np.int32),
        completion=completion,
        logprobs=np.full(len(completion), -0.5, np.float32),
        version=version,
        support=support,
    )


def good() -> Session:
    """A session that keeps the contract, stamped task-7 / group 3 sample 1 attempt 2."""
    return Session(
        status=Status.COMPLETED,
        calls=(
            call(
                [1, 2],
                [3, 4],
                version=2,
                support=(np.array([3, 9], np.int32), np.array([4], np.int32)),
            ),
        ),
        reward=1.0,
        components={"format": 1.0},
        task=Task("task-7"),
        label=Label(3, 1, 2),
    )


def broken_call(**changes) -> Session:
    session = good()
    return attrs.evolve(session, calls=(attrs.evolve(session.calls[0], **changes),))


BROKEN = {
    "non-int32 prompt": (
        "calls[0].prompt",
        lambda: broken_call(prompt=np.array([1, 2], np.int64)),
    ),
    "2-D completion": (
        "calls[0].completion",
        lambda: broken_call(completion=np.array([[3, 4]], np.int32)),
    ),
    "negative token": (
        "calls[0].completion",
        lambda: broken_call(completion=np.array([3, -4], np.int32)),
    ),
    "logprobs length mismatch": (
        "calls[0].logprobs",
        lambda: broken_call(logprobs=np.array([-0.5], np.float32)),
    ),
    "non-finite logprob": (
        "calls[0].logprobs",
        lambda: broken_call(logprobs=np.array([-0.5, np.nan], np.float32)),
    ),
    "positive logprob": (
        "calls[0].logprobs",
        lambda: broken_call(logprobs=np.array([0.25, -0.5], np.float32)),
    ),
    "negative version": ("calls[0].version", lambda: broken_call(version=-1)),
    "non-int version": ("calls[0].version", lambda: broken_call(version=1.0)),
    "COMPLETED without reward": ("reward", lambda: attrs.evolve(good(), reward=None)),
    "AGENT_ERROR without reward": (
        "reward",
        lambda: attrs.evolve(good(), status=Status.AGENT_ERROR, reward=None),
    ),
    "non-finite reward": ("reward", lambda: attrs.evolve(good(), reward=float("inf"))),
    "bad component": (
        "components['format']",
        lambda: attrs.evolve(good(), components={"format": "high"}),
    ),
    "TRUNCATED without reason": (
        "truncation",
        lambda: attrs.evolve(good(), status=Status.TRUNCATED),
    ),
    "unknown status": ("status", lambda: attrs.evolve(good(), status="finished")),
    "support length mismatch": (
        "calls[0].support",
        lambda: broken_call(support=(np.array([3], np.int32),)),
    ),
    "support lacking the sampled token": (
        "calls[0].support[1]",
        lambda: broken_call(support=(np.array([3], np.int32), np.array([5, 6], np.int32))),
    ),
}


def test_a_good_session_passes():
    session = good()
    assert check_session(session) is session
    truncated = attrs.evolve(session, status=Status.TRUNCATED, reward=None, truncation="turns")
    assert check_session(truncated) is truncated


@pytest.mark.parametrize("broken", list(BROKEN), ids=list(BROKEN))
def test_a_broken_field_is_named_with_task_and_label(broken):
    field, make = BROKEN[broken]
    with pytest.raises(SessionError) as raised:
        check_session(make())
    message = str(raised.value)
    assert "'task-7'" in message
    assert "group 3 sample 1 attempt 2" in message
    assert f": {field} " in message


@pytest.mark.parametrize("length", [2, 33, 500], ids=["short", "just-long", "long"])
@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("prompt", -3, "negative token id -3"),
        ("completion", -1, "negative token id -1"),
        ("logprobs", np.nan, "non-finite log-prob"),
        ("logprobs", -np.inf, "non-finite log-prob"),
        ("logprobs", np.inf, "non-finite log-prob"),
        ("logprobs", 0.5, "positive log-prob 0.5"),
    ],
)
def test_bad_values_are_found_in_calls_of_any_length(length, field, bad, message):
    """Short arrays are checked through Python lists, long ones by numpy: both find the one
    bad value at the end of a call."""
    arrays = {
        "prompt": np.arange(length, dtype=np.int32),
        "completion": np.arange(length, dtype=np.int32),
        "logprobs": np.full(length, -0.5, np.float32),
    }
    assert check_session(broken_call(**arrays, support=None)) is not None
    arrays[field][-1] = bad
    with pytest.raises(SessionError, match=rf"calls\[0\]\.{field} holds a {message}"):
        check_session(broken_call(**arrays, support=None))


def test_not_a_session_is_named_by_its_type():
    with pytest.raises(SessionError, match="returned dict, not a Session"):
        check_session({"status": "completed"})


def test_calls_that_extend_the_chain_merge_and_others_start_one():
    calls = (
        call([1, 2], [3, 4], version=1),
        call([1, 2, 3, 4, 5], [6], version=2),  # extends: adds context 5, completion 6
        call([9], [8], version=2),  # does not extend: a new chain
        call([9, 8], [7], version=3),  # its prompt is exactly the chain so far: merges
        call([1, 2], [3], version=3),  # the first chain's first prompt, not its tokens: new
        call([1], [2], version=3),  # shorter than the chain before it: new
    )
    built = chains(Session(status=Status.COMPLETED, calls=calls, reward=0.0))

    assert [c.calls for c in built] == [2, 2, 1, 1]
    assert [c.tokens.tolist() for c in built] == [[1, 2, 3, 4, 5, 6], [9, 8, 7], [1, 2, 3], [1, 2]]
    first = built[0]
    assert first.trained.tolist() == [False, False, True, True, False, True]
    assert first.versions.tolist() == [-1, -1, 1, 1, -1, 2]
    np.testing.assert_array_equal(first.logprobs, [0, 0, -0.5, -0.5, 0, -0.5])
    assert first.tokens.dtype == np.int32 and first.logprobs.dtype == np.float32
    assert all(c.support is None for c in built)
    assert merge_ratio([Session(status=Status.COMPLETED, calls=calls, reward=0.0)]) == (
        pytest.approx(1 - 4 / 6)
    )


def test_interleaved_conversations_each_merge_into_their_own_chain():
    """The seats of a self-play game take turns: each call extends its own seat's chain, not the
    chain of the call before it."""
    calls = (
        call([1, 2], [3]),  # seat a
        call([7], [8]),  # seat b
        call([1, 2, 3, 4], [5]),  # a again: extends a's chain, the older one
        call([7, 8, 9], [6]),  # b again
        call([1, 2, 3, 4, 5], [0]),  # extends a's chain so far, and so would extend no other
    )
    built = chains(Session(status=Status.COMPLETED, calls=calls, reward=0.0))
    assert [c.tokens.tolist() for c in built] == [[1, 2, 3, 4, 5, 0], [7, 8, 9, 6]]
    assert [c.calls for c in built] == [3, 2]
    # Where two chains would take a call, the latest does.
    twins = (call([1], [2]), call([1], [2]), call([1, 2], [3]))
    latest = chains(Session(status=Status.COMPLETED, calls=twins, reward=0.0))
    assert [c.calls for c in latest] == [1, 2]


def test_support_follows_its_completion_positions():
    kept = (np.array([3, 5], np.int32), np.array([4], np.int32))
    calls = (call([1], [3, 4], support=kept), call([1, 3, 4, 2], [6]))
    (chain,) = chains(Session(status=Status.COMPLETED, calls=calls, reward=0.0))
    assert chain.tokens.tolist() == [1, 3, 4, 2, 6]
    assert chain.support[0] is None and chain.support[3] is None and chain.support[4] is None
    assert chain.support[1] is kept[0] and chain.support[2] is kept[1]


def test_chains_are_cut_once_and_shared():
    single = Session(status=Status.COMPLETED, calls=(call([1], [2]),), reward=0.0)
    merged = Session(
        status=Status.COMPLETED, calls=(call([1], [2]), call([1, 2, 3], [4])), reward=0.0
    )
    for session in (single, merged):
        assert chains(session) is chains(session)


def test_merge_ratio_counts_merged_calls_over_all_sessions():
    single = Session(status=Status.COMPLETED, calls=(call([1], [2]),), reward=0.0)
    merged = Session(
        status=Status.COMPLETED, calls=(call([1], [2]), call([1, 2, 3], [4])), reward=0.0
    )
    assert merge_ratio([]) == 0.0
    assert merge_ratio([Session(status=Status.CANCELLED)]) == 0.0
    assert merge_ratio([single]) == 0.0
    assert merge_ratio([merged]) == 0.5
    assert merge_ratio([single, merged]) == pytest.approx(1 / 3)


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(
    turns=st.lists(
        st.tuples(st.integers(-1, 4), st.integers(0, 3), st.integers(0, 3), st.integers(0, 2**16)),
        max_size=6,
    )
)
def test_chains_keep_every_completion_token_in_order(turns):
    """Each call extends an earlier call's tokens (interleaving conversations) or starts anew;
    the chains hold every call once, each chain its calls' completions in order, as the rule
    says: a call joins the latest chain whose tokens so far its prompt starts with."""
    calls = []
    for parent, context, completion, seed in turns:
        rng = np.random.default_rng(seed)
        new = rng.integers(0, 5, size=context, dtype=np.int32)
        if 0 <= parent < len(calls):
            before = calls[parent]
            new = np.concatenate([before.prompt, before.completion, new])
        calls.append(call(new, rng.integers(0, 5, size=completion)))
    session = Session(status=Status.COMPLETED, calls=calls, reward=0.0)
    built = chains(session)

    expected: list[list[int]] = []
    for index, each in enumerate(calls):
        joined = next(
            (c for c in reversed(expected) if _starts_with(each.prompt, calls[c[-1]])), None
        )
        if joined is None:
            expected.append([index])
        else:
            joined.append(index)
    assert [c.calls for c in built] == [len(members) for members in expected]
    for chain, members in zip(built, expected, strict=True):
        completions = [calls[i].completion for i in members]
        np.testing.assert_array_equal(chain.tokens[chain.trained], np.concatenate(completions))
        assert np.all(chain.versions[~chain.trained] == -1)
        assert np.all(chain.logprobs[~chain.trained] == 0)
    assert merge_ratio([session]) == (1 - len(built) / len(calls) if calls else 0.0)


def _starts_with(prompt: np.ndarray, before: Call) -> bool:
    seen = np.concatenate([before.prompt, before.completion])
    return len(prompt) >= len(seen) and np.array_equal(prompt[: len(seen)], seen)
