"""Text to token ids and back through a Hugging Face `tokenizers.Tokenizer` (`_TokenizersText`).

What `HuggingFaceTokenizer` (the ChatML template over such a tokenizer, in `tokenizer`) and
`TemplateTokenizer` (a checkpoint's own chat template, in `_tokenizer_template`) share: the two
copies of the tokenizer that read text as text and a template's output as `transformers` does,
each token's own bytes, and the check of ids against a vocabulary (`_checked_ids`), which the
byte tokenizer uses too. Kept apart from `dew.serve.tokenizer` so that each module reads in one
sitting.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np


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
