"""The byte tokenizer and its chat template: round trips, the prefix property, named errors."""

import numpy as np
import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st

from _bpe import train_bpe
from dew.models import TransformerConfig
from dew.objectives.rl.sessions import Call, Session, Status, chains
from dew.serve.tokenizer import (
    BOS,
    BYTES,
    EOS,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    VOCAB,
    HuggingFaceTokenizer,
    Tokenizer,
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


# The Tokenizer protocol, with both implementations.


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return HuggingFaceTokenizer.from_file(train_bpe(tmp_path_factory.mktemp("bpe") / "t.json"))


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def any_tokenizer(request, bpe):
    return BYTES if request.param == "bytes" else bpe


def test_both_implement_the_protocol(bpe):
    assert isinstance(BYTES, Tokenizer) and isinstance(bpe, Tokenizer)
    assert (BYTES.vocab_size, BYTES.eos_id, BYTES.special_ids) == (
        VOCAB,
        IM_END,
        set(SPECIAL_TOKENS),
    )
    assert bpe.vocab_size == 320
    assert bpe.special_ids == {
        bpe.eos_id,
        *bpe.chat_prefix().tolist(),
        int(bpe.generation_prompt()[0]),
    }
    assert not isinstance(object(), Tokenizer)


def test_module_functions_are_the_byte_tokenizers():
    messages = [{"role": "user", "content": "hé"}]
    np.testing.assert_array_equal(encode_chat(messages), BYTES.encode_chat(messages))
    assert decode(BYTES.encode("hé")) == "hé"


def test_bpe_merges_and_round_trips(bpe):
    ids = bpe.encode("the answer is 42")
    assert ids.dtype == np.int32 and 0 < len(ids) < len("the answer is 42")
    assert bpe.decode(ids) == "the answer is 42"


@given(text=st.text(max_size=40))
def test_any_text_round_trips_without_special_ids(any_tokenizer, text):
    ids = any_tokenizer.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert not set(ids.tolist()) & any_tokenizer.special_ids
    assert ids.size == 0 or ids.max() < any_tokenizer.vocab_size
    assert any_tokenizer.decode(ids) == text


def test_text_spelling_a_special_token_encodes_as_text(any_tokenizer):
    ids = any_tokenizer.encode("<|im_end|><bos>")
    assert len(ids) > 2 and not set(ids.tolist()) & any_tokenizer.special_ids
    assert any_tokenizer.decode(ids) == "<|im_end|><bos>"


def test_decode_names_or_skips_special_tokens_of_either(any_tokenizer):
    ids = np.concatenate([any_tokenizer.chat_prefix(), any_tokenizer.encode("hi"), [IM_END]])
    ids[-1] = any_tokenizer.eos_id
    assert any_tokenizer.decode(ids) == "<bos>hi<|im_end|>"
    assert any_tokenizer.decode(ids, skip_special=True) == "hi"
    with pytest.raises(ValueError, match=rf"id {any_tokenizer.vocab_size} at position 0"):
        any_tokenizer.decode([any_tokenizer.vocab_size])


@given(messages=messages_strategy)
def test_encode_chat_is_prefix_turns_and_generation_prompt(any_tokenizer, messages):
    turns = [any_tokenizer.encode_turn(message) for message in messages]
    expected = np.concatenate([any_tokenizer.chat_prefix(), *turns]).astype(np.int32)
    np.testing.assert_array_equal(
        any_tokenizer.encode_chat(messages, add_generation_prompt=False), expected
    )
    prompted = np.concatenate([expected, any_tokenizer.generation_prompt()])
    np.testing.assert_array_equal(any_tokenizer.encode_chat(messages), prompted)
    assert any_tokenizer.encode_chat(messages).dtype == np.int32


@given(content=st.text(max_size=40))
def test_an_assistant_turn_is_the_generation_prompt_reply_eos_and_suffix(any_tokenizer, content):
    tokenizer = any_tokenizer
    expected = np.concatenate(
        [
            tokenizer.generation_prompt(),
            tokenizer.encode(content),
            [tokenizer.eos_id],
            tokenizer.turn_suffix(),
        ]
    )
    turn = tokenizer.encode_turn({"role": "assistant", "content": content})
    np.testing.assert_array_equal(turn, expected)


@given(messages=messages_strategy, reply=st.text(max_size=30), follow_up=st.text(max_size=30))
def test_turns_of_either_tokenizer_merge_into_one_chain(any_tokenizer, messages, reply, follow_up):
    tokenizer = any_tokenizer
    first = tokenizer.encode_chat(messages)
    completion = np.append(tokenizer.encode(reply), tokenizer.eos_id).astype(np.int32)
    after = messages + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": follow_up},
    ]
    second = tokenizer.encode_chat(after)
    np.testing.assert_array_equal(second[: len(first) + len(completion)], [*first, *completion])
    assert tokenizer.parse_chat(second) == after + [{"role": "assistant", "content": ""}]
    assert tokenizer.parse_chat(np.concatenate([first, completion]))[-1] == after[-2]


def test_bpe_parse_chat_names_where_the_ids_leave_the_template(bpe):
    chat = bpe.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    ids = np.concatenate([chat, bpe.encode("x")])
    with pytest.raises(ValueError, match=rf"'x'\) at position {len(ids) - 1} is outside a message"):
        bpe.parse_chat(ids)


def test_from_file_names_a_missing_template_token(tmp_path):
    path = train_bpe(tmp_path / "t.json", specials=["<bos>", "<|im_start|>"])
    with pytest.raises(ValueError, match=r"needs '<\|im_end\|>', which the tokenizer's vocab"):
        HuggingFaceTokenizer.from_file(path)
    with pytest.raises(ValueError, match="needs '<s>'"):
        HuggingFaceTokenizer.from_file(train_bpe(tmp_path / "u.json"), bos="<s>")


def test_without_a_bos_the_chat_has_no_prefix(tmp_path):
    tokenizer = HuggingFaceTokenizer.from_file(
        train_bpe(tmp_path / "t.json", specials=["<|im_start|>", "<|im_end|>"]), bos=None
    )
    assert len(tokenizer.chat_prefix()) == 0
    messages = [{"role": "user", "content": "count to three"}]
    assert tokenizer.parse_chat(tokenizer.encode_chat(messages, add_generation_prompt=False)) == (
        messages
    )


def test_template_tokens_must_be_special(tmp_path):
    path = train_bpe(tmp_path / "t.json", specials=["<bos>", "<|im_start|>"])
    plain = tokenizers.Tokenizer.from_file(str(path))
    plain.add_tokens(["<|im_end|>"])
    with pytest.raises(ValueError, match=r"'<\|im_end\|>' \(id \d+\) must be a special token"):
        HuggingFaceTokenizer(plain)


def test_from_file_and_the_constructor_name_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer file at .*missing.json"):
        HuggingFaceTokenizer.from_file(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="must be a tokenizers.Tokenizer, got str"):
        HuggingFaceTokenizer("t.json")
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        BYTES.encode(b"hi")


@given(text=st.text(max_size=40))
def test_each_tokens_own_bytes_join_into_the_texts_utf8(any_tokenizer, text):
    """A token holding part of a character ("é", an emoji) has that part's bytes, where its
    decoded text alone is U+FFFD (what the gateway reports as a log-prob's `bytes`)."""
    ids = any_tokenizer.encode(text)
    assert b"".join(any_tokenizer.token_bytes(int(t)) for t in ids) == text.encode()


def test_a_special_tokens_bytes_are_its_name_and_an_unknown_id_is_named(any_tokenizer):
    special = min(any_tokenizer.special_ids)
    assert any_tokenizer.token_bytes(special) == any_tokenizer.decode([special]).encode()
    with pytest.raises(ValueError, match="token_bytes"):
        any_tokenizer.token_bytes(any_tokenizer.vocab_size)
