"""How a `VLLMEngine` is made: vLLM servers dew starts on loopback (`start`), or servers already
running that it attaches to (`attach`), each checked and warmed up before the engine is handed
over; and the flags every server dew starts runs with (`start_flags`, which `dew serve` shares).

A part of `VLLMEngine`, as `_vllm` says; apart from its life and its calls because making one
(ports, processes, a temporary folder, the checks a server must pass) is a story of its own.
"""

from __future__ import annotations

import concurrent.futures
import functools
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

import httpx

from dew._checks import check_int, check_number
from dew.models.hf._hub import resolve
from dew.serve._vllm_http import API_KEY_VARIABLE, READ_TIMEOUT, _api_key, _Server
from dew.serve._vllm_limits import SERVED_DTYPES, START_FLAGS
from dew.serve._vllm_process import (
    PortTaken,
    ServerProcess,
    check_port_free,
    free_port,
    server_urls,
    stop_servers,
)
from dew.serve._vllm_push import LORA_ENVIRONMENT, lora_flags

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


class _Starts:
    """`VLLMEngine`'s making: `start` and `attach`."""

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
    ) -> Self:
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
        if lora_rank is None and is_lora(model):
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
                tokenizer=folder_tokenizer(checkpoint) if tokenizer is None else tokenizer,
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
            stop_servers(started)
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
    ) -> Self:
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
                folder_tokenizer(checkpoint)
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


def is_lora(model) -> bool:
    """Whether `model` is a checkpoint with a LoRA adapter (`dew.models.hf.lora.LoRAModel`)."""
    if model is None:
        return False
    from dew.models.hf import lora as adapters

    return isinstance(model, adapters.LoRAModel)


def folder_tokenizer(checkpoint: str | Path):
    """The checkpoint folder's tokenizer and chat template, None where it has no tokenizer."""
    from dew.serve.tokenizer import HuggingFaceTokenizer

    if not (Path(checkpoint) / "tokenizer.json").is_file():
        return None
    return HuggingFaceTokenizer.from_folder(checkpoint)
