"""Tokenizers and chat templates: text to token ids and back, and conversations to ids.

`Tokenizer` is what the engine's sources and the gateway need of a tokenizer. Three implement it:

- `ByteTokenizer` (its instance `BYTES`), which needs nothing downloaded: ids 0..255 are the bytes
  of the text's UTF-8 encoding and the special tokens follow them, so its vocabulary is `VOCAB` =
  260 ids, `TransformerConfig`'s default. The module-level `encode`, `decode`, `encode_chat` and
  `parse_chat` are `BYTES`'s.
- `HuggingFaceTokenizer`, a `tokenizers.Tokenizer` (say, a BPE one read from a `tokenizer.json`)
  whose vocabulary holds the template's special tokens.
- `TemplateTokenizer`, a Hugging Face checkpoint folder's tokenizer under the folder's own chat
  template (`TemplateTokenizer.from_folder(folder)`): conversations render byte for byte as
  `transformers`' `apply_chat_template` renders them (`dew.serve.chat_template`), for Qwen2.5,
  Qwen3, Llama 3.x, Mistral and any other template.

Text never encodes to a special token: a message whose content spells "<|im_end|>" encodes those
characters (a `TemplateTokenizer`, whose template's output is tokenized as a whole, refuses such
a message), so content cannot forge the template's structure.

The byte and ChatML tokenizers' chat template is ChatML's, opened by a `<bos>`:

    <bos><|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n...

and a generation prompt ends the encoding with `<|im_start|>assistant\\n`. Each message is encoded
on its own, its role line and its content separately, so an assistant message is exactly the
generation prompt, the content's encoding, `<|im_end|>` (`eos_id`) and the turn suffix (the
newline). A conversation's encoding (with its generation prompt) is therefore a prefix of the
encoding after the assistant's reply and the next message are appended, and a reply sampled with
`eos_id` as its stop token is the tokens between one turn's prompt and the next but for the turn
suffix. A source that appends the suffix and the next message keeps the turns of a multi-turn
session in one chain (`dew.objectives.rl.sessions.chains`).

This module holds the protocol, ChatML's template and the byte and ChatML tokenizers; the
`tokenizers` wrapper both Hugging Face tokenizers build on is `_tokenizer_text`'s, and
`TemplateTokenizer` is `_tokenizer_template`'s, re-exported here.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dew.serve._tokenizer_template import TemplateTokenizer
from dew.serve._tokenizer_text import _checked_ids, _ids, _TokenizersText

__all__ = [
    "BOS",
    "BYTES",
    "EOS",
    "IM_END",
    "IM_START",
    "SPECIAL_TOKENS",
    "VOCAB",
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "TemplateTokenizer",
    "Tokenizer",
    "decode",
    "encode",
    "encode_chat",
    "parse_chat",
]

BOS = 256
"""The byte tokenizer's `<bos>`, which opens a conversation."""
EOS = 257
"""The byte tokenizer's `<eos>` (its chats end turns with `IM_END`, their `eos_id`)."""
IM_START = 258
"""The byte tokenizer's `<|im_start|>`, which opens a turn."""
IM_END = 259
"""The byte tokenizer's `<|im_end|>`, which ends a turn: its `eos_id`."""
SPECIAL_TOKENS: Mapping[int, str] = {
    BOS: "<bos>",
    EOS: "<eos>",
    IM_START: "<|im_start|>",
    IM_END: "<|im_end|>",
}
"""The byte tokenizer's special ids and their names, the ids after the 256 bytes'."""
VOCAB = 260
"""The byte tokenizer's vocabulary size: the 256 bytes and the 4 special tokens."""

_GENERATION_ROLE = "assistant"


@runtime_checkable
class Tokenizer(Protocol):
    """What a source, the engine and the gateway need of a tokenizer: text and chat to ids.

    Attributes:
        vocab_size: every id it returns or accepts is below it.
        eos_id: the stop token that closes an assistant reply (`<|im_end|>`).
        special_ids: the ids that text never encodes to.
    """

    vocab_size: int
    eos_id: int
    special_ids: frozenset[int]

    def encode(self, text: str) -> np.ndarray:
        """int32[n], the ids of `text`; never a special id."""
        ...

    def decode(self, ids, *, skip_special: bool = False) -> str:
        """The text of `ids`, special tokens by name unless `skip_special`."""
        ...

    def chat_prefix(self) -> np.ndarray:
        """int32[n], what the template writes before the first message (the `<bos>`)."""
        ...

    def encode_turn(self, message: Mapping[str, str]) -> np.ndarray:
        """int32[n], one role/content message as the template writes it after an assistant's
        reply, its `eos_id` and `turn_suffix()` (under ChatML, itself ending with those)."""
        ...

    def generation_prompt(self) -> np.ndarray:
        """int32[n], what opens an assistant turn for the model to complete."""
        ...

    def turn_suffix(self) -> np.ndarray:
        """int32[n], what the template writes after `eos_id`."""
        ...

    def encode_chat(self, messages, *, add_generation_prompt: bool = True) -> np.ndarray:
        """int32[n], the conversation under the template, ending with `generation_prompt()`
        when `add_generation_prompt` (under ChatML: `chat_prefix()`, then each message's
        `encode_turn`)."""
        ...


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


class _ChatML(abc.ABC):
    """The ChatML template over a tokenizer's `encode` and its `<bos>`, `<|im_start|>` and
    `<|im_end|>` ids: everything of `Tokenizer` but `encode` and `decode`, which each
    tokenizer defines."""

    vocab_size: int
    eos_id: int
    special_ids: frozenset[int]
    _bos: int | None
    _im_start: int

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """int32 ids of `text`, never a special id."""

    @abc.abstractmethod
    def decode(self, ids, *, skip_special: bool = False) -> str:
        """The text of `ids`; with `skip_special`, special ids are left out."""

    def chat_prefix(self) -> np.ndarray:
        """The ids the template writes before the first message: the `<bos>`, if any."""
        return _ids([] if self._bos is None else [self._bos])

    def generation_prompt(self) -> np.ndarray:
        """The ids that open an assistant turn: `<|im_start|>assistant\\n`."""
        return _ids([self._im_start], self.encode(_GENERATION_ROLE + "\n"))

    def turn_suffix(self) -> np.ndarray:
        """The ids the template writes after a message's `<|im_end|>`: a newline."""
        return self.encode("\n")

    def _turn(self, role: str, content: str) -> np.ndarray:
        return _ids(
            [self._im_start],
            self.encode(role + "\n"),
            self.encode(content),
            [self.eos_id],
            self.turn_suffix(),
        )

    def encode_turn(self, message: Mapping[str, str]) -> np.ndarray:
        """The ids of one message: `<|im_start|>role\\ncontent<|im_end|>\\n`.

        Raises:
            TypeError, ValueError: naming the field that is wrong.
        """
        return self._turn(*_check_message(0, message))

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> np.ndarray:
        """The token ids of a conversation under the chat template.

        Args:
            messages: dicts with exactly the fields 'role' (a non-empty str without newlines)
                and 'content' (a str).
            add_generation_prompt: end with the opening of an assistant message, for the model
                to complete.

        Returns:
            int32[tokens], starting with `chat_prefix()`.

        Raises:
            TypeError, ValueError: naming the message and field that is wrong.
        """
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise TypeError(
                f"encode_chat: messages must be a sequence of dicts, got {type(messages).__name__}"
            )
        pieces = [self.chat_prefix()]
        for index, message in enumerate(messages):
            pieces.append(self._turn(*_check_message(index, message)))
        if add_generation_prompt:
            pieces.append(self.generation_prompt())
        return _ids(*pieces)

    def _check_ids(self, ids, who: str) -> np.ndarray:
        return _checked_ids(ids, self.vocab_size, who)

    def _describe(self, array: np.ndarray, position: int) -> str:
        token = int(array[position])
        name = self.decode([token])
        shown = name if token in self.special_ids else repr(name)
        return f"token {token} ({shown}) at position {position}"

    def parse_chat(self, ids) -> list[dict[str, str]]:
        """The messages of chat-template token ids: the inverse of `encode_chat`.

        `parse_chat(encode_chat(messages, add_generation_prompt=False)) == messages`. A last
        message left open, as a generation prompt or a reply cut off before `<|im_end|>` leaves
        it, comes back with the content so far: parsing a prompt followed by its completion gives
        the reply as the last message whether or not the reply finished.

        Args:
            ids: 1-D integer ids; the leading `chat_prefix()` is optional.

        Returns:
            The messages, as dicts with 'role' and 'content'.

        Raises:
            ValueError: naming the position and token where the ids leave the template.
        """
        array = self._check_ids(ids, "parse_chat")
        prefix, suffix = self.chat_prefix(), self.turn_suffix()
        end = len(array)
        position = len(prefix) if np.array_equal(array[: len(prefix)], prefix) else 0
        messages = []
        while position < end:
            index = len(messages)
            if array[position] != self._im_start:
                raise ValueError(
                    f"parse_chat: {self._describe(array, position)} is outside a message; "
                    f"expected <|im_start|> to open messages[{index}]"
                )
            closing = position + 1
            while closing < end and int(array[closing]) not in self.special_ids:
                closing += 1
            body = self.decode(array[position + 1 : closing])
            role, newline, content = body.partition("\n")
            if not newline and closing < end and array[closing] != self.eos_id:
                raise ValueError(
                    f"parse_chat: {self._describe(array, closing)} is inside "
                    f"messages[{index}]'s role"
                )
            if not (newline and role):
                raise ValueError(
                    f"parse_chat: messages[{index}] opened at position {position} has no role "
                    "ended by a newline"
                )
            if closing < end and array[closing] != self.eos_id:
                raise ValueError(
                    f"parse_chat: {self._describe(array, closing)} is inside messages[{index}]'s "
                    "content; expected <|im_end|>"
                )
            messages.append({"role": role, "content": content})
            position = closing + 1
            if position < end:
                after = array[position : position + len(suffix)]
                if not np.array_equal(after, suffix):
                    raise ValueError(
                        f"parse_chat: {self._describe(array, position)} follows "
                        f"messages[{index}]'s <|im_end|>; expected the turn suffix"
                    )
                position += len(suffix)
        return messages


class ByteTokenizer(_ChatML):
    """The byte-level tokenizer: UTF-8 bytes are ids 0..255, then `<bos>`, `<eos>`,
    `<|im_start|>` and `<|im_end|>` (`SPECIAL_TOKENS`); a `Tokenizer` with nothing to download.

    Use the module's instance `BYTES`.
    """

    vocab_size = VOCAB
    eos_id = IM_END
    special_ids = frozenset(SPECIAL_TOKENS)
    _bos = BOS
    _im_start = IM_START

    def __repr__(self) -> str:
        return "ByteTokenizer()"

    def encode(self, text: str) -> np.ndarray:
        """The token ids of `text`: its UTF-8 bytes, never a special token.

        Returns:
            int32[bytes].

        Raises:
            TypeError: if `text` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids, *, skip_special: bool = False) -> str:
        """The text of token ids: bytes decoded as UTF-8, special tokens by name.

        Args:
            ids: 1-D integer ids in [0, VOCAB).
            skip_special: leave special tokens out instead of writing their names.

        Returns:
            The text; byte runs that are not valid UTF-8 decode to U+FFFD.

        Raises:
            ValueError: naming the position of an id outside the vocabulary.
        """
        array = self._check_ids(ids, "decode")
        pieces = []
        start = 0
        for position in np.flatnonzero(array >= 256):
            pieces.append(_bytes_text(array[start:position]))
            if not skip_special:
                pieces.append(SPECIAL_TOKENS[int(array[position])])
            start = position + 1
        pieces.append(_bytes_text(array[start:]))
        return "".join(pieces)

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes: a byte id's byte (part of a character, maybe), a special
        token's name in UTF-8."""
        token = int(self._check_ids([token], "token_bytes")[0])
        return bytes([token]) if token < 256 else SPECIAL_TOKENS[token].encode()


def _bytes_text(byte_ids: np.ndarray) -> str:
    return byte_ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


BYTES = ByteTokenizer()
"""The byte tokenizer."""

encode = BYTES.encode
"""`BYTES.encode`: text to byte ids."""
decode = BYTES.decode
"""`BYTES.decode`: byte ids to text."""
encode_chat = BYTES.encode_chat
"""`BYTES.encode_chat`: a conversation to ids under ChatML."""
parse_chat = BYTES.parse_chat
"""`BYTES.parse_chat`: ids under ChatML back to the conversation's messages."""


class HuggingFaceTokenizer(_TokenizersText, _ChatML):
    """A Hugging Face `tokenizers.Tokenizer` under the ChatML template (a `Tokenizer`).

    The template's tokens are looked up by name in its vocabulary: `<|im_start|>`, `<|im_end|>`
    (the `eos_id`) and the `bos` token. `encode` never splits text on special tokens, so text
    that spells one encodes as ordinary text; `special_ids` are the tokenizer's added special
    tokens. A checkpoint folder's tokenizer under the folder's own chat template is a
    `TemplateTokenizer` (`from_folder`).

    Args:
        tokenizer: a `tokenizers.Tokenizer`; it is copied, not changed.
        bos: the name of the token that opens a conversation; None for none.

    Raises:
        ValueError: naming a template token missing from the vocabulary, or one that is not an
            added special token (text could encode to it).
    """

    def __init__(self, tokenizer: Any, *, bos: str | None = "<bos>"):
        self._read(tokenizer, "HuggingFaceTokenizer")
        self._im_start = self._special("<|im_start|>", self._vocabulary)
        self.eos_id = self._special("<|im_end|>", self._vocabulary)
        self._bos = None if bos is None else self._special(bos, self._vocabulary)
        self._bos_name = bos

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, bos: str | None = "<bos>"):
        """The tokenizer saved at `path` (a `tokenizer.json`).

        Raises:
            FileNotFoundError: naming the path when there is no file.
            ValueError: naming a template token missing from its vocabulary.
        """
        import tokenizers

        if not os.path.isfile(path):
            raise FileNotFoundError(f"HuggingFaceTokenizer: no tokenizer file at {str(path)!r}")
        return cls(tokenizers.Tokenizer.from_file(os.fspath(path)), bos=bos)

    @staticmethod
    def from_folder(folder: str | os.PathLike, **options: Any) -> TemplateTokenizer:
        """A checkpoint folder's tokenizer under the folder's chat template: the
        `TemplateTokenizer.from_folder(folder, **options)`."""
        return TemplateTokenizer.from_folder(folder, **options)

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer(vocab_size={self.vocab_size}, bos={self._bos_name!r})"

    def _special(self, name: str, vocabulary: Mapping[str, int]) -> int:
        if name not in vocabulary:
            raise ValueError(
                f"HuggingFaceTokenizer: the chat template needs {name!r}, which the tokenizer's "
                "vocabulary lacks; add it as a special token"
            )
        token_id = vocabulary[name]
        if token_id not in self.special_ids:
            raise ValueError(
                f"HuggingFaceTokenizer: {name!r} (id {token_id}) must be a special token, so "
                "that text never encodes to it"
            )
        return token_id
