"""A `RolloutServer` call as the engine holds it (`_Request`): its arguments, checked
(`checked_request`), and its progress, which the step loop fills token by token while `generate`
waits for it.
"""

from __future__ import annotations

import contextvars

import attrs
import numpy as np
import trio

from dew._checks import check_int, check_number
from dew.objectives.rl.sessions import Call

MAX_TOP_LOGPROBS = 20
"""The most alternatives per position `generate(top_logprobs=...)` reports (as OpenAI's API)."""


@attrs.define(eq=False)
class _Request:
    """One call's arguments and progress; touched only by the trio thread."""

    prompt: np.ndarray
    max_tokens: int
    temperature: np.float32
    top_k: np.int32
    top_p: np.float32
    filtered: bool
    stop: frozenset[int]
    key: np.ndarray
    top: int = 0
    done: trio.Event = attrs.field(factory=trio.Event)
    version: int | None = None
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    support: list[np.ndarray] = attrs.field(factory=list)
    alternatives: list[tuple[np.ndarray, np.ndarray]] = attrs.field(factory=list)
    cancelled: bool = False
    closed: bool = False
    # The calling rollout's context: the step loop says in it the version the call starts
    # under once it has its slot (note_progress), as the rollout's own task would.
    context: contextvars.Context | None = None

    def call(self) -> Call:
        return Call(
            prompt=self.prompt,
            completion=np.array(self.tokens, np.int32),
            logprobs=np.array(self.logprobs, np.float32),
            version=self.version,
            support=tuple(self.support) if self.filtered else None,
            top_logprobs=tuple(self.alternatives) if self.top else None,
        )


def checked_prompt(prompt, max_len: int, vocab: int | None = None) -> np.ndarray:
    """`prompt` as an array of 1 to `max_len` - 1 token ids, each in [0, `vocab`) (>= 0 where
    the vocabulary is not known here: a vLLM server checks its own).

    Raises:
        ValueError: naming what of the prompt is out of bounds.
    """
    array = np.asarray(prompt)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"prompt must be 1-D integer ids, got {array.dtype}{list(array.shape)}")
    if not 1 <= len(array) < max_len:
        raise ValueError(
            f"prompt must hold 1 to max_len - 1 = {max_len - 1} tokens, got {len(array)}"
        )
    if vocab is None and array.min() < 0:
        raise ValueError(f"prompt ids must be >= 0, got {array.min()}")
    if vocab is not None and (array.min() < 0 or array.max() >= vocab):
        raise ValueError(f"prompt ids must be in [0, {vocab}), got {array.min()}..{array.max()}")
    return array


def checked_request(
    prompt,
    max_tokens,
    temperature,
    top_k,
    top_p,
    stop,
    key,
    top_logprobs,
    *,
    vocab: int,
    max_len: int,
    seed: int,
    arrival: int,
) -> _Request:
    """The `_Request` of a `generate` call's arguments, each checked against the served model's
    `vocab` and the server's `max_len`; a call without `key` draws from the server's `seed` and
    its `arrival` index.

    Raises:
        ValueError: naming the argument that is out of bounds.
    """
    array = checked_prompt(prompt, max_len, vocab)
    max_tokens = check_int("max_tokens", max_tokens, low=1)
    check_number("temperature", temperature, low=0)
    if top_k is not None:
        top_k = min(check_int("top_k", top_k, low=1), vocab)
    if top_p is not None:
        check_number("top_p", top_p, low=0, high=1, low_open=True)
    top = check_int("top_logprobs", top_logprobs, low=0)
    if top > MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be <= {MAX_TOP_LOGPROBS}, got {top}")
    stop_ids = frozenset(check_int("stop id", token, low=0) for token in stop)
    if any(token >= vocab for token in stop_ids):
        raise ValueError(f"stop ids must be < vocab {vocab}, got {sorted(stop_ids)}")
    if key is None:
        entropy = [seed, arrival]
    else:
        entropy = check_int("key", key, low=0)
    return _Request(
        prompt=array.astype(np.int32),
        max_tokens=max_tokens,
        temperature=np.float32(temperature),
        top_k=np.int32(vocab if top_k is None else top_k),
        top_p=np.float32(np.inf if top_p is None or top_p == 1 else top_p),
        filtered=top_k is not None or top_p is not None or temperature == 0,
        stop=stop_ids,
        key=np.random.SeedSequence(entropy).generate_state(2, np.uint32),
        top=top,
    )
