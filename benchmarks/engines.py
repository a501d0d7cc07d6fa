"""dew's JAX engine against vLLM on the same checkpoint and prompts, and vLLM's push time.

One random Qwen2 checkpoint (float32, written by `transformers`) is served by a
`dew.serve.RolloutServer` (its `dew.models.hf` model) and by one vLLM server that dew starts
(`dew.serve.vllm.VLLMEngine`, vLLM's CPU build here). Both get the same `--calls` concurrent
calls of `--tokens` tokens on the same prompts, after a warm-up round that compiles every
shape; each engine is timed `--best-of` times, interleaved, keeping its best rate. Tokens/s
are printed side by side.

Then weight pushes into the vLLM server (`VLLMEngine.load`: the checkpoint folder written by
`dew.models.hf.save`, then pause, reload, version, resume): the write and the whole push, best
of `--best-of`, against the params' bytes, for the checkpoint of each `--widths` entry (one
server each); and how long a push holds the trio run it is made from: the longest gap between
the beats of a task beating every millisecond there, awaiting `load_async` (as the scheduler
does) against calling `load`.

    python benchmarks/engines.py                # widths 128 and 512
    python benchmarks/engines.py --smoke        # one tiny checkpoint, few calls
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import jax
import numpy as np
import trio

from dew.models import hf
from dew.serve import RolloutServer
from dew.serve.vllm import VLLMEngine

# The tests' tiny checkpoint maker (transformers' save_pretrained of a random Qwen2).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from _checkpoint import tiny_qwen2  # noqa: E402


async def throughput(engine, calls: int, *, tokens: int) -> float:
    """Tokens per second drawn by `calls` concurrent calls of `tokens` tokens each."""
    drawn = []

    async def one(index: int) -> None:
        prompt = (np.arange(12, dtype=np.int32) * 7 + index) % 300
        call = await engine.generate(prompt, max_tokens=tokens, key=index)
        drawn.append(len(call.completion))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(calls):
            nursery.start_soon(one, index)
    elapsed = time.perf_counter() - start
    assert sum(drawn) == calls * tokens, "a call stopped early"
    return sum(drawn) / elapsed


def params_bytes(params) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(params))


def mismatch(model, params, calls) -> tuple[float, float]:
    """The largest |behaviour - dew| log-prob over the calls' tokens, and the k3 estimate of
    KL(behaviour || dew): the engine's `mismatch/engine` at lag 0."""
    gaps = []
    for call in calls:
        tokens = np.concatenate([call.prompt, call.completion]).astype(np.int32)[None]
        positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
        logits = model(params, tokens, positions, np.ones_like(tokens))[0]
        logprobs = jax.nn.log_softmax(logits[len(call.prompt) - 1 : -1].astype(np.float32))
        ours = np.take_along_axis(np.asarray(logprobs), call.completion[:, None], axis=1)[:, 0]
        gaps.append(ours.astype(np.float64) - call.logprobs)
    log_rho = np.concatenate(gaps)
    return float(np.abs(log_rho).max()), float(np.mean(np.expm1(log_rho) - log_rho))


async def compare(folder: pathlib.Path, engine: VLLMEngine, args) -> None:
    model, params = hf.load(folder)
    server = RolloutServer(model, params, slots=args.calls, max_len=args.max_len)
    rates = {"dew": [], "vLLM": []}
    async with server, engine:
        for each in (server, engine):  # compiles every shape, warms vLLM's kernels
            await throughput(each, args.calls, tokens=args.tokens)
        for _ in range(args.best_of):
            rates["dew"].append(await throughput(server, args.calls, tokens=args.tokens))
            rates["vLLM"].append(await throughput(engine, args.calls, tokens=args.tokens))
        calls = [
            await engine.generate(np.arange(12, dtype=np.int32) + index, max_tokens=args.tokens)
            for index in range(4)
        ]
    gap, kl = mismatch(model, params, calls)
    print(f"vLLM's behaviour log-probs against dew's model: max gap {gap:.2e}, k3 KL {kl:.2e}")
    print(
        f"decode, {args.calls} concurrent calls of {args.tokens} tokens, "
        f"{params_bytes(params) / 2**20:.2f} MiB of float32 params:"
    )
    for name, measured in rates.items():
        print(f"  {name:5s} {max(measured):9.1f} tokens/s (best of {args.best_of})")
    print(f"  vLLM / dew: {max(rates['vLLM']) / max(rates['dew']):.2f}x")


def pushes(folder: pathlib.Path, engine: VLLMEngine, args) -> None:
    model, params = hf.load(folder)
    writes, totals = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for attempt in range(args.best_of):
            start = time.perf_counter()
            hf.save(pathlib.Path(scratch) / f"w{attempt}", model, params, tokenizer_from=folder)
            writes.append(time.perf_counter() - start)
    for version in range(1, args.best_of + 1):
        start = time.perf_counter()
        engine.load(params, version)
        totals.append(time.perf_counter() - start)
    size = params_bytes(params)
    print(
        f"push {size / 2**20:8.2f} MiB: write {min(writes):.3f} s, whole push {min(totals):.3f} s "
        f"({size / min(totals) / 2**20:.1f} MiB/s)"
    )
    version = args.best_of + 1

    async def awaited():
        await engine.load_async(params, version)

    async def blocking():
        engine.load(params, version + 1)

    print(
        f"  longest stall of the pushing trio run: {1e3 * trio.run(stall, awaited):.1f} ms "
        f"awaiting load_async, {1e3 * trio.run(stall, blocking):.1f} ms calling load"
    )


async def stall(push) -> float:
    """The longest gap, in seconds, between the beats of a task that beats every millisecond in
    the trio run that runs `push()`: how long the push held the run."""
    gaps = []
    pushing = True

    async def beat():
        last = time.perf_counter()
        while pushing:
            await trio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(beat)
        await trio.sleep(0.01)
        await push()
        pushing = False
    return max(gaps)


def main(args) -> None:
    with tempfile.TemporaryDirectory() as root:
        for index, width in enumerate(args.widths):
            folder = tiny_qwen2(
                pathlib.Path(root) / f"w{width}", hidden=width, layers=args.layers, max_len=256
            )
            started = time.perf_counter()
            with VLLMEngine.start(folder, max_model_len=args.max_len) as engine:
                print(
                    f"vLLM server of width {width} ready in {time.perf_counter() - started:.1f} s"
                )
                if index == 0:
                    trio.run(compare, folder, engine, args)
                pushes(folder, engine, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny checkpoint, few calls")
    parser.add_argument("--calls", type=int, default=16, help="concurrent calls (16)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per call (64)")
    parser.add_argument("--best-of", type=int, default=3, help="measurements each (3)")
    parser.add_argument("--layers", type=int, default=2, help="the checkpoints' layers (2)")
    parser.add_argument(
        "--widths", type=int, nargs="+", default=[128, 512], help="checkpoint widths (128 512)"
    )
    args = parser.parse_args()
    if args.smoke:
        args.calls, args.tokens, args.best_of, args.widths = 4, 8, 1, [128]
    args.max_len = 12 + args.tokens + 1
    main(args)
