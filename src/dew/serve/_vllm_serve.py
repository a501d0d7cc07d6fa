"""`dew serve`: one vLLM server for a checkpoint folder, started as dew starts its own, for
`dew train --engine-url` (docs/vllm.md).

The server is `VLLMEngine.start`'s: the same flags (`start_flags`), dtype, environment and
`sitecustomize` folder (`server_command`), and the same wait until it has answered a call. The
command prints the URL to pass as `--engine-url`, the server's pid and its log, then holds the
server until Ctrl-C or SIGTERM, which stop it and every process vLLM started.
`--print-command` prints the server's environment and command line as a shell runs them, for
those who start vLLM themselves, and starts nothing.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from dew._checks import int_option
from dew._documents import read_document


class _Stopped(Exception):
    """SIGTERM arrived: stop the server as a Ctrl-C does."""


def configure_cli(parser: argparse.ArgumentParser) -> None:
    """Add `dew serve`'s options to parser."""
    parser.add_argument("checkpoint", type=Path, help="the Hugging Face checkpoint folder")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    parser.add_argument(
        "--port",
        type=int_option(0, 65535),
        default=8000,
        help="port to listen on, 0 for a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int_option(2, 2**24),
        default=None,
        help="longest prompt + completion (default: the checkpoint's max_position_embeddings)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="dtype the server computes in; dew's models are float32 (default: %(default)s)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int_option(1, 512),
        default=None,
        help="serve LoRA adapters of rank up to this, loaded while it runs, for dew train --lora "
        "--engine-url (default: full-weight pushes only)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="folder for the server's log (default: a new temporary folder, kept)",
    )
    parser.add_argument(
        "--print-command",
        action="store_true",
        help="print the server's environment and command line as a shell runs them; start nothing",
    )


def _max_model_len(args: argparse.Namespace) -> int:
    """--max-model-len, or the checkpoint's max_position_embeddings."""
    config = args.checkpoint / "config.json"
    if not config.is_file():
        args.parser.error(f"checkpoint {args.checkpoint}: not a checkpoint folder (no config.json)")
    if args.max_model_len is not None:
        return args.max_model_len
    try:
        document = read_document(config)
    except ValueError as error:
        message = str(error)
        args.parser.error(message if str(config) in message else f"{config}: {message}")
    length = document.get("max_position_embeddings") if isinstance(document, dict) else None
    if not isinstance(length, int) or length < 2:
        args.parser.error(f"{config} gives no max_position_embeddings: give --max-model-len")
    return length


def run_cli(args: argparse.Namespace) -> int:
    """Run `dew serve` from its parsed options; return the exit status."""
    from dew.serve._vllm import VLLMEngine
    from dew.serve._vllm_process import VLLMError, server_command
    from dew.serve._vllm_push import LORA_ENVIRONMENT, lora_flags
    from dew.serve._vllm_start import start_flags

    length = _max_model_len(args)
    if args.print_command:
        checkpoint = args.checkpoint.resolve()
        lora = args.lora_rank is not None
        flags = start_flags(
            checkpoint.name,
            dtype=args.dtype,
            max_model_len=length,
            arguments=lora_flags(args.lora_rank) if lora else (),
        )
        command, added = server_command(
            checkpoint,
            host=args.host,
            port=args.port,
            arguments=flags,
            environment=dict(LORA_ENVIRONMENT) if lora else {},
        )
        print(shlex.join([f"{name}={value}" for name, value in added.items()] + command))
        return 0
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="dew-serve-"))

    def stop(signum, frame):
        raise _Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    engine = None
    try:
        print(f"dew serve: starting vLLM for {args.checkpoint}, log in {log_dir}", flush=True)
        began = time.monotonic()
        engine = VLLMEngine.start(
            args.checkpoint,
            max_model_len=length,
            dtype=args.dtype,
            host=args.host,
            port=args.port,
            work_dir=log_dir,
            lora_rank=args.lora_rank,
        )
        (process,) = engine.processes
        print(
            f"dew serve: ready in {time.monotonic() - began:.0f}s: --engine-url {process.url} "
            f"(pid {process.pid}, log {process.log}); Ctrl-C stops it",
            flush=True,
        )
        # Until a signal ends the wait (as _Stopped or KeyboardInterrupt), or the server dies,
        # which no signal tells this process: its exit is looked at each second.
        while (code := process.exit_code()) is None:
            time.sleep(1)
        print(
            f"dew serve: the vLLM server {process.url} exited with code {code}; its log "
            f"{process.log}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except (KeyboardInterrupt, _Stopped):
        print("dew serve: stopping the server", file=sys.stderr, flush=True)
        return 0
    except (VLLMError, ValueError) as error:
        print(f"dew serve: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        # A second SIGTERM must not cut the stop short, which would leave the server to dew's
        # watchdog: the stop ends in SIGKILL after its grace anyway.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if engine is not None:
            engine.close()
        signal.signal(signal.SIGTERM, previous)
