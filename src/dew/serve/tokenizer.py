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
"""

from __future__ import annotations

import abc
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dew._documents import read_document, read_text
from dew.serve.chat_template import SPECIAL_TOKEN_NAMES, ChatTemplate, ChatTemplateError

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


def _ids(*parts) -> np.ndarray:
    return np.concatenate([np.asarray(part, np.int32).reshape(-1) for part in parts]).astype(
        np.int32
    )


def _checked_ids(ids, vocab_size: int, who: str) -> np.ndarray:
    """`ids` as int32, or a ValueError naming `who` and the first id outside the vocabulary."""
    array = np.asarray(ids)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(
            f"{who}: ids must be a 1-D integer array, got {array.dtype}[{array.shape}]"
        )
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if bad.size:
        position = int(bad[0])
        raise ValueError(
            f"{who}: id {int(array[position])} at position {position} is outside the "
            f"vocabulary [0, {vocab_size})"
        )
    return array.astype(np.int32)


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
decode = BYTES.decode
encode_chat = BYTES.encode_chat
parse_chat = BYTES.parse_chat


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the byte each character of a byte-level BPE
    vocabulary stands for (`tokenizers.pre_tokenizers.ByteLevel.alphabet()`)."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [byte for byte in range(256) if byte not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(moved)}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(decoder: Any) -> frozenset[str]:
    """The types of a `tokenizers` decoder and of the decoders a `Sequence` of them holds."""
    if decoder is None:
        return frozenset()
    kinds, todo = set(), [json.loads(decoder.__getstate__())]
    while todo:
        step = todo.pop()
        kinds.add(step.get("type"))
        todo += step.get("decoders") or ()
    return frozenset(kinds)


class _TokenizersText:
    """Text to ids and back through a Hugging Face `tokenizers.Tokenizer`: what the ChatML
    tokenizer and a checkpoint's templated one share.

    Two copies of the tokenizer: one reads text as text, never splitting out a special token
    (`encode`), the other reads a template's output as `transformers` does, where the special
    tokens the template wrote are tokens (`encode_rendered`).
    """

    vocab_size: int
    special_ids: frozenset[int]

    def _read(self, tokenizer: Any, who: str) -> None:
        import tokenizers

        if not isinstance(tokenizer, tokenizers.Tokenizer):
            raise TypeError(
                f"{who}: tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}"
            )
        # Copies, so that how each reads special tokens stays local.
        self._tokenizer = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        self._tokenizer.encode_special_tokens = True
        self._rendered = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        self._rendered.encode_special_tokens = False
        self._vocabulary = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._vocabulary.values()) + 1
        added = self._tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(token_id for token_id, token in added.items() if token.special)
        self._added = frozenset(added)  # their text is their content, not bytes
        self._decoders = _decoder_kinds(self._tokenizer.decoder)

    def encode(self, text: str) -> np.ndarray:
        """The token ids of `text`, read as text even where it spells a special token.

        Returns:
            int32[tokens].

        Raises:
            TypeError: if `text` is not a str.
            ValueError: if the tokenizer's model still produced a special id.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
        ids = np.array(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
        forged = [int(token) for token in ids if int(token) in self.special_ids]
        if forged:
            raise ValueError(
                f"encode: the tokenizer encoded {text!r} to special id {forged[0]}; its model "
                "must not produce special tokens from text"
            )
        return ids

    def encode_rendered(self, text: str) -> np.ndarray:
        """The token ids of a chat template's output, its special tokens read as tokens: what
        `transformers`' `apply_chat_template(..., tokenize=True)` returns for that text.

        Returns:
            int32[tokens].
        """
        if not isinstance(text, str):
            raise TypeError(f"encode_rendered: text must be a str, got {type(text).__name__}")
        return np.array(self._rendered.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids, *, skip_special: bool = False) -> str:
        """The text of token ids, special tokens by name unless `skip_special`.

        Raises:
            ValueError: naming the position of an id outside the vocabulary.
        """
        array = _checked_ids(ids, self.vocab_size, "decode")
        return self._tokenizer.decode(array.tolist(), skip_special_tokens=skip_special)

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes. A byte-level vocabulary (a `ByteLevel` decoder) spells each
        byte as a character of GPT-2's alphabet, and a byte-fallback one (`ByteFallback`)
        spells a byte as `<0xNN>` and a space as `▁`: a token holding part of a multi-byte
        character has that part's bytes, where its decoded text alone would be U+FFFD. An
        added token, or a vocabulary of neither kind, gives its decoded text's UTF-8.
        """
        token = int(_checked_ids([token], self.vocab_size, "token_bytes")[0])
        piece = self._tokenizer.id_to_token(token)
        if piece is not None and token not in self._added:
            if "ByteLevel" in self._decoders and all(char in _BYTE_LEVEL for char in piece):
                return bytes(_BYTE_LEVEL[char] for char in piece)
            if "ByteFallback" in self._decoders:
                byte = _BYTE_FALLBACK.fullmatch(piece)
                return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()
        return self.decode([token]).encode()


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


# The conversation a template is probed with for its fixed pieces (see TemplateTokenizer).
_PROBE_QUESTION = {"role": "user", "content": "dew probe question"}
_PROBE_REPLY = {"role": "assistant", "content": "dew probe reply"}


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a message: its content, its parts, its tool calls' fields."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


class TemplateTokenizer(_TokenizersText):
    """A checkpoint's tokenizer under the checkpoint's own chat template (a `Tokenizer`).

    `encode_chat` renders a conversation with the template (`ChatTemplate.render`, in the
    Jinja environment `transformers` uses) and tokenizes the text as `transformers` does, special
    tokens read as tokens: the ids are `apply_chat_template(..., tokenize=True)`'s. A message
    whose text spells one of the tokenizer's special tokens is refused, since the template's
    output would carry it as structure (a user cannot close a turn by writing `<|im_end|>`).

    The template's fixed pieces are found by rendering a probe conversation (one question, one
    reply), once:

    - `eos_id`: the special token the template writes right after an assistant's reply
      (`<|im_end|>` for Qwen, `<|eot_id|>` for Llama 3, `</s>` for Mistral): the stop token the
      engine samples up to. Where the template writes none, the folder's `eos_token`.
    - `generation_prompt()`: what `add_generation_prompt` adds (`<|im_start|>assistant\\n`;
      nothing for Mistral, whose reply follows `[/INST]`).
    - `turn_suffix()`: what follows the reply's `eos_id` (`\\n` for Qwen, nothing for Llama).
    - `encode_turn(message)`: what the template writes for `message` after an assistant's reply.
    - `chat_prefix()`: the `bos_token`, where the template opens with it.

    Templates are not all incremental: Llama 3.x writes the tools into the first user turn,
    Mistral writes them before the last user turn, Qwen3 drops the reasoning of replies before
    the last question. A session that appends turns (`encode_turn`) keeps what the model saw;
    the gateway, which renders whole conversations, reports where an earlier turn's rendering
    changed (docs/gateway.md).

    Args:
        tokenizer: a `tokenizers.Tokenizer`; it is copied, not changed.
        template: the chat template, with the tokenizer's named special tokens.
        template_kwargs: extra template variables for every rendering (`{"enable_thinking":
            False}` for Qwen3); a call's own keywords override them.
        origin: where the template was read from (its file), named in errors; or None.

    Attributes:
        template: the `ChatTemplate`.
        template_kwargs: the extra variables.
        origin: where the template was read from, or None.
        bos_id, pad_id: the ids of the `bos_token` and `pad_token`, or None.

    Raises:
        ValueError: naming a special token of the template missing from the vocabulary, or a
            template that renders a question as no text (an empty template: every prompt
            would be empty).
    """

    def __init__(
        self,
        tokenizer: Any,
        template: ChatTemplate,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        origin: str | None = None,
    ):
        self._read(tokenizer, "TemplateTokenizer")
        self.origin = origin
        if not isinstance(template, ChatTemplate):
            raise TypeError(
                f"TemplateTokenizer: template must be a ChatTemplate, got {type(template).__name__}"
            )
        self.template = template
        self.template_kwargs = dict(template_kwargs or {})
        for name, text in template.special_tokens.items():
            if text not in self._vocabulary:
                raise ValueError(
                    f"TemplateTokenizer: the {name} {text!r} is not in the tokenizer's vocabulary"
                )
        named = template.special_tokens
        self.bos_id = self._vocabulary[named["bos_token"]] if "bos_token" in named else None
        self.pad_id = self._vocabulary[named["pad_token"]] if "pad_token" in named else None
        texts = [self._tokenizer.id_to_token(token_id) for token_id in self.special_ids]
        self._special_texts = sorted(texts, key=len, reverse=True)
        self._forgery = (
            re.compile("|".join(re.escape(text) for text in self._special_texts))
            if self._special_texts
            else None
        )
        self._probe()

    def _probe(self) -> None:
        """Find `eos_id`, the generation prompt and the turn suffix from a probe conversation."""
        self._generation: str | None = None
        self._suffix: str | None = None
        eos_text = None
        try:
            asked = self.render([_PROBE_QUESTION])
            prompted = self.render([_PROBE_QUESTION], add_generation_prompt=True)
            answered = self.render([_PROBE_QUESTION, _PROBE_REPLY])
        except ChatTemplateError:
            asked = prompted = answered = None
        if prompted == "":
            where = "" if self.origin is None else f" {self.origin}"
            raise ValueError(
                f"TemplateTokenizer: the chat template{where} renders a question with the "
                "generation prompt as no text (is it empty?): every prompt would be empty"
            )
        asked, prompted, answered = asked or "", prompted or "", answered or ""
        if prompted.startswith(asked) and asked:
            self._generation = prompted[len(asked) :]
        reply = _PROBE_REPLY["content"]
        if reply in answered:
            after = answered[answered.rindex(reply) + len(reply) :]
            eos_text = next((t for t in self._special_texts if after.startswith(t)), None)
            if eos_text is not None:
                self._suffix = after[len(eos_text) :]
        if eos_text is None:
            eos_text = self.template.special_tokens.get("eos_token")
        if eos_text is None:
            raise ValueError(
                "TemplateTokenizer: the chat template closes no assistant reply with a special "
                "token, and there is no eos_token: nothing to stop sampling on"
            )
        self.eos_id = self._vocabulary[eos_text]
        self._eos_text = eos_text

    @classmethod
    def from_folder(
        cls,
        folder: str | os.PathLike,
        *,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> TemplateTokenizer:
        """The tokenizer and chat template of a Hugging Face checkpoint folder.

        Reads `tokenizer.json`; the chat template from `chat_template.jinja` (and the named
        ones, such as `tool_use`, from `additional_chat_templates/NAME.jinja`), else the
        `chat_template` field of `tokenizer_config.json` (a string, or a list of named templates
        as older folders have it), else `chat_template.json`; the named special tokens
        (`bos_token`, `eos_token`, `pad_token`, ...) from `tokenizer_config.json`, and those it
        lacks from `generation_config.json`'s `bos_token_id`, `eos_token_id` (the first of a
        list) and `pad_token_id`.

        Args:
            folder: the checkpoint folder.
            chat_template: a template's text to use instead of the folder's (for a base model's
                folder, which ships none).
            template_kwargs: extra template variables for every rendering.

        Raises:
            FileNotFoundError: naming the folder, or the tokenizer.json it lacks.
            ValueError: naming the file and field that is malformed, a special token missing
                from the vocabulary, or a folder without a chat template.
        """
        import tokenizers

        root = os.fspath(folder)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"TemplateTokenizer.from_folder: no folder at {root!r}")
        path = os.path.join(root, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"TemplateTokenizer.from_folder: {root!r} has no tokenizer.json (a folder with "
                "only a slow tokenizer's files can be converted with transformers: "
                "AutoTokenizer.from_pretrained(folder).save_pretrained(folder))"
            )
        try:
            tokenizer = tokenizers.Tokenizer.from_file(path)
        except Exception as error:
            raise ValueError(
                f"TemplateTokenizer.from_folder: {path!r} does not load: {error}"
            ) from None
        config = _json_file(root, "tokenizer_config.json")
        sources, origin = _template_sources(root, config, chat_template)
        special = _special_tokens(root, config, tokenizer)
        try:
            template = ChatTemplate(sources, special)
        except ChatTemplateError as error:
            raise ChatTemplateError(f"{origin}: {error}") from None
        return cls(tokenizer, template, template_kwargs=template_kwargs, origin=origin)

    def __repr__(self) -> str:
        return f"TemplateTokenizer(vocab_size={self.vocab_size}, eos={self._eos_text!r})"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """The template's text of a conversation (`ChatTemplate.render`, with the tokenizer's
        `template_kwargs` under the call's own)."""
        return self.template.render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **{**self.template_kwargs, **kwargs},
        )

    def spelled_special(self, value: Any) -> str | None:
        """The first special token whose text a string inside `value` (a message, a tool)
        spells, or None: the template's output would carry it as structure."""
        if self._forgery is None:
            return None
        for text in _strings(value):
            found = self._forgery.search(text)
            if found:
                return found.group()
        return None

    def check_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Refuse messages and tools whose text spells a special token (`spelled_special`).

        Raises:
            ValueError: naming the message or tool and the token.
        """
        for where, values in (("messages", messages), ("tools", tools or ())):
            for index, value in enumerate(values):
                token = self.spelled_special(value)
                if token is not None:
                    raise ValueError(
                        f"{where}[{index}] spells the special token {token!r}; the chat "
                        "template's output would read it as structure"
                    )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> np.ndarray:
        """The token ids of a conversation under the template: `apply_chat_template(messages,
        tools=tools, add_generation_prompt=..., tokenize=True, **kwargs)`'s.

        Raises:
            ValueError: naming a message that spells a special token, or with the template's
                own message when it refuses the conversation (`ChatTemplateError`).
        """
        self.check_messages(messages, tools=tools)
        text = self.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return self.encode_rendered(text)

    def _piece(self, text: str | None, what: str) -> np.ndarray:
        if text is None:
            raise ValueError(
                f"TemplateTokenizer: the chat template has no fixed {what} (found by rendering "
                "a one-question, one-reply conversation)"
            )
        return self.encode_rendered(text)

    def chat_prefix(self) -> np.ndarray:
        """The `bos_token`'s id where the template opens a conversation with it, else none."""
        bos = self.template.special_tokens.get("bos_token")
        try:
            opens = bos is not None and self.render([_PROBE_QUESTION]).startswith(bos)
        except ChatTemplateError:
            opens = False
        return _ids([self.bos_id] if opens else [])

    def generation_prompt(self) -> np.ndarray:
        """The ids `add_generation_prompt` adds: what opens an assistant's reply."""
        return self._piece(self._generation, "generation prompt")

    def turn_suffix(self) -> np.ndarray:
        """The ids the template writes after an assistant reply's `eos_id`."""
        return self._piece(self._suffix, "text after a reply's stop token")

    def encode_turn(self, message: Mapping[str, Any]) -> np.ndarray:
        """The ids the template writes for `message` after an assistant's reply (what a session
        appends once the reply's `eos_id` and `turn_suffix()` are written).

        It is the text that follows the reply, its stop token and the turn suffix when the
        template renders a question, a reply and `message`. Where the template would also render
        the turns before `message` differently (Qwen3 drops the reasoning of replies before the
        latest question), that is not applied: a session keeps what the model saw.

        Raises:
            ValueError: where the template refuses the conversation (`ChatTemplateError`), or
                does not write the reply, its stop token and the turn suffix before `message`.
        """
        self.check_messages([message])
        text = self.render([_PROBE_QUESTION, _PROBE_REPLY, message])
        closed = _PROBE_REPLY["content"] + self._eos_text + (self._suffix or "")
        at = text.find(closed)
        if self._suffix is None or at < 0:
            raise ValueError(
                f"encode_turn: the chat template does not close a reply with {self._eos_text!r} "
                f"and a fixed suffix before a {message.get('role')!r} message"
            )
        return self.encode_rendered(text[at + len(closed) :])


def _read_text(path: str) -> str:
    try:
        return read_text(path)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"TemplateTokenizer.from_folder: {path!r} does not read: {error}"
        ) from None


def _json_file(root: str, name: str) -> dict[str, Any]:
    """A folder's JSON object file, or {} when there is none."""
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        return {}
    try:
        value = read_document(path)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"TemplateTokenizer.from_folder: {path!r} is not valid JSON: {error}"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"TemplateTokenizer.from_folder: {path!r} must hold a JSON object")
    return value


def _template_sources(
    root: str, config: Mapping[str, Any], given: str | None
) -> tuple[dict[str, str], str]:
    """The folder's chat templates by name (see `TemplateTokenizer.from_folder`), and the file
    they were read from (or `chat_template=`, given)."""
    if given is not None:
        if not isinstance(given, str):
            raise TypeError(f"chat_template must be the template's text, got {given!r}")
        return {"default": given}, "chat_template="
    path = os.path.join(root, "chat_template.jinja")
    if os.path.isfile(path):
        sources = {"default": _read_text(path)}
        # Newer folders keep the other named templates (tool_use) one file each beside it.
        extra = os.path.join(root, "additional_chat_templates")
        if os.path.isdir(extra):
            for name in sorted(os.listdir(extra)):
                if name.endswith(".jinja"):
                    sources[name.removesuffix(".jinja")] = _read_text(os.path.join(extra, name))
        return sources, path
    where = os.path.join(root, "tokenizer_config.json")
    value = config.get("chat_template")
    if value is None:
        value = _json_file(root, "chat_template.json").get("chat_template")
        where = os.path.join(root, "chat_template.json")
    if isinstance(value, str):
        return {"default": value}, where
    if isinstance(value, list) and value:
        named = {}
        for index, entry in enumerate(value):
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ValueError(
                    f"TemplateTokenizer.from_folder: {where!r} chat_template[{index}] must be an "
                    "object with a string 'name' and 'template'"
                )
            named[entry["name"]] = entry["template"]
        return named, where
    if value is not None:
        raise ValueError(
            f"TemplateTokenizer.from_folder: {where!r} chat_template must be a string or a "
            f"list of named templates, got {type(value).__name__}"
        )
    raise ValueError(
        f"TemplateTokenizer.from_folder: {root!r} has no chat template (chat_template.jinja, or "
        "chat_template in tokenizer_config.json): pass chat_template= the template's text"
    )


def _special_tokens(root: str, config: Mapping[str, Any], tokenizer: Any) -> dict[str, str]:
    """The named special tokens' text: tokenizer_config.json's, then generation_config.json's
    ids for those it lacks."""
    path = os.path.join(root, "tokenizer_config.json")
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):  # older files write an AddedToken's fields
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(
                f"TemplateTokenizer.from_folder: {path!r} {name} must be a string, got {value!r}"
            )
        special[name] = value
    generation = _json_file(root, "generation_config.json")
    for name in ("bos_token", "eos_token", "pad_token"):
        token_id = generation.get(name + "_id")
        if name in special or token_id is None:
            continue
        if isinstance(token_id, list) and token_id:
            token_id = token_id[0]
        text = tokenizer.id_to_token(token_id) if isinstance(token_id, int) else None
        if text is None:
            raise ValueError(
                f"TemplateTokenizer.from_folder: {os.path.join(root, 'generation_config.json')!r}"
                f" {name}_id {token_id!r} is not an id of the tokenizer"
            )
        special[name] = text
    return special
