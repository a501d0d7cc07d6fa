"""The byte tokenizer seen through the Tokenizer protocol of the coordination board.

A private stand-in until `dew.serve.tokenizer.BYTES` (the protocol's reference implementation)
lands: the gateway codes against the protocol only (`vocab_size`, `eos_id`, `special_ids`,
`encode`, `decode`, `chat_prefix`, `encode_turn`, `generation_prompt`, `turn_suffix`), so this
module goes once that instance exists.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from dew.serve import tokenizer


class _ByteTokenizer:
    """`dew.serve.tokenizer`'s module functions as a Tokenizer protocol object (the template's
    fixed pieces made once: the gateway asks for them on every call)."""

    vocab_size = tokenizer.VOCAB
    eos_id = tokenizer.IM_END
    special_ids = frozenset(tokenizer.SPECIAL_TOKENS)
    _prefix = np.array([tokenizer.BOS], np.int32)
    _generation = tokenizer.encode_chat([], add_generation_prompt=True)[1:]
    _suffix = tokenizer.encode("\n")

    def encode(self, text: str) -> np.ndarray:
        return tokenizer.encode(text)

    def decode(self, ids, *, skip_special: bool = False) -> str:
        return tokenizer.decode(ids, skip_special=skip_special)

    def chat_prefix(self) -> np.ndarray:
        return self._prefix.copy()

    def encode_turn(self, message: Mapping[str, str]) -> np.ndarray:
        return tokenizer.encode_chat([message], add_generation_prompt=False)[1:]

    def generation_prompt(self) -> np.ndarray:
        return self._generation.copy()

    def turn_suffix(self) -> np.ndarray:
        return self._suffix.copy()

    def encode_chat(self, messages, *, add_generation_prompt: bool = True) -> np.ndarray:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)


BYTES = _ByteTokenizer()
