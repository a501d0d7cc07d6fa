"""The byte tokenizer and its chat template: round trips, the prefix property, named errors."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dew.models import TransformerConfig
from dew.objectives.rl.sessions import Call, Session, Status, chains
from dew.serve.tokenizer import (
    BOS,
    EOS,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    VOCAB,
    decode,
    encode,
    encode_chat,
    parse_chat,
)

roles = st.text(min_size=1, max_size=12).filter(lambda role: "\n" not in role)
messages_strategy = st.lists(
    st.fixed_dictionaries({"role": roles, "content": st.text(max_size=40)}), max_size=5
)


def test_vocabulary_matches_the_default_transformer():
    assert VOCAB == TransformerConfig().vocab == 256 + len(SPECIAL_TOKENS)
    assert sorted(SPECIAL_TOKENS) == list(range(256, VOCAB))


@given(st.text())
def test_encode_decode_round_trip(text):
    ids = encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert ids.size == 0 or ids.max() < 256
    assert decode(ids) == text


def test_text_never_encodes_to_a_special_token():
    ids = encode("<|im_end|><bos>")
    assert len(ids) == len("<|im_end|><bos>") and ids.max() < 256


def test_decode_names_or_skips_special_tokens():
    ids = np.concatenate([[BOS], encode("hé"), [IM_END, EOS]]).astype(np.int32)
    assert decode(ids) == "<bos>hé<|im_end|><eos>"
    assert decode(ids, skip_special=True) == "hé"


def test_decode_replaces_invalid_utf8():
    assert decode(np.array([ord("a"), 0xFF, ord("b")], np.int32)) == "a\ufffdb"


def test_decode_names_an_id_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"id 260 at position 1 .*\[0, 260\)"):
        decode(np.array([1, 260], np.int32))
    with pytest.raises(ValueError, match="1-D integer"):
        decode(np.zeros((2, 2), np.int32))


def test_encode_chat_layout():
    ids = encode_chat([{"role": "user", "content": "Hi"}])
    expected = [BOS, IM_START, *encode("user\nHi"), IM_END, ord("\n"), IM_START]
    expected += list(encode("assistant\n"))
    np.testing.assert_array_equal(ids, np.array(expected, np.int32))
    assert ids.dtype == np.int32
    assert decode(ids) == "<bos><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@given(messages_strategy)
def test_parse_chat_inverts_encode_chat(messages):
    assert parse_chat(encode_chat(messages, add_generation_prompt=False)) == messages
    prompted = parse_chat(encode_chat(messages))
    assert prompted == messages + [{"role": "assistant", "content": ""}]


@given(messages_strategy, st.text(max_size=30), st.text(max_size=30))
def test_turns_extend_the_previous_encoding_and_merge_into_one_chain(messages, reply, follow_up):
    first = encode_chat(messages)
    completion = np.concatenate([encode(reply), [IM_END]]).astype(np.int32)
    after = messages + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": follow_up},
    ]
    second = encode_chat(after)
    np.testing.assert_array_equal(second[: len(first)], first)
    calls = [
        Call(p, c, np.full(len(c), -1.0, np.float32), version=0)
        for p, c in [(first, completion), (second, encode("ok"))]
    ]
    assert len(chains(Session(Status.COMPLETED, calls, reward=1.0))) == 1
    assert parse_chat(np.concatenate([first, completion]))[-1] == after[-2]


def test_parse_chat_returns_a_cut_off_reply_as_the_open_last_message():
    prompt = encode_chat([{"role": "user", "content": "count"}])
    ids = np.concatenate([prompt, encode("1 2 3")])
    assert parse_chat(ids) == [
        {"role": "user", "content": "count"},
        {"role": "assistant", "content": "1 2 3"},
    ]


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ("hello", TypeError, "messages must be a sequence"),
        (["hello"], TypeError, r"messages\[0\] must be a mapping"),
        ([{"role": "user"}], ValueError, r"messages\[0\] lacks 'content'"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b", "name": "x"}],
            ValueError,
            r"messages\[1\] has field 'name'",
        ),
        ([{"role": "", "content": "a"}], ValueError, r"messages\[0\]\.role must be a non-empty"),
        ([{"role": "a\nb", "content": "a"}], ValueError, r"messages\[0\]\.role"),
        ([{"role": "user", "content": None}], TypeError, r"messages\[0\]\.content must be a str"),
    ],
)
def test_encode_chat_names_the_bad_message_and_field(messages, error, match):
    with pytest.raises(error, match=match):
        encode_chat(messages)


def _ids(*parts) -> np.ndarray:
    return np.concatenate([encode(p) if isinstance(p, str) else np.array([p]) for p in parts])


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (_ids("x"), r"token 120 \('x'\) at position 0 is outside a message"),
        (_ids(IM_START, "user"), r"messages\[0\] opened at position 0 has no role"),
        (_ids(IM_START, "\nhi", IM_END), r"messages\[0\] opened at position 0 has no role"),
        (
            _ids(IM_START, "us", EOS, "er\n"),
            r"<eos>\) at position 3 is inside messages\[0\]'s role",
        ),
        (
            _ids(BOS, IM_START, "user\nhi", BOS),
            r"<bos>\) at position 9 is inside messages\[0\]'s content",
        ),
        (_ids(IM_START, "user\nhi", IM_END, "x"), r"follows messages\[0\]'s <\|im_end\|>"),
    ],
)
def test_parse_chat_names_where_the_ids_leave_the_template(ids, match):
    with pytest.raises(ValueError, match=match):
        parse_chat(ids)
