"""Byte-level tokenizer and chat template: text to token ids and back, with nothing to download.

Ids 0..255 are the bytes of the text's UTF-8 encoding; the special tokens follow them, so the
vocabulary is `VOCAB` = 260 ids, `TransformerConfig`'s default. Text never encodes to a special
token: a message whose content spells "<|im_end|>" encodes those ten bytes, so content cannot forge
the template's structure.

The chat template is ChatML's, opened by `<bos>`:

    <bos><|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n...

and a generation prompt ends the encoding with `<|im_start|>assistant\\n`. Each message's encoding
depends only on the message, so a conversation's encoding (with its generation prompt) is a prefix
of the encoding after the assistant's reply and the next message are appended. A reply sampled
with `<|im_end|>` as its stop token is therefore the tokens between one turn's prompt and the
next but for the newline the template writes after `<|im_end|>`, so a source that appends that
newline and the next message keeps the turns of a multi-turn session in one chain
(`dew.objectives.rl.sessions.chains`), as long as the reply's bytes are valid UTF-8 (invalid bytes
decode to U+FFFD and encode differently).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

BOS = 256
EOS = 257
IM_START = 258
IM_END = 259
SPECIAL_TOKENS: Mapping[int, str] = {
    BOS: "<bos>",
    EOS: "<eos>",
    IM_START: "<|im_start|>",
    IM_END: "<|im_end|>",
}
VOCAB = 260

_NEWLINE = ord("\n")
_GENERATION_ROLE = "assistant"


def encode(text: str) -> np.ndarray:
    """The token ids of `text`: its UTF-8 bytes, never a special token.

    Returns:
        int32[bytes].

    Raises:
        TypeError: if `text` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def _check_ids(ids, who: str) -> np.ndarray:
    array = np.asarray(ids)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(
            f"{who}: ids must be a 1-D integer array, got {array.dtype}[{array.shape}]"
        )
    bad = np.flatnonzero((array < 0) | (array >= VOCAB))
    if bad.size:
        position = int(bad[0])
        raise ValueError(
            f"{who}: id {int(array[position])} at position {position} is outside the "
            f"vocabulary [0, {VOCAB})"
        )
    return array.astype(np.int32)


def _text(byte_ids: np.ndarray) -> str:
    return byte_ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def decode(ids, *, skip_special: bool = False) -> str:
    """The text of token ids: bytes decoded as UTF-8, special tokens by name.

    Args:
        ids: 1-D integer ids in [0, VOCAB).
        skip_special: leave special tokens out instead of writing their names.

    Returns:
        The text; byte runs that are not valid UTF-8 decode to U+FFFD.

    Raises:
        ValueError: naming the position of an id outside the vocabulary.
    """
    array = _check_ids(ids, "decode")
    pieces = []
    start = 0
    for position in np.flatnonzero(array >= 256):
        pieces.append(_text(array[start:position]))
        if not skip_special:
            pieces.append(SPECIAL_TOKENS[int(array[position])])
        start = position + 1
    pieces.append(_text(array[start:]))
    return "".join(pieces)


def _check_message(index: int, message) -> tuple[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise TypeError(
            f"encode_chat: {where} must be a mapping with 'role' and 'content', "
            f"got {type(message).__name__}"
        )
    for field in ("role", "content"):
        if field not in message:
            raise ValueError(f"encode_chat: {where} lacks {field!r}")
    for field in message:
        if field not in ("role", "content"):
            raise ValueError(
                f"encode_chat: {where} has field {field!r}; only 'role' and 'content' are encoded"
            )
    role, content = message["role"], message["content"]
    if not isinstance(role, str) or not role or "\n" in role:
        raise ValueError(
            f"encode_chat: {where}.role must be a non-empty str without newlines, got {role!r}"
        )
    if not isinstance(content, str):
        raise TypeError(f"encode_chat: {where}.content must be a str, got {type(content).__name__}")
    return role, content


def encode_chat(messages: Sequence[Mapping[str, str]], *, add_generation_prompt=True) -> np.ndarray:
    """The token ids of a conversation under the chat template.

    Args:
        messages: dicts with exactly the fields 'role' (a non-empty str without newlines) and
            'content' (a str).
        add_generation_prompt: end with the opening of an assistant message, for the model to
            complete.

    Returns:
        int32[tokens], starting with `<bos>`.

    Raises:
        TypeError, ValueError: naming the message and field that is wrong.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise TypeError(
            f"encode_chat: messages must be a sequence of dicts, got {type(messages).__name__}"
        )
    pieces = [np.array([BOS], np.int32)]
    for index, message in enumerate(messages):
        role, content = _check_message(index, message)
        pieces += [
            np.array([IM_START], np.int32),
            encode(role + "\n" + content),
            np.array([IM_END, _NEWLINE], np.int32),
        ]
    if add_generation_prompt:
        pieces += [np.array([IM_START], np.int32), encode(_GENERATION_ROLE + "\n")]
    return np.concatenate(pieces)


def _describe(array: np.ndarray, position: int) -> str:
    token = int(array[position])
    name = SPECIAL_TOKENS.get(token, repr(chr(token)))
    return f"token {token} ({name}) at position {position}"


def parse_chat(ids) -> list[dict[str, str]]:
    """The messages of chat-template token ids: the inverse of `encode_chat`.

    `parse_chat(encode_chat(messages, add_generation_prompt=False)) == messages`. A last message
    left open, as a generation prompt or a reply cut off before `<|im_end|>` leaves it, comes back
    with the content so far: parsing a prompt followed by its completion gives the reply as the
    last message whether or not the reply finished.

    Args:
        ids: 1-D integer ids; a leading `<bos>` is optional.

    Returns:
        The messages, as dicts with 'role' and 'content'.

    Raises:
        ValueError: naming the position and token where the ids leave the template.
    """
    array = _check_ids(ids, "parse_chat")
    end = len(array)
    position = 1 if end and array[0] == BOS else 0
    messages = []
    while position < end:
        index = len(messages)
        if array[position] != IM_START:
            raise ValueError(
                f"parse_chat: {_describe(array, position)} is outside a message; "
                f"expected <|im_start|> to open messages[{index}]"
            )
        header = position + 1
        newline = header
        while newline < end and array[newline] != _NEWLINE:
            if array[newline] >= 256:
                raise ValueError(
                    f"parse_chat: {_describe(array, newline)} is inside messages[{index}]'s role"
                )
            newline += 1
        if newline == end or newline == header:
            raise ValueError(
                f"parse_chat: messages[{index}] opened at position {position} has no role "
                "ended by a newline"
            )
        closing = newline + 1
        while closing < end and array[closing] < 256:
            closing += 1
        if closing < end and array[closing] != IM_END:
            raise ValueError(
                f"parse_chat: {_describe(array, closing)} is inside messages[{index}]'s content; "
                "expected <|im_end|>"
            )
        messages.append(
            {"role": _text(array[header:newline]), "content": _text(array[newline + 1 : closing])}
        )
        position = closing + 1
        if position < end:
            if array[position] != _NEWLINE:
                raise ValueError(
                    f"parse_chat: {_describe(array, position)} follows messages[{index}]'s "
                    "<|im_end|>; expected a newline"
                )
            position += 1
    return messages
