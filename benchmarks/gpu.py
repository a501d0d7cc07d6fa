"""What a GPU user of dew with vLLM needs to know, in one run of under 8 minutes on one GPU.

A random checkpoint of Qwen2.5-0.5B's size (24 layers of width 1536, 0.46 B params, float32,
written by `transformers`; its embedding tied to its head as Qwen2.5's is; no download) is served
by one vLLM server that dew starts on the GPU with vLLM's NCCL weight-transfer engine
(`NCCL_SERVER_FLAGS`). Printed:

1. tokens/s of vLLM alone: `--calls` concurrent calls of `--tokens` tokens, best of 3;
2. tokens/s inside `dew train --engine vllm` attached to the same server (`--steps` updates at
   dew's default batch), and the trainer's idle share (the seconds it waited for batches over
   the run's);
3. push seconds of the params over NCCL (`NCCLPublisher`) and through a checkpoint folder
   (`VLLMEngine.load`), best of `--pushes`.

It checks itself: every push is of strongly changed weights (the folder push's `sharpened`, the
NCCL push's back to the checkpoint's own), and after each the
server's log-probs of drawn tokens must be dew's own under the pushed weights (a head or a layer
the push missed is nats off); the `dew train` run must end with every update recorded and its
`mismatch/engine` small. Any failed check exits non-zero.

JAX shares the GPU with vLLM here: it allocates as it goes (`XLA_PYTHON_CLIENT_PREALLOCATE`)
and computes float32 matmuls in full float32, as vLLM does, so the log-probs compare.

Without a GPU (`--smoke` here, in the tests) the same path runs on vLLM's CPU build with a
tiny checkpoint, the NCCL push left out (it needs CUDA).

    python benchmarks/gpu.py                 # on one GPU: about 5 minutes
    python benchmarks/gpu.py --smoke         # a tiny checkpoint, CPU or GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import trio  # noqa: E402

from dew.models import hf  # noqa: E402
from dew.serve.vllm import NCCL_SERVER_FLAGS, NCCLPublisher, VLLMEngine, free_port  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
from _checkpoint import sharpened, tiny_qwen2  # noqa: E402
from engines import mismatch, params_bytes, throughput  # noqa: E402

# The largest |vLLM - dew| log-prob of a drawn token a push may leave: float32 on both sides,
# summed in other orders (a missed head or layer is nats off on sharpened weights).
PUSH_GAP = 1e-3
# The most a `dew train` step's mismatch/engine (behaviour-proximal KL at lag 0) may read.
TRAIN_MISMATCH = 1e-4


def has_gpu() -> bool:
    from dew._torch_media import hide_broken_media_packages

    hide_broken_media_packages()
    import torch

    return torch.cuda.is_available()


def best(push, pushes: int) -> float:
    """The shortest of `pushes` timings of `push()`."""
    times = []
    for _ in range(pushes):
        start = time.perf_counter()
        push()
        times.append(time.perf_counter() - start)
    return min(times)


async def alone(engine: VLLMEngine, args) -> float:
    """vLLM's best tokens/s of 3 rounds, after a round that warms it."""
    async with engine:
        await throughput(engine, args.calls, tokens=args.tokens)
        return max([await throughput(engine, args.calls, tokens=args.tokens) for _ in range(3)])


async def drawn(engine: VLLMEngine, args) -> list:
    async with engine:
        return [
            await engine.generate(np.arange(12, dtype=np.int32) + index, max_tokens=args.tokens)
            for index in range(4)
        ]


def check_push(name: str, engine: VLLMEngine, model, params, args) -> None:
    """Exit unless the server now computes dew's log-probs under `params`."""
    gap, kl = mismatch(model, params, trio.run(drawn, engine, args))
    print(f"  after the {name} push: vLLM vs dew log-probs max gap {gap:.2e}, k3 KL {kl:.2e}")
    if not gap <= PUSH_GAP:
        sys.exit(f"the {name} push did not land: a log-prob {gap:.3g} off (at most {PUSH_GAP})")


def train(folder: pathlib.Path, engine: VLLMEngine, root: pathlib.Path, args) -> None:
    """`dew train --engine vllm` attached to the server: tokens/s and the trainer's idle share."""
    run = root / "run"
    command = [sys.executable, "-m", "dew", "train", "--model", str(folder), "--engine", "vllm"]
    command += ["--engine-url", *engine.urls, "--run", str(run), "--steps", str(args.steps)]
    command += ["--eval-every", "0", "--samples", "0", *args.train]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"dew train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    if [line["updates"] for line in lines] != list(range(1, args.steps + 1)):
        sys.exit(f"dew train recorded updates {[line['updates'] for line in lines]}")
    mismatches = [line["mismatch/engine"] for line in lines if "mismatch/engine" in line]
    if not mismatches or max(mismatches) > TRAIN_MISMATCH:
        sys.exit(f"dew train's mismatch/engine per step: {mismatches} (at most {TRAIN_MISMATCH})")
    elapsed = lines[-1]["elapsed"]
    tokens = sum(line["tokens"] for line in lines)
    waited = sum(line["waited"] for line in lines)
    print(
        f"dew train, {args.steps} updates ({' '.join(args.train) or 'default batch'}): "
        f"{tokens / elapsed:.1f} admitted tokens/s, trainer idle {waited / elapsed:.1%}, "
        f"{np.mean([line['seconds/step'] for line in lines[1:]] or [0.0]):.2f} s/step "
        f"after the first, mismatch/engine at most {max(mismatches):.1e} ({wall:.0f} s wall)"
    )


def main(args) -> None:
    gpu = has_gpu()
    # Set for this thread alone, where dew's side computes, not for the process: a test that
    # runs this script in the test's process (run_smoke_here) keeps its own precision after it.
    with jax.default_matmul_precision("highest"), tempfile.TemporaryDirectory() as scratch:
        root = pathlib.Path(scratch)
        started = time.perf_counter()
        folder = tiny_qwen2(
            root / "model", hidden=args.width, layers=args.layers, tied=True, max_len=1024
        )
        model, params = hf.load(folder)
        count = sum(leaf.size for leaf in jax.tree.leaves(params))
        print(
            f"checkpoint: {count / 1e6:.1f} M params, {params_bytes(params) / 2**20:.1f} MiB of "
            f"float32 ({args.layers} layers of {args.width}, tied head), written in "
            f"{time.perf_counter() - started:.0f} s; GPU: {'yes' if gpu else 'no (CPU build)'}"
        )
        arguments = [*NCCL_SERVER_FLAGS, "--gpu-memory-utilization", "0.35"] if gpu else []
        started = time.perf_counter()
        with VLLMEngine.start(
            folder, max_model_len=args.max_len, model=model, arguments=arguments
        ) as engine:
            print(f"vLLM ready in {time.perf_counter() - started:.1f} s")
            rate = trio.run(alone, engine, args)
            print(f"vLLM alone: {rate:.1f} tokens/s ({args.calls} calls of {args.tokens} tokens)")
            train(folder, engine, root, args)

            versions = itertools.count(10_000)  # past every version dew train pushed
            pushed = sharpened(params)
            seconds = best(lambda: engine.load(pushed, next(versions)), args.pushes)
            size = params_bytes(pushed) / 2**30
            print(
                f"folder push: {seconds:.2f} s ({size / seconds:.2f} GiB/s, best of {args.pushes})"
            )
            check_push("folder", engine, model, pushed, args)
            if not gpu:
                print("NCCL push: not measured (no CUDA GPU here)")
                return
            publisher = NCCLPublisher(engine, model, master_port=free_port())
            pushed = params  # the checkpoint's own weights: far from the sharpened ones served
            seconds = best(lambda: publisher.load(pushed, next(versions)), args.pushes)
            print(
                f"NCCL push:   {seconds:.2f} s ({size / seconds:.2f} GiB/s, best of {args.pushes})"
            )
            check_push("NCCL", engine, model, pushed, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint, a short run")
    parser.add_argument("--width", type=int, default=1536, help="hidden width (1536)")
    parser.add_argument("--layers", type=int, default=24, help="layers (24)")
    parser.add_argument("--calls", type=int, default=64, help="concurrent calls (64)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per call (256)")
    parser.add_argument("--steps", type=int, default=10, help="dew train's updates (10)")
    parser.add_argument("--pushes", type=int, default=3, help="pushes each way (3)")
    args = parser.parse_args()
    args.train = []
    if args.smoke:
        args.width, args.layers, args.calls, args.tokens = 128, 1, 4, 8
        args.steps, args.pushes = 2, 1
        args.train = ["--batch-size", "2", "--groups", "4", "--ahead", "1"]
    args.max_len = min(1024, 12 + args.tokens + 1 + 512)
    main(args)
