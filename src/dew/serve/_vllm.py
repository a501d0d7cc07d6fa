"""VLLMEngine: vLLM servers as dew's engine and weight Publisher.

Sources and the gateway use it as they use a `RolloutServer`: `generate` takes token ids and
returns a `Call` of token ids, each token's behaviour log-prob and the weights version the call
started under; `load` pushes weights; `version` is the version calls start under now; `async
with engine:` opens its HTTP client in the caller's trio run.

Calls go to vLLM's token-in/token-out endpoint (`POST /inference/v1/generate`), which takes the
prompt's ids as they are and streams the drawn ids back: nothing is tokenised or detokenised
between dew and the engine, and a rollout the scheduler cancels still says how many tokens its
call drew (`note_progress`), as with dew's engine. The servers run with `--logprobs-mode
processed_logprobs`, so a token's log-prob is taken under the distribution it was drawn from
(after temperature, top-k and top-p), as behaviour log-probs must be; and the endpoint labels
each token with the weights version that drew it, so a call that straddles a push reports the
version it really started under.

A push writes the params as a checkpoint folder (`dew.models.hf.save`) and has each server
reload it in place through vLLM's RL endpoints: pause in "keep" mode (calls in flight freeze
and go on after the resume, under the new weights), reload from the folder, set the weights
version, resume. `load_async` does it without holding the trio run that awaits it (the folder
is written in a worker thread, the servers driven over an async client), which is what the
scheduler awaits; `load` is the same push for synchronous callers. A run that trains a LoRA
adapter pushes the adapter alone, loaded in place under one name (`dew.serve._vllm_push` says
what vLLM then does to the calls in flight).

`VLLMEngine` is made of parts, a module each, so that each reads in one sitting: this one holds
its life and its calls (`generate`); `_vllm_start` its making (`start`, `attach`) and the flags
of the servers dew starts; `_vllm_http` the requests to its servers, their answers and their
errors; `_vllm_checks` what a server must run with to serve a run; `_vllm_push` its pushes
(`load`, `load_async`) and what a pushed folder holds. The server processes dew starts are
`_vllm_process`'s.
"""

from __future__ import annotations

import collections
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio

from dew._checks import check_int, check_number
from dew.objectives.rl.sessions import Call, note_progress
from dew.serve._vllm_checks import _ServerChecks
from dew.serve._vllm_http import (
    READ_TIMEOUT,
    _body,
    _call,
    _first_label,
    _prompt_ids,
    _sampling,
    _Server,
    _ServerRequests,
)
from dew.serve._vllm_process import ServerProcess, stop_servers
from dew.serve._vllm_push import _Pushes
from dew.serve._vllm_start import _Starts, is_lora


class VLLMEngine(_Starts, _ServerRequests, _ServerChecks, _Pushes):
    """vLLM servers as one engine for sources and the gateway, and one weight Publisher.

    Make one with `start` (dew starts the servers, on loopback) or `attach` (servers already
    running). The servers live until `close` (or the end of `with engine:`); `async with
    engine:` opens the HTTP client of the trio run that makes the calls. A call goes to the live
    server holding the fewest calls. A server that dies fails the calls it held with
    `CallFailed` (sources report those rollouts as INFRA_ERROR, and the scheduler resubmits them
    to the servers left); with none left, `generate` and `load` raise VLLMError. A server that
    draws a call with weights dew did not label (one restarted under the same URL serves its
    checkpoint again, labelled "default") fails that call the same way, and gets no calls until
    the next push (`load`, `load_async`) reloads it with the pushed weights.

    Args:
        servers: the servers' URLs and, for those dew started, their processes.
        name: the model name the servers serve (the `model` of every request).
        max_model_len: the servers' longest prompt + completion.
        checkpoint: the checkpoint folder served: pushes copy its tokenizer files, and read
            `model` from it when None.
        model: the `dew.models.hf.HFModel` pushed params are of; with a `vocab_limit`, calls
            draw only ids below it, as dew's engine does.
        tokenizer: what the served ids mean (the gateway renders chats with it), or None.
        save: writes pushed params as a checkpoint folder vLLM reloads, `save(folder,
            variables)`, in place of `dew.models.hf.save`.
        push_dir: where pushed checkpoints are written; every server must read it.
        version: the version of the weights the servers hold now.
        owned_dir: a temporary folder of dew's to remove at close, or None.
        api_key: the key the servers want (`--api-key`), sent with every request; None for
            servers that want none.
        read_timeout: seconds a server may send nothing while dew waits on it (a call's first
            token, its next one, a step of a push) before it counts as dead: longer than the
            longest push (calls freeze while the servers reload) and the slowest first token.
        lora: whether the run trains a LoRA adapter of the served checkpoint: each push then
            loads the adapter `save` writes (as PEFT saves one) in place under the one name
            `adapter`, never the full weights, and calls name the adapter from the first push on
            (before it, the base model, which an adapter at its start equals). A `model` that
            is a `dew.models.hf.lora.LoRAModel` makes it so, and its adapter is written with
            `lora.save_adapter` unless `save` is given.
        started_dtype: for servers dew started with flags it chose alone (`start` with no
            `arguments`), the `--dtype` it gave them, one vLLM reports as given: their
            configuration is then what those flags say, and is not asked of them
            (`_vllm_checks`); None to ask each server.
    """

    def __init__(
        self,
        servers: Sequence[_Server],
        *,
        name: str,
        max_model_len: int,
        checkpoint: str | Path | None,
        model: Any,
        tokenizer: Any,
        save: Callable[[Path, Any], None] | None,
        push_dir: Path,
        version: int,
        owned_dir: Path | None = None,
        api_key: str | None = None,
        read_timeout: float = READ_TIMEOUT,
        lora: bool = False,
        started_dtype: str | None = None,
    ):
        if save is None and checkpoint is None and model is None:
            raise ValueError("a VLLMEngine needs the run's checkpoint or model (or save=)")
        self._lora_rank = None  # the adapter's, where the model says it
        if is_lora(model):
            self._lora_rank = model.lora.rank
            lora, model, save = True, model.base, save or _adapter_writer(model, checkpoint)
        if lora and save is None:
            raise ValueError(
                "a VLLMEngine of a LoRA run needs save=, the adapter's writer, or a LoRAModel"
            )
        self._servers = list(servers)
        self.name = name
        self.max_len = max_model_len
        self._checkpoint = checkpoint
        self._model = model
        self.tokenizer = tokenizer
        self._save = save
        # A model that masks the ids past its tokenizer's (`vocab_limit`) never draws them: nor
        # does vLLM then, so both sides' log-probs are over the same ids. The list goes with
        # every call, so it costs a few bytes per id.
        limit = getattr(model, "vocab_limit", None)
        self._allowed = None if limit is None or limit >= model.vocab else list(range(limit))
        self._push_dir = push_dir
        self._owned_dir = owned_dir
        self._version = version
        self._lock = threading.Lock()
        # vLLM guards only its /v1 and /inference paths with the key; it goes with every
        # request, which a proxy guarding every path needs too.
        self._headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        # A server that stops answering (hung, stopped) is cut off after `read_timeout` with
        # nothing read: a call's wait for its first token and between two of its tokens, and
        # each step of a push.
        self._read_timeout = check_number("read_timeout", read_timeout, low=0, low_open=True)
        self._timeout = httpx.Timeout(read_timeout, connect=10.0)
        self._pushes = httpx.Client(timeout=self._timeout, headers=self._headers)
        self._client: httpx.AsyncClient | None = None
        self._pushed: Path | None = None
        self._closed = False
        self.lora = lora
        self._started_dtype = started_dtype
        # Under LoRA: how many pushes were begun, each adapter folder pushed by the push's index
        # (1, 2, ...), and the calls in flight by the newest push made when they were submitted
        # (a call holds that push's folder or a later one until it ends: see `_vllm_push`).
        self._adapter_pushes = 0
        self._adapters: dict[int, Path] = {}
        self._in_flight: collections.Counter[int] = collections.Counter()
        self.push_seconds: list[float] = []
        self.push_bytes: list[int] = []
        """The bytes of tensors each push had every server read (`pushed_bytes`)."""

    # --- life ------------------------------------------------------------------------------------

    @property
    def model(self):
        """The `dew.models.hf.HFModel` served (read from the checkpoint on first use)."""
        if self._model is None:
            from dew.models import hf

            self._model = hf.load(self._checkpoint)[0]
        return self._model

    @property
    def urls(self) -> tuple[str, ...]:
        """The servers' URLs."""
        return tuple(server.url for server in self._servers)

    @property
    def calls(self) -> tuple[int, ...]:
        """How many calls each server holds now (sent and not yet answered), in `urls` order."""
        return tuple(server.calls for server in self._servers)

    @property
    def processes(self) -> tuple[ServerProcess | None, ...]:
        """The servers' processes, None for an attached server."""
        return tuple(server.process for server in self._servers)

    def close(self) -> None:
        """Stop the servers dew started and remove its temporary folder. Safe to call again."""
        if self._closed:
            return
        self._closed = True
        stop_servers(server.process for server in self._servers if server.process is not None)
        self._pushes.close()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    async def __aenter__(self) -> VLLMEngine:
        if self._client is not None:
            raise RuntimeError("this VLLMEngine's calls are already open in a trio run")
        # No pool limit: every rollout in flight holds one connection while its call runs.
        self._client = httpx.AsyncClient(
            timeout=self._timeout,
            headers=self._headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        return self

    async def __aexit__(self, *exc_info) -> bool:
        client, self._client = self._client, None
        with trio.CancelScope(shield=True):
            await client.aclose()
        return False

    # --- calls -----------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The weights version calls submitted now start under (the last one pushed)."""
        with self._lock:
            return self._version

    @property
    def adapter(self) -> str:
        """The name a LoRA run's adapter is served under: the served model's, `-lora` added."""
        return f"{self.name}-lora"

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
    ) -> Call:
        """Sample a completion of `prompt` on the live server holding the fewest calls.

        As `RolloutServer.generate`: the completion ends after a stop token (which it
        includes), after `max_tokens` tokens, or when prompt + completion reach max_len.

        Args:
            prompt: 1-D integer token ids, 1 to max_len - 1 of them.
            max_tokens: the most tokens to draw, >= 1.
            temperature: >= 0; 0 draws the most likely token at each position.
            top_k: keep the top_k most likely tokens (>= 1).
            top_p: keep the most likely tokens until they hold top_p of the probability.
            stop: token ids that end the completion.
            key: the call's seed, so that a call is reproducible on the same server.

        Returns:
            The Call: int32 prompt and completion, float32 behaviour log-probs and the version
            of the weights that drew its first token.

        Raises:
            CallFailed: naming the server when it died or dropped the call.
            VLLMError: naming the server when it refuses the request or answers without token
                ids or log-probs, or when no server is alive.
            ValueError: naming the argument out of bounds.
            RuntimeError: outside `async with engine:`.
        """
        if self._client is None:
            raise RuntimeError("VLLMEngine.generate needs its HTTP client: use `async with`")
        ids = _prompt_ids(prompt, self.max_len)
        max_tokens = check_int("max_tokens", max_tokens, low=1)
        sampling = _sampling(temperature, top_k, top_p, key)
        if self._allowed is not None:
            sampling["allowed_token_ids"] = self._allowed
        stop_ids = [check_int("stop id", token, low=0) for token in stop]
        server = self._pick()
        # The version and, under LoRA, the newest adapter push of one moment: a push may land
        # from another thread (`load`).
        with self._lock:
            submitted = self._version
            pushes = max(self._adapters, default=0)
            self._in_flight[pushes] += 1
        body = _body(
            self.adapter if pushes else self.name,
            ids,
            max_tokens=min(max_tokens, self.max_len - len(ids)),
            sampling=sampling,
            stop=stop_ids,
        )
        server.calls += 1
        # Its rollout's lag counts from this call while it runs, not from its submission: the
        # version served now (vLLM's own queue hides when the call starts; a push while it
        # queues only makes the lag counted larger, so nothing passes max_lag unseen).
        note_progress(version=submitted)
        tokens: list[int] = []
        # What the call draws counts toward its rollout's length, even if it is cancelled.
        note_progress(calls=1, sampling=tokens)
        try:
            choice = await self._stream(server, body, tokens)
        except httpx.ReadTimeout:
            silent = f"it sent nothing for {self._read_timeout:g} s (read_timeout)"
            raise await self._lost(server, silent) from None
        except httpx.TransportError as error:
            raise await self._lost(server, error) from None
        finally:
            server.calls -= 1
            with self._lock:
                self._in_flight[pushes] -= 1
            note_progress(len(tokens))
        label = _first_label(choice.get("weight_versions"))
        if label is not None and not label.isdigit():
            raise self._restarted(server, f"weights labelled {label!r}")
        if self.lora:
            # Its first token is drawn by the adapter it named on arrival (or the base model,
            # the adapter at its start), whatever the server labels it: a call that waited
            # through a push is drawn by the old adapter under the new label (see `_vllm_push`).
            choice["weight_versions"] = None
        return _call(server.url, np.asarray(ids, np.int32), {"choices": [choice]}, submitted)


def _adapter_writer(model, checkpoint: str | Path | None) -> Callable[[Path, Any], None]:
    """How a push of a `LoRAModel`'s variables writes them: its adapter alone, as PEFT saves
    one (`dew.models.hf.lora.save_adapter`), naming the checkpoint it adapts."""
    from dew.models.hf import lora as adapters

    base = None if checkpoint is None else str(checkpoint)

    def save(folder: Path, variables) -> None:
        adapters.save_adapter(folder, variables["adapter"], model.lora, base_model=base)

    return save
