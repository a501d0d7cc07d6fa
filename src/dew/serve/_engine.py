"""RolloutServer: an in-process JAX sampling engine that batches concurrent calls into shared steps.

It serves any `dew.models.Model` (the `dew.models` transformer, or a model of one's own behind
the same methods), whose token ids a `dew.serve.tokenizer.Tokenizer` gives meaning. The engine
keeps a key/value cache of [slots] sequences of up to max_len positions, holding only the blocks
of positions its running calls reach (`dew.serve._cache`). Each step runs in a worker
thread (`trio.to_thread.run_sync`), so the trio loop stays free: one decode step advances every
running call by one token (one compiled function for the fixed [slots] shape and each count of
cache blocks held), and calls that joined since the last step are prefilled into free slots (one
compilation per power-of-two prompt bucket and count of blocks). Calls beyond `slots` queue in
arrival order.

Weights pushed with `load` are swapped in between steps: calls in flight continue under the new
weights, and each call reports the version it started under (that of its first token), which
it also says to its rollout as it gets its slot (`note_progress(version=...)`: the scheduler counts
a running rollout's lag from its oldest call, as a finished one's). Each token
is drawn from the distribution the sampler really used (temperature, then top-k, then top-p over
the top-k renormalised distribution), and its behaviour log-prob is taken under that distribution;
a filtered call also reports the token ids each position kept (its support), and a call that asks
for them the most likely tokens at each position with their log-probs (`top_logprobs`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
from collections.abc import Sequence

import attrs
import jax
import numpy as np
import trio
from jax.sharding import Mesh

from dew import models
from dew._arrays import copy_tree
from dew._checks import check_int
from dew._trio import exit_unwrapped
from dew.objectives.rl.sessions import Call, note_progress
from dew.serve import _cache
from dew.serve._draw import _decode_step, _prefill_step
from dew.serve._model_checks import _as_model, _check_model, _placement, _signature
from dew.serve._requests import MAX_TOP_LOGPROBS, _Request, checked_request
from dew.serve.tokenizer import BYTES, Tokenizer

_MIN_BUCKET = 16


@attrs.frozen
class EngineStats:
    """What a RolloutServer is doing, for status lines, benchmarks and tests.

    Args:
        version: the weights version calls submitted now start under.
        active: calls holding a slot.
        queued: calls waiting for a slot.
        steps: engine steps run (each decodes the running calls and prefills the joining ones).
        tokens: tokens drawn.
        cache_positions: the positions of each slot its key/value cache holds now: the blocks
            its calls reach (one block when idle), or every one for a model whose cache cannot
            grow (see `dew.serve._cache`).
    """

    version: int
    active: int
    queued: int
    steps: int
    tokens: int
    cache_positions: int


class RolloutServer:
    """An in-process sampling engine for a `dew.models.Model`; a Publisher of weights.

    `async with server:` runs the engine's step loop as a background task of the caller's trio
    run; `generate` calls made inside share its steps. `load` may be called from any thread, or
    from inside trio, at any time.

    Args:
        model: the `dew.models.Model` to serve, or a `TransformerConfig` for the `dew.models`
            transformer of that shape.
        params: its params, laid out as `model.init` lays them out.
        slots: calls decoded together; more wait in a FIFO queue.
        max_len: the longest prompt + completion, at most model.max_len (the default).
        version: the version of `params`.
        seed: draws each call's randomness when the call gives no `key`, with its arrival index.
        tokenizer: what the token ids mean; its vocabulary must fit the model's. The byte
            tokenizer unless given.
        copy: serve a copy of `params` of its own, so the caller may change or donate its
            arrays afterwards; False serves `params`' own arrays, for a caller that leaves them
            be while the server lives (a held-out evaluation between a trainer's updates holds
            no second copy of the weights then). `load` copies either way.

    Raises:
        TypeError: when `model` is neither a Model nor a TransformerConfig, or `copy` not a
            bool.
        ValueError: naming the argument that is out of bounds, the params leaf that does not
            match `model.init`'s, or the protocol's shape that the model's prefill or decode
            breaks.
    """

    def __init__(
        self,
        model: models.Model | models.TransformerConfig,
        params,
        *,
        slots: int = 32,
        max_len: int | None = None,
        version: int = 0,
        seed: int = 0,
        tokenizer: Tokenizer = BYTES,
        copy: bool = True,
    ):
        self._model = model = _as_model(model)
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                f"tokenizer must be a dew.serve.tokenizer.Tokenizer, got {type(tokenizer).__name__}"
            )
        if tokenizer.vocab_size > model.vocab:
            raise ValueError(
                f"the tokenizer's vocabulary ({tokenizer.vocab_size} ids) exceeds the model's "
                f"({model.vocab}): ids it encodes would have no embedding"
            )
        self._tokenizer = tokenizer
        self._slots = check_int("slots", slots, low=1)
        self._max_len = check_int("max_len", model.max_len if max_len is None else max_len, low=2)
        if self._max_len > model.max_len:
            raise ValueError(
                f"max_len must be <= model.max_len {model.max_len}, got {self._max_len}"
            )
        self._seed = check_int("seed", seed, low=0)
        self._signature = _signature(jax.eval_shape(model.init, jax.random.key(0)))
        self._check_variables("params", params)
        _check_model(
            model,
            params,
            jax.eval_shape(lambda: model.init_cache(slots=self._slots, max_len=self._max_len)),
            self._slots,
            _MIN_BUCKET,
        )
        # The cache holds the blocks its calls reach, where the model's layout allows it
        # (`dew.serve._cache`), and every position from the start otherwise.
        self._blocked = _cache.blocked(model, slots=self._slots, max_len=self._max_len)
        self._reach = _cache.reach(self._max_len, 1) if self._blocked else self._max_len
        cache = model.init_cache(slots=self._slots, max_len=self._reach)
        if not isinstance(copy, bool):
            raise TypeError(f"copy must be a bool, got {copy!r}")
        self._params = copy_tree(params) if copy else params
        self._served = check_int("version", version, low=0)
        self._pending: tuple[object, int] | None = None
        # Set (under the lock) from the moment a step takes the pending weights until it has
        # run: a push meanwhile waits for the next step; at any other time it is served at once.
        self._stepping = False
        self._lock = threading.Lock()
        self._cache = cache
        self._cache_placement = None
        self._lay_out_cache(self._params)
        self._active: list[_Request | None] = [None] * self._slots
        self._queue: collections.deque[_Request] = collections.deque()
        self._arrivals = 0
        self._steps = 0
        self._tokens = 0
        self._running = False
        self._wake = trio.Event()
        # Each slot's inputs to the next decode step; a free slot decodes token 0 at position 0,
        # which its next prefill overwrites.
        self._next_token = np.zeros(self._slots, np.int32)
        self._position = np.zeros(self._slots, np.int32)
        self._counter = np.zeros(self._slots, np.int32)
        self._temperature = np.ones(self._slots, np.float32)
        self._top_k = np.full(self._slots, model.vocab, np.int32)
        self._top_p = np.full(self._slots, np.inf, np.float32)
        self._keys = np.zeros((self._slots, 2), np.uint32)

    @property
    def model(self) -> models.Model:
        """The model served."""
        return self._model

    @property
    def tokenizer(self) -> Tokenizer:
        """What the served token ids mean."""
        return self._tokenizer

    @property
    def max_len(self) -> int:
        """The longest prompt + completion a call may reach."""
        return self._max_len

    def _check_variables(self, name: str, variables) -> None:
        treedef, leaves = _signature(variables)
        if treedef != self._signature[0]:
            raise ValueError(f"{name} must have the tree layout of the model's init")
        if leaves == self._signature[1]:
            return
        paths = [
            jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(variables)
        ]
        for path, (shape, dtype), (want_shape, want_dtype) in zip(
            paths, leaves, self._signature[1], strict=True
        ):
            if shape != want_shape or dtype != want_dtype:
                raise ValueError(
                    f"{name}{path} must be {want_dtype}{list(want_shape)}, got {dtype}{list(shape)}"
                )

    @property
    def version(self) -> int:
        """The weights version calls submitted now start under (the last one loaded)."""
        with self._lock:
            return self._served if self._pending is None else self._pending[1]

    def load(self, variables, version: int) -> None:
        """Serve `variables` under `version` from the next step on.

        Calls already running continue under them; calls that start from now report `version`.
        The server keeps its own copy, so the caller may change or donate its arrays afterwards.
        Between steps (an idle engine's, above all) the copy replaces the served weights at
        once, so the old ones are freed now rather than held beside it until the next step: a
        trainer pushes just before its update, when an engine that has finished its rollouts
        would otherwise hold two copies through the update's peak (SmolLM2-135M: 0.5 GiB).

        Raises:
            ValueError: if `version` is not an int >= 0, or naming the leaf of `variables` whose
                shape or dtype differs from the served params.
        """
        version = check_int("version", version, low=0)
        self._check_variables("variables", variables)
        copied = copy_tree(variables)
        with self._lock:
            if self._stepping:
                self._pending = (copied, version)
            else:
                self._pending = None
                self._params, self._served = copied, version
                self._lay_out_cache(self._params)

    def stats(self) -> EngineStats:
        """What the engine is doing now."""
        return EngineStats(
            version=self.version,
            active=sum(request is not None for request in self._active),
            queued=len(self._queue),
            steps=self._steps,
            tokens=self._tokens,
            cache_positions=self._reach,
        )

    async def __aenter__(self) -> RolloutServer:
        if self._running:
            raise RuntimeError("RolloutServer is already running")
        self._stack = contextlib.AsyncExitStack()
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        self._running = True
        self._nursery.start_soon(self._loop)
        return self

    async def __aexit__(self, exc_type, exc, traceback) -> bool:
        self._nursery.cancel_scope.cancel(reason="closed")
        try:
            # The body's or the loop's own exception, not the nursery's wrapping of it.
            return await exit_unwrapped(self._stack, exc_type, exc, traceback)
        finally:
            self._running = False

    async def generate(
        self,
        prompt: np.ndarray,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: Sequence[int] = (),
        key: int | None = None,
        top_logprobs: int = 0,
    ) -> Call:
        """Sample a completion of `prompt`, sharing the engine's steps with concurrent calls.

        The completion ends after a stop token (which it includes), after `max_tokens` tokens, or
        when prompt + completion reach max_len. Cancelling the call frees its slot at the next
        step.

        Args:
            prompt: 1-D integer token ids, 1 to max_len - 1 of them.
            max_tokens: the most tokens to draw, >= 1.
            temperature: >= 0; 0 draws the most likely token at each position.
            top_k: keep the top_k most likely tokens (>= 1).
            top_p: keep the most likely tokens until they hold top_p of the probability, in
                (0, 1].
            stop: token ids that end the completion.
            key: the call's seed (an int >= 0), so that a call running alone is reproducible;
                None draws one from the server's seed and the call's arrival index.
            top_logprobs: report each position's most likely tokens, this many (0 to
                `MAX_TOP_LOGPROBS`), with their log-probs under the distribution the token was
                drawn from; tokens that distribution cannot draw (filtered out) are left out.

        Returns:
            The Call: int32 prompt and completion, float32 behaviour log-probs, the version it
            started under, where top_k, top_p or temperature 0 filtered the draw, the kept
            token ids at each position, and where asked, the top log-probs.

        Raises:
            ValueError: naming the argument that is out of bounds.
            RuntimeError: outside `async with server:`, or if the server stops first.
        """
        if not self._running:
            raise RuntimeError("RolloutServer.generate needs the step loop: use `async with`")
        request = self._request(
            prompt, max_tokens, temperature, top_k, top_p, stop, key, top_logprobs
        )
        request.context = contextvars.copy_context()
        self._queue.append(request)
        self._wake.set()
        # What the call samples counts toward its rollout's length, even if it is cancelled.
        note_progress(calls=1, sampling=request.tokens)
        try:
            await request.done.wait()
        finally:
            note_progress(len(request.tokens))
            if not request.done.is_set():
                request.cancelled = True
                if request in self._queue:
                    self._queue.remove(request)
        if request.closed:
            raise RuntimeError("RolloutServer stopped before the call finished")
        return request.call()

    def _request(
        self, prompt, max_tokens, temperature, top_k, top_p, stop, key, top_logprobs
    ) -> _Request:
        request = checked_request(
            prompt,
            max_tokens,
            temperature,
            top_k,
            top_p,
            stop,
            key,
            top_logprobs,
            vocab=self._model.vocab,
            max_len=self._max_len,
            seed=self._seed,
            arrival=self._arrivals,
        )
        self._arrivals += 1
        return request

    async def _loop(self) -> None:
        try:
            while True:
                for slot, request in enumerate(self._active):
                    if request is not None and request.cancelled:
                        self._free(slot)
                if not self._queue and not any(self._active):
                    self._hold(1)  # idle, as through the trainer's update: one block
                    await self._wake.wait()
                    self._wake = trio.Event()
                    continue
                with self._lock:
                    pending, self._pending = self._pending, None
                    self._stepping = True
                if pending is not None:
                    self._params, self._served = pending
                    self._lay_out_cache(self._params)
                decoding = [
                    slot
                    for slot, request in enumerate(self._active)
                    if request is not None and request.tokens
                ]
                joining = self._admit()
                # The positions the step writes: each decoding slot's next one, each prompt's.
                needed = max(
                    [int(self._position[slot]) + 1 for slot in decoding]
                    + [len(self._active[slot].prompt) for slot in joining],
                    default=1,
                )
                filtered = any(self._active[slot].filtered for slot in decoding)
                top = MAX_TOP_LOGPROBS if any(self._active[s].top for s in decoding) else 0
                try:
                    drawn, first = await trio.to_thread.run_sync(
                        self._compute,
                        self._params,
                        self._decode_inputs() if decoding else None,
                        [self._prefill_inputs(slot) for slot in joining],
                        filtered,
                        top,
                        needed,
                    )
                finally:
                    with self._lock:
                        self._stepping = False
                self._steps += 1
                if drawn is not None:
                    tokens, logprobs, kept, ids, values = drawn
                    for slot in decoding:
                        self._record(
                            slot,
                            tokens[slot],
                            logprobs[slot],
                            None if kept is None else kept[slot],
                            None if ids is None else (ids[slot], values[slot]),
                        )
                for slot, (token, logprob, kept, ids, values) in zip(joining, first, strict=True):
                    alternatives = None if ids is None else (ids, values)
                    self._record(slot, int(token), float(logprob), kept, alternatives)
        finally:
            for request in [*self._queue, *self._active]:
                if request is not None:
                    request.closed = True
                    request.done.set()
            self._queue.clear()
            for slot in range(self._slots):
                self._free(slot)

    def _hold(self, needed: int) -> None:
        """Hold the cache's blocks that positions 0..needed - 1 reach, no more: the blocks a
        step writes and reads (a decode's at each slot's position, a prefill's at its prompt's),
        added where the calls reach further, let go where the calls that reached them ended
        (`dew.serve._cache`). Runs at the start of a step's `_compute`, in its worker thread,
        or on the loop while no step runs."""
        if not self._blocked:
            return
        reach = _cache.reach(self._max_len, needed)
        if reach == self._reach:
            return
        self._cache = _cache.resized(self._model, self._cache, slots=self._slots, length=reach)
        self._reach = reach
        self._cache_placement = None  # the new blocks go where the others are
        self._lay_out_cache(self._params)

    def _lay_out_cache(self, params) -> None:
        """Place the cache where the steps hand it back when they run on `params`, if that
        changed: on the mesh the params are sharded over, as the model lays it out there
        (`cache_shardings(mesh, cache)`); on the one device they are committed to.

        A step's cache comes back where its params are, laid out on a mesh as the partitioner
        chose (a model's key/value heads where its projections split them): a cache that
        started anywhere else would be a second input signature, and each step would compile
        again at its second call. Params that are not committed, and a model on a mesh that
        declares no layout, leave the cache as `init_cache` made it. Runs between steps only,
        never beside `_compute`.
        """
        placement = _placement(params)
        if placement is None or placement == self._cache_placement:
            return
        if isinstance(placement, Mesh):
            lay_out = getattr(self._model, "cache_shardings", None)
            if lay_out is None:
                return
            self._cache = jax.device_put(self._cache, lay_out(placement, self._cache))
        else:
            self._cache = jax.device_put(self._cache, placement)
        self._cache_placement = placement

    def _admit(self) -> list[int]:
        """Move queued calls, in arrival order, into the free slots; return those slots."""
        joining = []
        for slot, request in enumerate(self._active):
            if request is None and self._queue:
                request = self._queue.popleft()
                request.version = self._served
                # Its rollout's lag counts from here while it runs, not from its submission: a
                # call queued through a push starts under the new weights.
                if request.context is not None:
                    request.context.run(note_progress, version=request.version)
                self._active[slot] = request
                self._temperature[slot] = request.temperature
                self._top_k[slot] = request.top_k
                self._top_p[slot] = request.top_p
                self._keys[slot] = request.key
                joining.append(slot)
        return joining

    def _decode_inputs(self) -> tuple[np.ndarray, ...]:
        """Every slot's inputs to the next decode step, for the worker thread.

        Not copies: only this loop writes them, before the step and after its results are back.
        """
        return (
            self._next_token,
            self._position,
            self._temperature,
            self._top_k,
            self._top_p,
            self._keys,
            self._counter,
        )

    def _prefill_inputs(self, slot: int) -> tuple[tuple[np.ndarray, ...], bool]:
        """A joining call's prefill inputs (its prompt padded to a power-of-two bucket, so prompt
        lengths share few compilations, its length, slot and sampling parameters) and whether it
        asks for top log-probs."""
        request = self._active[slot]
        length = len(request.prompt)
        bucket = min(self._max_len, max(_MIN_BUCKET, 1 << (length - 1).bit_length()))
        tokens = np.zeros(bucket, np.int32)
        tokens[:length] = request.prompt
        inputs = (
            tokens,
            np.int32(length),
            np.int32(slot),
            request.temperature,
            request.top_k,
            request.top_p,
            request.key,
        )
        return inputs, request.top > 0

    def _compute(self, params, decode, prefills, filtered: bool, top: int, needed: int):
        """The worker thread's part of a step: decode the running slots, then prefill the joining
        ones (after the decode, whose write at a free slot's position 0 the prefill overwrites).

        Args:
            filtered: whether a running call keeps its support, and so needs the kept masks.
            top: the alternatives a running call asks for (`MAX_TOP_LOGPROBS` or 0).
            needed: the positions of each slot the step writes, which the cache is made to hold
                first (here, off the trio loop: a growth allocates its blocks).

        Returns:
            The decode's tokens and log-probs (lists, one entry per slot), kept masks (bool
            [slots, vocab], None unless `filtered`) and top ids and log-probs ([slots, top],
            None without `top`), None without a decode; and each joining call's first token,
            log-prob, kept mask, and top ids and log-probs (None where it asks for none).
        """
        self._hold(needed)
        drawn = None
        if decode is not None:
            self._cache, *drawn = _decode_step(
                params, self._cache, *decode, model=self._model, top=top
            )
        first = []
        for inputs, asks in prefills:
            self._cache, *outputs = _prefill_step(
                params, self._cache, *inputs, model=self._model, top=MAX_TOP_LOGPROBS * asks
            )
            first.append([None if value is None else np.asarray(value) for value in outputs])
        if drawn is not None:
            # Whole lists at once: a step reads one token and log-prob per slot, and numpy
            # scalars one by one cost more than the step's other host work together.
            tokens, logprobs, kept, ids, values = drawn
            drawn = (
                np.asarray(tokens).tolist(),
                np.asarray(logprobs).tolist(),
                np.asarray(kept) if filtered else None,
                None if ids is None else np.asarray(ids),
                None if values is None else np.asarray(values),
            )
        return drawn, first

    def _record(
        self,
        slot: int,
        token: int,
        logprob: float,
        kept: np.ndarray | None,
        alternatives: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        """Append a drawn token to its slot's call, and free the slot if the call is done.

        Args:
            kept: the token's kept mask, bool[vocab]; None only for a call that is not filtered.
            alternatives: the position's `MAX_TOP_LOGPROBS` most likely ids and their
                log-probs; None only for a call that asks for none.
        """
        request = self._active[slot]
        if request is None or request.cancelled:
            return
        request.tokens.append(token)
        request.logprobs.append(logprob)
        if request.filtered:
            request.support.append(np.flatnonzero(kept).astype(np.int32))
        if request.top:
            ids, values = alternatives
            # The asked-for number, without the tokens the distribution cannot draw.
            drawable = np.isfinite(values[: request.top])
            request.alternatives.append(
                (ids[: request.top][drawable].astype(np.int32), values[: request.top][drawable])
            )
        self._tokens += 1
        drawn = len(request.tokens)
        length = len(request.prompt) + drawn
        if token in request.stop or drawn == request.max_tokens or length == self._max_len:
            self._free(slot)
            request.done.set()
            return
        self._next_token[slot] = token
        self._position[slot] = length - 1
        self._counter[slot] = drawn

    def _free(self, slot: int) -> None:
        self._active[slot] = None
        self._next_token[slot] = 0
        self._position[slot] = 0
        self._counter[slot] = 0
