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
its making (`start`, `attach`), its life and its calls (`generate`); `_vllm_http` the requests
to its servers, their answers and their errors; `_vllm_checks` what a server must run with to
serve a run; `_vllm_push` its pushes (`load`, `load_async`) and what a pushed folder holds. The
server processes dew starts are `_vllm_process`'s.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio

from dew._checks import check_int, check_number
from dew.models.hf._hub import resolve
from dew.objectives.rl.sessions import Call, note_progress
from dew.serve._vllm_checks import _ServerChecks
from dew.serve._vllm_http import (
    API_KEY_VARIABLE,
    READ_TIMEOUT,
    _api_key,
    _body,
    _call,
    _first_label,
    _prompt_ids,
    _sampling,
    _Server,
    _ServerRequests,
)
from dew.serve._vllm_limits import SERVED_DTYPES, START_FLAGS
from dew.serve._vllm_process import (
    PortTaken,
    ServerProcess,
    check_port_free,
    free_port,
    server_urls,
)
from dew.serve._vllm_push import LORA_ENVIRONMENT, _Pushes, lora_flags

# Flags every server dew starts runs with: log-probs of the distribution each token was drawn
# from; the token-in/token-out endpoint; no torch.compile warm-up (minutes on a CPU).
_REQUIRED_FLAGS = ("--logprobs-mode", "processed_logprobs", "--enable-scale-out")
# Starts of one server whose picked port another process took first, before start gives up.
PORT_ATTEMPTS = 3


def start_flags(
    name: str, *, dtype: str, max_model_len: int, arguments: Sequence[str] = ()
) -> list[str]:
    """The vLLM flags after `--model`, `--host` and `--port` of every server dew starts
    (`VLLMEngine.start`, `dew serve`): the served name, dtype and length, eager mode, the flags
    attach requires, those for dew's bursts (`START_FLAGS`), then `arguments`."""
    return [
        "--served-model-name",
        name,
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        *_REQUIRED_FLAGS,
        *START_FLAGS,
        *arguments,
    ]


class VLLMEngine(_ServerRequests, _ServerChecks, _Pushes):
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
        if _is_lora(model):
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

    # --- making one ------------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        checkpoint: str | Path,
        *,
        servers: int = 1,
        max_model_len: int,
        dtype: str = "float32",
        port: int = 0,
        host: str = "127.0.0.1",
        name: str | None = None,
        model: Any = None,
        tokenizer: Any = None,
        save: Callable[[Path, Any], None] | None = None,
        version: int = 0,
        ready_timeout: float = 900.0,
        arguments: Sequence[str] = (),
        environment: dict[str, str] | None = None,
        work_dir: str | Path | None = None,
        api_key: str | None = None,
        read_timeout: float = READ_TIMEOUT,
        lora_rank: int | None = None,
    ) -> VLLMEngine:
        """Start `servers` vLLM servers of `checkpoint` on `host` and wait until each answers.

        Each server runs `python -m vllm.entrypoints.openai.api_server` with `--dtype`,
        `--max-model-len`, `--enforce-eager`, `--logprobs-mode processed_logprobs` and
        `--enable-scale-out`, in vLLM's development mode (its RL endpoints). Ready means
        `/health` answers and a one-token call has run (a server's first call warms it up,
        tens of seconds on a CPU). A Ctrl-C or an error while waiting stops every server.

        Args:
            checkpoint: a Hugging Face checkpoint folder vLLM can load, or a Hub repository id
                (`dew.models.hf.resolve`).
            servers: how many servers, >= 1.
            max_model_len: the longest prompt + completion.
            dtype: the weights' dtype on the servers ("float32" to match dew's float32 model).
            port: the first server's port (the others count up from it); 0 picks free ports,
                and picks again (up to PORT_ATTEMPTS starts) for a server whose port another
                process bound in the seconds before vLLM did.
            host: the address to listen on.
            name: the model name the servers serve; the checkpoint folder's name unless given.
            model: the `dew.models.hf.HFModel` pushed params are of; read from the checkpoint
                at the first push unless given.
            tokenizer: what the served ids mean; the checkpoint's own
                (`HuggingFaceTokenizer.from_folder`) unless given, where it has one.
            save: writes pushed params as a checkpoint folder, `save(folder, variables)`; by
                default `dew.models.hf.save` of `model`, with the checkpoint's tokenizer.
            version: the version of the checkpoint's weights.
            ready_timeout: seconds to wait for all servers to be ready.
            arguments: more vLLM flags. With none, and a `dtype` vLLM reports as given, the
                servers run as dew's flags say, unasked; with any, each server is asked for its
                configuration (`/server_info`, seconds of its CPU) to check what they change.
            environment: more environment variables for the servers.
            work_dir: where logs and pushed checkpoints go; a temporary folder (removed at
                close) unless given.
            api_key: a key the servers want on their /v1 and /inference paths (vLLM's
                `--api-key`, given to them as VLLM_API_KEY, out of their command lines); the
                environment's VLLM_API_KEY unless given ("" for none).
            read_timeout: seconds a server may send nothing while dew waits on it before it
                counts as dead (see the class).
            lora_rank: for a run that trains a LoRA adapter of rank up to this, pushed as the
                adapter alone (see the class; `save` writes it): the servers run with
                `--enable-lora --max-lora-rank R --max-loras 1` (R the smallest rank vLLM
                takes that holds it) and may load adapters at run time. A `LoRAModel` model's
                rank unless given; None for full pushes.

        Raises:
            VLLMError: a port in use, or naming the server's URL and its last log lines when it
                exits early (vLLM refused the checkpoint or a flag: its error is in those lines)
                or is not ready within `ready_timeout`.
            ValueError: naming an argument out of bounds or a checkpoint that is not a folder,
                or an API key given in `arguments` or `environment` instead of `api_key`.
        """
        checkpoint = resolve(checkpoint)  # a Hub repository id: its snapshot in the Hub's cache
        if not (checkpoint / "config.json").is_file():
            raise ValueError(f"checkpoint {checkpoint}: not a checkpoint folder (no config.json)")
        servers = check_int("servers", servers, low=1)
        max_model_len = check_int("max_model_len", max_model_len, low=2)
        version = check_int("version", version, low=0)
        check_number("ready_timeout", ready_timeout, low=0, low_open=True)
        port = check_int("port", port, low=0)
        environment = dict(environment or {})
        if API_KEY_VARIABLE in environment or any(
            flag.startswith("--api-key") for flag in arguments
        ):
            raise ValueError(
                "give the servers' API key as api_key= (dew sends it too), not in arguments or "
                "environment"
            )
        api_key = _api_key(api_key)
        # "" overrides a key in dew's own environment that api_key= replaced.
        environment[API_KEY_VARIABLE] = api_key or ""
        if lora_rank is None and _is_lora(model):
            lora_rank = model.lora.rank
        # The caller's own flags may undo dew's (vLLM takes a flag's last value): then each
        # server is asked what it runs with.
        own_flags = not arguments and dtype in SERVED_DTYPES
        if lora_rank is not None:
            arguments = [*lora_flags(lora_rank), *arguments]
            environment |= LORA_ENVIRONMENT
        ports = [free_port(host) for _ in range(servers)] if port == 0 else []
        for index in range(servers if port else 0):
            check_port_free(host, port + index)
            ports.append(port + index)
        name = checkpoint.name if name is None else name
        owned = None
        if work_dir is None:
            work_dir = owned = Path(tempfile.mkdtemp(prefix="dew-vllm-"))
        work_dir = Path(work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
        flags = start_flags(name, dtype=dtype, max_model_len=max_model_len, arguments=arguments)

        def serve(index: int, server_port: int) -> ServerProcess:
            return ServerProcess(
                checkpoint,
                host=host,
                port=server_port,
                arguments=flags,
                log=work_dir / f"vllm-{index}.log",
                environment=environment,
            )

        started: list[ServerProcess] = []
        engine = None
        try:
            started += [serve(index, server_port) for index, server_port in enumerate(ports)]
            deadline = time.monotonic() + ready_timeout
            with httpx.Client() as client:
                for index in range(len(started)):
                    for attempt in range(1, PORT_ATTEMPTS + 1):
                        try:
                            started[index].wait_ready(deadline, client)
                            break
                        except PortTaken:
                            # A port dew picked, taken before vLLM bound it: pick another. A
                            # port the caller gave is theirs to change.
                            if port or attempt == PORT_ATTEMPTS:
                                raise
                            started[index].stop()
                            started[index] = serve(index, free_port(host))
            engine = cls(
                [_Server(process.url, process) for process in started],
                name=name,
                max_model_len=max_model_len,
                checkpoint=checkpoint,
                model=model,
                tokenizer=_folder_tokenizer(checkpoint) if tokenizer is None else tokenizer,
                save=save,
                push_dir=work_dir,
                version=version,
                owned_dir=owned,
                api_key=api_key,
                read_timeout=read_timeout,
                lora=lora_rank is not None,
                started_dtype=dtype if own_flags else None,
            )
            # Together: a first call takes tens of seconds on each server.
            with concurrent.futures.ThreadPoolExecutor(len(started)) as pool:
                list(pool.map(functools.partial(engine._warm_up, version), engine._servers))
        except BaseException:
            if engine is not None:
                engine.close()  # its servers, its HTTP client and its folder
            for process in started:
                process.stop()
            if owned is not None:
                shutil.rmtree(owned, ignore_errors=True)
            raise
        return engine

    @classmethod
    def attach(
        cls,
        urls: Sequence[str],
        *,
        push_dir: str | Path,
        checkpoint: str | Path | None = None,
        name: str | None = None,
        model: Any = None,
        tokenizer: Any = None,
        save: Callable[[Path, Any], None] | None = None,
        version: int = 0,
        api_key: str | None = None,
        read_timeout: float = READ_TIMEOUT,
        lora: bool = False,
    ) -> VLLMEngine:
        """Use vLLM servers that are already running.

        Each must serve the run's model, run in vLLM's development mode (`VLLM_SERVER_DEV_MODE=1`)
        with `--logprobs-mode processed_logprobs` and `--enable-scale-out`, and read
        `push_dir`. A server that lacks any of these is refused naming every one it lacks. Their
        weights version is set to `version`.

        Args:
            urls: the servers' base URLs (`http://host:port`; a trailing `/` or `/v1`, as an
                OpenAI client's `base_url` has, is dropped).
            push_dir: where pushed checkpoints are written, a folder every server reads.
            checkpoint: the run's checkpoint folder: pushes copy its tokenizer files, and read
                `model` from it unless given.
            name: the model name the run expects them to serve; unless given, the one whose
                folder is `checkpoint` (vLLM's `--model`) or that bears its folder's name.
            model: the `dew.models.hf.HFModel` pushed params are of.
            tokenizer: what the served ids mean; the checkpoint's own unless given.
            save: writes pushed params as a checkpoint folder, `save(folder, variables)`, in
                place of `dew.models.hf.save`.
            version: the version of the weights they hold.
            api_key: the key the servers were started with (`--api-key`), sent with every
                request; the environment's VLLM_API_KEY unless given ("" for none).
            read_timeout: seconds a server may send nothing while dew waits on it before it
                counts as dead (see the class).
            lora: push the adapter `save` writes, not the full weights (see the class); the
                servers must then run with `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING.

        Raises:
            VLLMError: naming the URL of a server that does not answer, wants an API key (or
                another), serves another model, does not report its max_model_len, or lacks
                any of the flags above (naming each).
            ValueError: when `urls` is empty, names a URL that cannot be a server's or one
                server twice, or the API key cannot go in an HTTP header.
        """
        if isinstance(urls, str):
            raise ValueError(f"attach takes a list of server URLs, got the string {urls!r}")
        urls = server_urls(urls)
        if not urls:
            raise ValueError("attach needs at least one server URL")
        api_key = _api_key(api_key)
        if name is None and checkpoint is None:
            raise ValueError("attach needs the served model's name or the run's checkpoint")
        version = check_int("version", version, low=0)
        servers = [_Server(url) for url in urls]
        push_dir = Path(push_dir)
        push_dir.mkdir(parents=True, exist_ok=True)
        engine = cls(
            servers,
            name=name,
            max_model_len=0,
            checkpoint=checkpoint,
            model=model,
            tokenizer=(
                _folder_tokenizer(checkpoint)
                if tokenizer is None and checkpoint is not None
                else tokenizer
            ),
            save=save,
            push_dir=push_dir,
            version=version,
            api_key=api_key,
            read_timeout=read_timeout,
            lora=lora,
        )
        try:
            lengths = [engine._check_attached(server) for server in servers]
            engine.max_len = min(lengths)
            for server in servers:
                engine._warm_up(version, server)
        except BaseException:
            engine.close()
            raise
        return engine

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
        for server in self._servers:
            if server.process is not None:
                server.process.stop()
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


def _is_lora(model) -> bool:
    """Whether `model` is a checkpoint with a LoRA adapter (`dew.models.hf.lora.LoRAModel`)."""
    if model is None:
        return False
    from dew.models.hf import lora as adapters

    return isinstance(model, adapters.LoRAModel)


def _adapter_writer(model, checkpoint: str | Path | None) -> Callable[[Path, Any], None]:
    """How a push of a `LoRAModel`'s variables writes them: its adapter alone, as PEFT saves
    one (`dew.models.hf.lora.save_adapter`), naming the checkpoint it adapts."""
    from dew.models.hf import lora as adapters

    base = None if checkpoint is None else str(checkpoint)

    def save(folder: Path, variables) -> None:
        adapters.save_adapter(folder, variables["adapter"], model.lora, base_model=base)

    return save


def _folder_tokenizer(checkpoint: str | Path):
    """The checkpoint folder's tokenizer and chat template, None where it has no tokenizer."""
    from dew.serve.tokenizer import HuggingFaceTokenizer

    if not (Path(checkpoint) / "tokenizer.json").is_file():
        return None
    return HuggingFaceTokenizer.from_folder(checkpoint)
