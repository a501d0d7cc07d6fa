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
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import json
import logging
import math
import os
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
from dew.serve._failure import CallFailed
from dew.serve._vllm_limits import (
    INFO,
    INFO_OPTIONS,
    START_FLAGS,
    burst_problem,
    served_dtype,
)
from dew.serve._vllm_process import (
    PortTaken,
    ServerProcess,
    VLLMError,
    check_port_free,
    free_port,
    server_urls,
)
from dew.serve._vllm_push import (
    LOAD_ADAPTER,
    LORA_ENVIRONMENT,
    PAUSE_OPTIONS,
    RESET,
    RESET_OPTIONS,
    add_tied_head,
    check_reset,
    lora_flags,
    lora_problem,
    pushed_bytes,
)

_GENERATE = "/inference/v1/generate"

# Flags every server dew starts runs with: log-probs of the distribution each token was drawn
# from; the token-in/token-out endpoint; no torch.compile warm-up (minutes on a CPU).
_log = logging.getLogger(__name__)

_REQUIRED_FLAGS = ("--logprobs-mode", "processed_logprobs", "--enable-scale-out")
API_KEY_VARIABLE = "VLLM_API_KEY"
"""The environment variable dew reads the servers' API key from when none is given, as vLLM's
own server reads it (`--api-key` unset): dew sends it as `Authorization: Bearer KEY`."""
# Starts of one server whose picked port another process took first, before start gives up.
PORT_ATTEMPTS = 3
READ_TIMEOUT = 600.0
"""Seconds a server may send nothing while dew waits on it (`read_timeout`): a first token on
a loaded CPU takes tens of seconds, a push of a 7 B checkpoint from disk about a minute."""


class _Server:
    """One server of the engine: its URL, the process when dew started it, whether it is alive
    and how many calls it holds, and whether it lost the weights dew pushed (`restarted`: it
    is left out until a push reloads them)."""

    def __init__(self, url: str, process: ServerProcess | None = None):
        self.url = url
        self.process = process
        self.alive = True
        self.restarted = False
        self.calls = 0
        self.failure = ""

    def died(self, why: str) -> None:
        self.alive = False
        self.failure = f"{why}{self.log_note}"

    @property
    def log_note(self) -> str:
        """Where the server's own account of a failure is: ", its log PATH" for a server dew
        started, "" for an attached one."""
        return "" if self.process is None else f", its log {self.process.log}"


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


class VLLMEngine:
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
            arguments: more vLLM flags.
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

    def _check_attached(self, server: _Server) -> int:
        """The attached server's max_model_len, once it is known to serve the run's model."""
        try:
            answer = self._pushes.get(f"{server.url}/v1/models", timeout=30)
        except httpx.HTTPError as error:
            raise VLLMError(f"the vLLM server {server.url} does not answer: {error}") from None
        if answer.status_code == 404:
            raise VLLMError(
                f"the vLLM server {server.url} answered /v1/models {_said(answer)}: is "
                f"{server.url} a vLLM server's base URL (http://HOST:PORT)?"
            )
        if answer.status_code != 200:
            raise self._refused(server, "/v1/models", answer)
        try:
            served = {entry["id"]: entry for entry in answer.json()["data"]}
        except (KeyError, TypeError, ValueError):
            raise VLLMError(
                f"the vLLM server {server.url} answered /v1/models with {answer.text!r:.300}: "
                "is it a vLLM server?"
            ) from None
        if self.name is None:
            self.name = _served_name(served, Path(self._checkpoint))
        if self.name not in served:
            run = self._checkpoint if self.name is None else repr(self.name)
            raise VLLMError(
                f"the vLLM server {server.url} serves {sorted(served)}, not the run's model {run}"
            )
        length = served[self.name].get("max_model_len")
        if not isinstance(length, int) or length < 2:
            raise VLLMError(
                f"the vLLM server {server.url} reports no max_model_len for {self.name!r} on "
                f"/v1/models (it answered {length!r}): is it a vLLM server?"
            )
        return length

    def _check_serving(self, server: _Server) -> None:
        """Refuse a server that lacks what a run needs, naming all it lacks at once (a server
        started by hand takes minutes to start again): vLLM's development mode (its RL
        endpoints), its token-in/token-out endpoint (`--enable-scale-out`), and log-probs of
        the distribution it draws from (`--logprobs-mode processed_logprobs`). A call drawn
        with top_k 1 tells the last: the distribution it draws from keeps one token, of
        log-prob 0, where vLLM's default (`raw_logprobs`) reports that token's log-prob before
        top-k, below 0 unless the model is certain of it (so four tokens are drawn); a server
        without the token-in/token-out endpoint draws it through /v1/completions. A CPU server
        with chunked prefill on is refused too: a burst of dew's seeded calls would kill it
        (`dew.serve._vllm_limits`); and for a LoRA run, one that serves no adapters of the
        run's rank (`lora_problem`) or cannot load them while it runs."""
        lacks = []
        paused = self._send(server, "GET", "/is_paused")
        if paused.status_code == 404:
            lacks.append(
                "it has no RL endpoints (/pause, /collective_rpc): start it with "
                "VLLM_SERVER_DEV_MODE=1"
            )
        elif paused.status_code != 200:
            raise self._refused(server, "/is_paused", paused)
        sampling = {"temperature": 1.0, "top_k": 1}
        body = _body(self.name, [0], max_tokens=4, sampling=sampling, stop=())
        # A server's first call warms it up: tens of seconds on a CPU, whatever read_timeout is.
        answer = self._send(server, "POST", _GENERATE, json=body, timeout=READ_TIMEOUT)
        logprobs = None
        # vLLM 0.32 answers 403 "Scale-out endpoints are disabled", others 404.
        if answer.status_code == 404 or (
            answer.status_code == 403 and "scale-out" in answer.text.lower()
        ):
            lacks.append(
                f"it has no token-in/token-out endpoint ({_GENERATE} answered "
                f"{answer.status_code}): start it with --enable-scale-out"
            )
            # What the server lacks besides, to say it now: a check the next attach repeats.
            with contextlib.suppress(VLLMError):
                logprobs = self._completion_logprobs(server)
        elif answer.status_code != 200:
            raise self._refused(server, _GENERATE, answer)
        else:
            logprobs = _call(server.url, np.zeros(1, np.int32), answer.json(), 0).logprobs
        # Its configuration is a development-mode endpoint too; a proxy may not pass it on. Its
        # first answer takes seconds (vLLM collects its environment), whatever read_timeout is.
        info = None
        if paused.is_success:
            info = self._send(server, "GET", INFO, params=INFO_OPTIONS, timeout=READ_TIMEOUT)
        if info is not None and info.status_code not in (200, 404):
            raise self._refused(server, INFO, info)
        if info is not None and info.status_code == 200:
            with contextlib.suppress(ValueError):
                problem = burst_problem(info.json())
                if problem is not None:
                    lacks.append(problem)
                self._check_dtype(server, served_dtype(info.json()))
                if self.lora and (problem := lora_problem(info.json(), self._lora_rank)):
                    lacks.append(problem)
        if self.lora and self._send(server, "GET", LOAD_ADAPTER).status_code == 404:
            lacks.append(
                f"it cannot load adapters while it runs ({LOAD_ADAPTER} is missing): start it "
                f"with {' '.join(f'{name}={value}' for name, value in LORA_ENVIRONMENT.items())}"
            )
        if logprobs is not None and np.abs(logprobs).max() > 1e-6:
            lacks.append(
                "it reports log-probs of another distribution than the one it draws from "
                f"(drawn with top_k 1, they are {logprobs.tolist()}, not 0): start it with "
                "--logprobs-mode processed_logprobs, or the run would train on wrong behaviour "
                "log-probs"
            )
        if lacks:
            lacking = "; ".join(lacks)
            raise VLLMError(f"the vLLM server {server.url} cannot serve the run: {lacking}")

    def _check_dtype(self, server: _Server, dtype: str | None) -> None:
        """Say in one line when a server computes in another dtype than the run's model (a
        server started without `--dtype float32` serves a float32 checkpoint in bfloat16): its
        behaviour log-probs then differ from dew's by that rounding, which `mismatch/engine`
        shows at about 1e-8 where float32 on both sides gives 1e-14."""
        wanted = getattr(self._model, "dtype", None)
        if dtype is not None and wanted is not None and dtype != wanted:
            _log.warning(
                "the vLLM server %s computes in %s, the run's model in %s: its log-probs differ "
                "from dew's by %s rounding; start it with --dtype %s to match",
                server.url,
                dtype,
                wanted,
                dtype,
                wanted,
            )

    def _completion_logprobs(self, server: _Server) -> np.ndarray:
        """The log-probs of a call drawn with top_k 1 through the OpenAI completions endpoint."""
        body = {
            "model": self.name,
            "prompt": [0],
            "max_tokens": 4,
            "temperature": 1.0,
            "top_k": 1,
            "logprobs": 1,
            "ignore_eos": True,
        }
        answer = self._post(server, "/v1/completions", json=body, timeout=READ_TIMEOUT)
        try:
            values = answer.json()["choices"][0]["logprobs"]["token_logprobs"]
            return np.asarray(values, np.float64)
        except (IndexError, KeyError, TypeError, ValueError):
            raise VLLMError(
                f"the vLLM server {server.url} answered /v1/completions without log-probs"
            ) from None

    def _warm_up(self, version: int, server: _Server) -> None:
        """Check what a server serves with (`_check_serving`: its first call, which takes tens
        of seconds on a CPU) and label its weights `version`."""
        self._check_serving(server)
        self._post(server, "/update_weight_version", json={"new_version": str(version)})

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

    async def _stream(self, server: _Server, body: dict, tokens: list[int]) -> dict:
        """Run a call as a stream of its tokens, `tokens` growing as they come (what a cancelled
        call drew, for note_progress), and return its choice, its chunks joined.

        Raises:
            CallFailed: when the server fails (5xx) or its stream ends before the call does.
            VLLMError: when it refuses the call or reports an error in the stream.
            httpx.TransportError: when the connection breaks.
        """
        ids: list[int] | None = []
        content: list | None = []
        last: dict = {}
        problem = None
        url = f"{server.url}{_GENERATE}"
        async with self._client.stream("POST", url, json={**body, "stream": True}) as answer:
            if answer.status_code != 200:
                await answer.aread()
                if answer.status_code >= 500:
                    raise await self._lost(server, _said(answer))
                if answer.status_code == 401:
                    raise self._refused(server, _GENERATE, answer)
                if answer.status_code == 404 and body["model"] == self.adapter:
                    # vLLM knows no adapter of that name: it lost the one pushed last.
                    raise self._restarted(server, f"no adapter {self.adapter!r}")
                raise VLLMError(f"the vLLM server {server.url} refused the call: {_said(answer)}")
            # Read to the end whatever comes: leaving httpx's line iterator half read would leave
            # its generators for the garbage collector (trio warns of each).
            async for line in answer.aiter_lines():
                data = line.removeprefix("data: ")
                if data == line or data == "[DONE]" or problem is not None:
                    continue  # a blank separator, the end, or what follows an error
                try:
                    chunk = json.loads(data)
                except ValueError:
                    problem = f"a line that is not JSON: {data!r:.200}"
                    continue
                if "error" in chunk:
                    problem = f"{chunk['error']!r:.500}"
                    continue
                for choice in chunk.get("choices") or ():
                    delta = choice.get("token_ids")
                    drawn = (choice.get("logprobs") or {}).get("content")
                    if delta is None or drawn is None:
                        ids = content = None  # not a token-in/token-out answer: `_call` says so
                    if ids is not None:
                        tokens.extend(delta)
                        ids.extend(delta)
                        content.extend(drawn)
                    last = choice
        if problem is not None:
            raise VLLMError(
                f"the vLLM server {server.url} failed the call{server.log_note}: {problem}"
            )
        if ids is not None and last.get("finish_reason") is None:
            raise CallFailed(
                f"the vLLM server {server.url} ended the call's stream before the call ended"
            )
        return {
            "token_ids": ids,
            "logprobs": {"content": content},
            "finish_reason": last.get("finish_reason"),
            "weight_versions": last.get("weight_versions"),
        }

    def _pick(self) -> _Server:
        live = [server for server in self._servers if server.alive]
        if not live:
            raise VLLMError(f"no vLLM server is alive: {self._obituary()}")
        return min(live, key=lambda server: server.calls)

    async def _lost(self, server: _Server, error: object) -> CallFailed:
        """The failure of a call its server dropped; the server counts as dead when its process
        ended or it no longer answers `/health`."""
        why = f"{type(error).__name__}: {error}" if isinstance(error, Exception) else str(error)
        if server.process is not None and server.process.exit_code() is not None:
            server.died(f"exit code {server.process.exit_code()}")
        elif not await self._healthy(self._client, server):
            server.died(why)
        return CallFailed(f"the vLLM server {server.url} failed the call{server.log_note}: {why}")

    async def _healthy(self, client: httpx.AsyncClient, server: _Server) -> bool:
        """Whether the server's process runs (for one dew started) and it answers `/health`
        within 5 s: a server that failed a request and is not healthy is dead."""
        if server.process is not None and server.process.exit_code() is not None:
            return False
        try:
            return (await client.get(f"{server.url}/health", timeout=5)).status_code == 200
        except httpx.HTTPError:
            return False

    def _restarted(self, server: _Server, serves: str) -> CallFailed:
        """The failure of a call drawn by weights dew never labelled: every server dew calls
        carries the label of the version it pushed, so a server answering under another one
        (vLLM's "default"), or without a LoRA run's adapter, was restarted, or reloaded by
        someone else, and serves weights that are not the run's. It is left out of the calls
        until the next push reloads it.

        Args:
            serves: what it serves instead, "weights labelled 'default'" say.
        """
        if server.alive:
            _log.warning(
                "the vLLM server %s answered a call with %s, not a version dew pushed: it "
                "restarted? it gets no calls until the next push reloads it",
                server.url,
                serves,
            )
        server.died(f"it serves {serves}, not a version dew pushed")
        server.restarted = True
        return CallFailed(
            f"the vLLM server {server.url} served the call with {serves}, not a version dew "
            "pushed (was it restarted?): the call is dropped, the server left out until the "
            "next push reloads it"
        )

    def _obituary(self) -> str:
        return "; ".join(f"{server.url} ({server.failure})" for server in self._servers)

    # --- pushes ----------------------------------------------------------------------------------

    def load(self, variables, version: int) -> None:
        """Serve `variables` under `version` on every live server (the Publisher protocol):
        `load_async`, run to its end from any thread.

        It runs in a trio run of its own, on a thread of its own, and blocks the caller until
        every server serves the new weights: called from a trio run, it holds that run for the
        whole push, where `await engine.load_async(...)` would not (the scheduler awaits that).

        Raises:
            VLLMError: as `load_async`: a step of the push failed, or no server is alive.
            ValueError: as `load_async`: a bad version, or params the writer refuses.
        """
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dew-push") as pool:
            pool.submit(trio.run, self.load_async, variables, version).result()

    async def load_async(self, variables, version: int) -> None:
        """Serve `variables` under `version` on every live server, letting the trio run that
        awaits it go on meanwhile: the rollouts in flight, a gateway and the fleet's other calls.

        Writes them as a checkpoint folder under the push folder (in a worker thread), then
        pauses every server in "keep" mode (calls in flight freeze, then go on under the new
        weights, each keeping the version its first token was drawn under), has each reload
        its weights from the folder and empty its prefix cache (what the old weights computed;
        the calls in flight recompute theirs), sets the version and resumes them; each step on every
        server at once, over an HTTP client of the push's own. Returns once every server serves
        them. Cancelled (or failing) after the pause, it resumes the servers that still answer
        before it lets the cancel (or error) through; a reload already under way may still land,
        so until the next push a server may serve the new weights under the old version (the
        behaviour log-probs are still those of the weights that drew the tokens). Servers left
        out as restarted (see the class) are reloaded with the pushed weights and labelled, and
        take calls again; a push with no server alive but those still pushes to them.

        Raises:
            VLLMError: naming the server's URL and its error when a step of the push fails (the
                servers are resumed first where they still answer), or when no server is alive.
            ValueError: if `version` is not an int >= 0, or as the checkpoint writer refuses
                `variables`.
        """
        version = check_int("version", version, low=0)
        began = time.perf_counter()
        if not any(server.restarted for server in self._servers):
            self._live_for(version)
        if self.lora:
            # A new folder even after a failed push, which some servers may have loaded.
            self._adapter_pushes += 1
            index = self._adapter_pushes
            folder = self._push_dir / f"adapter-{index}"
        else:
            folder = self._push_dir / f"push-{version}"
        await trio.to_thread.run_sync(self._write, folder, variables)
        # Made in a worker thread too: making a client (its TLS context) takes tens of ms.
        client = await trio.to_thread.run_sync(
            functools.partial(httpx.AsyncClient, timeout=self._timeout, headers=self._headers)
        )
        async with client:
            if any(server.alive for server in self._servers):
                await self._push_to_live(client, folder, version)
            async with trio.open_nursery() as nursery:
                for server in self._servers:
                    if server.restarted:
                        nursery.start_soon(self._rejoin, client, server, folder, version)
        self._live_for(version)
        with self._lock:
            self._version = version
            if self.lora:
                self._adapters[index] = folder
        if self.lora:
            self._drop_adapters()
        else:
            previous, self._pushed = self._pushed, folder
            if previous is not None and previous != folder:
                shutil.rmtree(previous, ignore_errors=True)
        self.push_bytes.append(pushed_bytes(folder))
        self.push_seconds.append(time.perf_counter() - began)

    def _drop_adapters(self) -> None:
        """Remove the adapter folders of earlier pushes that no call in flight may hold: vLLM
        reads a call's adapter again from its folder at each step (see `_vllm_push`), so a
        folder removed under a call would fail it. A call submitted after push k holds push
        k's folder or a later one."""
        with self._lock:
            held = [pushes for pushes, calls in self._in_flight.items() if calls]
            oldest = min([max(self._adapters), *held])
            dropped = [
                self._adapters.pop(index) for index in list(self._adapters) if index < oldest
            ]
        for folder in dropped:
            shutil.rmtree(folder, ignore_errors=True)

    def _write(self, folder: Path, variables) -> None:
        """Write pushed params as the checkpoint folder the servers reload, a tied model's
        head included (`add_tied_head`: else vLLM's reload leaves the head as it was), or a
        LoRA run's adapter as `save` writes it."""
        if self._save is not None:
            self._save(folder, variables)
        else:
            from dew.models import hf

            hf.save(folder, self.model, variables, tokenizer_from=self._checkpoint)
        if not self.lora:
            add_tied_head(folder)

    async def _on_each(
        self,
        client: httpx.AsyncClient,
        path: str,
        check: Callable[[str, httpx.Response], None] | None = None,
        **options,
    ) -> None:
        """POST `path` to every live server at once, `check(url, answer)` each answer (it
        raises VLLMError); the first failure, once all answered.

        Raises:
            VLLMError: naming the URL of a server that failed, or when none is alive.
        """
        failures: list[VLLMError] = []

        async def one(server: _Server) -> None:
            try:
                answer = await self._post_async(client, server, path, **options)
                if check is not None:
                    check(server.url, answer)
            except VLLMError as error:
                if server.alive:
                    failures.append(error)
                else:  # dead: the push goes on with the others, or fails with none left
                    live = sum(other.alive for other in self._servers)
                    _log.warning(
                        "the vLLM server %s is left out (%d left): %s", server.url, live, error
                    )

        async with trio.open_nursery() as nursery:
            for server in self._live_for(None):
                nursery.start_soon(one, server)
        if failures:
            raise failures[0]

    async def _push_to_live(self, client: httpx.AsyncClient, folder: Path, version: int) -> None:
        """Pause every live server, have it reload `folder` and empty its prefix cache (or,
        under LoRA, load the adapter in `folder`: its new path keeps the cache's old blocks
        apart), label it `version`, resume it; resumes those that still answer when a step
        fails or the push is cancelled. The pause makes the swap and the label one step for
        the calls that arrive: none is drawn by the new weights under the old label."""
        try:
            await self._on_each(client, "/pause", params=PAUSE_OPTIONS)
            if self.lora:
                await self._on_each(client, LOAD_ADAPTER, json=self._adapter_load(folder))
            else:
                reload = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
                await self._on_each(client, "/collective_rpc", json=reload)
                await self._on_each(client, RESET, check_reset, params=RESET_OPTIONS)
            label = {"new_version": str(version)}
            await self._on_each(client, "/update_weight_version", json=label)
            await self._on_each(client, "/resume")
        except BaseException as error:
            # Servers left paused would hold every call in flight for good.
            with trio.move_on_after(30, shield=True):
                await self._resume_all_async(client)
            if isinstance(error, VLLMError):
                raise VLLMError(f"pushing version {version}: {error}") from None
            raise

    def _adapter_load(self, folder: Path) -> dict[str, Any]:
        """`LOAD_ADAPTER`'s request: the adapter in `folder`, in place under the run's one name."""
        return {"lora_name": self.adapter, "lora_path": str(folder), "load_inplace": True}

    async def _rejoin(
        self, client: httpx.AsyncClient, server: _Server, folder: Path, version: int
    ) -> None:
        """Reload a restarted server with the weights just pushed and label them, so that it
        takes calls again; one that fails stays out (until the next push tries again)."""
        if server.process is not None and server.process.exit_code() is not None:
            server.restarted = False
            server.died(f"exit code {server.process.exit_code()}")
            return
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
        try:
            if self.lora:
                await self._post_async(
                    client, server, LOAD_ADAPTER, json=self._adapter_load(folder)
                )
            else:
                await self._post_async(client, server, "/collective_rpc", json=reload)
                reset = await self._post_async(client, server, RESET, params=RESET_OPTIONS)
                check_reset(server.url, reset)
            label = {"new_version": str(version)}
            await self._post_async(client, server, "/update_weight_version", json=label)
        except VLLMError as error:
            _log.warning("the restarted vLLM server %s stays out: %s", server.url, error)
            return
        server.alive, server.restarted, server.failure = True, False, ""
        _log.warning("the restarted vLLM server %s serves version %d again", server.url, version)

    async def _resume_all_async(self, client: httpx.AsyncClient) -> None:
        """Resume the live servers after a failed or cancelled push, those that still answer."""
        async with trio.open_nursery() as nursery:
            for server in self._servers:
                if server.alive:
                    nursery.start_soon(self._resume_quietly, client, server)

    async def _resume_quietly(self, client: httpx.AsyncClient, server: _Server) -> None:
        with contextlib.suppress(VLLMError):
            await self._post_async(client, server, "/resume")

    async def _post_async(
        self, client: httpx.AsyncClient, server: _Server, path: str, **options
    ) -> httpx.Response:
        """`_post` over an async client."""
        try:
            answer = await client.post(f"{server.url}{path}", **options)
        except httpx.HTTPError as error:
            if not await self._healthy(client, server):
                server.died(f"{type(error).__name__} at {path}, and /health does not answer")
            raise self._post_failed(server, path, error) from None
        if answer.status_code != 200:
            raise self._refused(server, path, answer)
        return answer

    def pause(self) -> None:
        """Pause every live server in "keep" mode: calls in flight freeze until `resume`.

        Raises:
            VLLMError: naming the server that failed (those paused already are resumed).
        """
        paused = []
        try:
            for server in self._live_for(None):
                self._post(server, "/pause", params={"mode": "keep"})
                paused.append(server)
        except VLLMError:
            self._resume_all(paused)
            raise

    def resume(self, version: int) -> None:
        """Label what the servers hold `version` and resume them; calls from now on report it.

        Raises:
            VLLMError: naming the server that failed.
        """
        for server in self._live_for(version):
            self._post(server, "/update_weight_version", json={"new_version": str(version)})
            self._post(server, "/resume")
        with self._lock:
            self._version = version

    def _resume_all(self, servers: Sequence[_Server] | None = None) -> None:
        """Resume servers after a failed push, those that still answer."""
        for server in self._servers if servers is None else servers:
            if server.alive:
                with contextlib.suppress(VLLMError):
                    self._post(server, "/resume")

    def _live_for(self, version: int | None) -> list[_Server]:
        if self._closed:
            raise RuntimeError("this VLLMEngine is closed")
        live = [server for server in self._servers if server.alive]
        if not live:
            to = "" if version is None else f" to push version {version} to"
            raise VLLMError(f"no vLLM server is alive{to}: {self._obituary()}")
        return live

    def _post(self, server: _Server, path: str, **options) -> httpx.Response:
        """A synchronous POST to a server; VLLMError naming the URL for any answer but 200."""
        answer = self._send(server, "POST", path, **options)
        if answer.status_code != 200:
            raise self._refused(server, path, answer)
        return answer

    def _send(self, server: _Server, method: str, path: str, **options) -> httpx.Response:
        """A synchronous request to a server, whatever it answers; VLLMError naming the URL
        when it does not answer."""
        try:
            return self._pushes.request(method, f"{server.url}{path}", **options)
        except httpx.HTTPError as error:
            raise self._post_failed(server, path, error) from None

    def _refused(self, server: _Server, path: str, answer: httpx.Response) -> VLLMError:
        """The error of a server's answer other than 200, naming its URL: a 401 says that it
        wants an API key, or another than the one sent."""
        if answer.status_code != 401:
            return VLLMError(f"the vLLM server {server.url} failed {path}: {_said(answer)}")
        if self._headers:
            why = (
                f"refused the API key dew sent ({API_KEY_VARIABLE}, or api_key=): give the key "
                "it was started with (--api-key)"
            )
        else:
            why = (
                f"wants an API key (it was started with --api-key): set {API_KEY_VARIABLE}, or "
                "give api_key=, to that key"
            )
        return VLLMError(f"the vLLM server {server.url} {why}; it answered {path} {_said(answer)}")

    def _post_failed(self, server: _Server, path: str, error: httpx.HTTPError) -> VLLMError:
        """The error of a POST the server did not answer; the server counts as dead when its
        process ended."""
        if server.process is not None and server.process.exit_code() is not None:
            server.died(f"exit code {server.process.exit_code()}")
        return VLLMError(
            f"the vLLM server {server.url} failed {path}: {type(error).__name__}: {error}"
        )


def _api_key(api_key: str | None) -> str | None:
    """The API key to send: `api_key`, else the environment's VLLM_API_KEY; None for none.

    Raises:
        ValueError: when it holds a space or a control character (a line end read from a
            file, say), which vLLM's key cannot and an HTTP header does not take.
    """
    key = os.environ.get(API_KEY_VARIABLE) if api_key is None else api_key
    if not isinstance(key, str | None):
        raise ValueError(f"api_key must be a string, got {type(key).__name__}")
    if key and not all(" " < character < "\x7f" for character in key):
        where = API_KEY_VARIABLE if api_key is None else "api_key"
        raise ValueError(
            f"{where} holds a space or a control character (a line end read from a file?): "
            "give the key alone"
        )
    return key or None


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


def _served_name(served: dict[str, dict], checkpoint: Path) -> str | None:
    """The served model whose folder (vLLM's `root`) is `checkpoint`, else the one named as its
    folder, or, for a snapshot in the Hugging Face Hub's cache (`.../models--OWNER--NAME/
    snapshots/COMMIT`), the one named or rooted as its repository id (a server started with
    `vllm serve OWNER/NAME`); None when none is."""
    for name, entry in served.items():
        root = entry.get("root")
        if root and Path(root).resolve() == checkpoint.resolve():
            return name
    repository = checkpoint.parent.parent.name
    if checkpoint.parent.name == "snapshots" and repository.startswith("models--"):
        repo_id = repository.removeprefix("models--").replace("--", "/", 1)
        for name, entry in served.items():
            if repo_id in (name, entry.get("root")):
                return name
    return checkpoint.name if checkpoint.name in served else None


def _prompt_ids(prompt, max_len: int) -> list[int]:
    array = np.asarray(prompt)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"prompt must be 1-D integer ids, got {array.dtype}{list(array.shape)}")
    if not 1 <= len(array) < max_len:
        raise ValueError(
            f"prompt must hold 1 to max_len - 1 = {max_len - 1} tokens, got {len(array)}"
        )
    if array.min() < 0:
        raise ValueError(f"prompt ids must be >= 0, got {array.min()}")
    return array.tolist()


def _sampling(temperature, top_k, top_p, key) -> dict[str, Any]:
    check_number("temperature", temperature, low=0)
    sampling: dict[str, Any] = {"temperature": float(temperature)}
    if top_k is not None:
        sampling["top_k"] = check_int("top_k", top_k, low=1)
    if top_p is not None:
        sampling["top_p"] = float(check_number("top_p", top_p, low=0, high=1, low_open=True))
    if key is not None:
        # vLLM takes a signed 64-bit seed.
        sampling["seed"] = check_int("key", key, low=0) % (1 << 63)
    return sampling


def _body(model: str, ids: list[int], *, max_tokens: int, sampling, stop) -> dict[str, Any]:
    """A token-in/token-out request: only the given stop ids end it (`ignore_eos`), and the
    sampled token's log-prob comes back (`logprobs` 0) without detokenising anything."""
    return {
        "model": model,
        "token_ids": ids,
        "output_mode": "tokens",
        "sampling_params": {
            **sampling,
            "max_tokens": max_tokens,
            "stop_token_ids": list(stop),
            "ignore_eos": True,
            "logprobs": 0,
            "detokenize": False,
            "skip_special_tokens": False,
        },
    }


def _call(url: str, prompt: np.ndarray, answer: dict, submitted: int) -> Call:
    """The Call of a generate answer; VLLMError naming the server when it lacks token ids or
    log-probs or they disagree, CallFailed when the server aborted the call."""
    try:
        (choice,) = answer["choices"]
    except (KeyError, TypeError, ValueError):
        raise VLLMError(
            f"the vLLM server {url} answered without one choice: {answer!r:.300}"
        ) from None
    if choice.get("finish_reason") == "abort":
        raise CallFailed(f"the vLLM server {url} aborted the call")
    tokens = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if tokens is None or content is None:
        raise VLLMError(
            f"the vLLM server {url} answered without token ids or log-probs: is it a vLLM "
            "token-in/token-out endpoint?"
        )
    logprobs = [entry.get("logprob") for entry in content]
    if len(logprobs) != len(tokens) or any(
        not isinstance(value, float) or math.isnan(value) for value in logprobs
    ):
        raise VLLMError(
            f"the vLLM server {url} answered {len(tokens)} token ids with log-probs "
            f"{logprobs!r:.200}"
        )
    return Call(
        prompt=prompt,
        completion=np.asarray(tokens, np.int32),
        logprobs=np.asarray(logprobs, np.float32),
        version=_started_under(choice.get("weight_versions"), submitted),
    )


def _first_label(spans) -> str | None:
    """The label of the weights that drew a call's first token, from vLLM's weight version
    spans; None where the server gives none."""
    with contextlib.suppress(IndexError, KeyError, TypeError):
        return str(spans[0]["version"])
    return None


def _started_under(spans, submitted: int) -> int:
    """The version that drew a call's first token, from vLLM's weight version spans; the version
    served at submission where the server labels none (or not with dew's integers)."""
    label = _first_label(spans)
    return int(label) if label is not None and label.isdigit() else submitted


def _said(answer: httpx.Response) -> str:
    """A server's error answer in one line: its status and message. An answer that is not
    JSON (another server on the port: a web server's HTML error page) is named by its content
    type and what answered (the Server header), never pasted in."""
    try:
        body = answer.json()
        message = body.get("error") or body.get("detail") or body.get("message") or body
        if isinstance(message, dict):
            message = message.get("message", message)
    except (ValueError, AttributeError):
        kind = answer.headers.get("content-type", "no content type").split(";")[0]
        lines = answer.text.strip().splitlines()
        first = lines[0][:200] if len(lines) == 1 and "html" not in kind else ""
        who = answer.headers.get("server")
        message = f"({kind}{f', from {who}' if who else ''}){f' {first}' if first else ''}"
    return f"{answer.status_code} {' '.join(str(message).split())[:500]}"
