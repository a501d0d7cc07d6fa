"""Decode throughput of RolloutServer: 32 concurrent calls against 1, same run, same model.

Concurrent calls share each decode step, so 32 calls should draw many times the tokens per second
of one call alone. Prints tokens/s for one call and for 32 on a 32-slot server (the ratio is the
figure to watch, target >= 8x), and for one call on a 1-slot server, whose smaller step is the
fairest single-call baseline.

    python benchmarks/engine.py [--smoke]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import trio

from dew import models
from dew.serve import RolloutServer


async def throughput(server: RolloutServer, calls: int, *, prompt_len: int, tokens: int) -> float:
    """Tokens drawn per second by `calls` concurrent calls of `tokens` tokens each."""
    drawn = []

    async def one(index: int) -> None:
        prompt = (np.arange(prompt_len, dtype=np.int32) + index) % 256
        call = await server.generate(prompt, max_tokens=tokens, key=index)
        drawn.append(len(call.completion))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(calls):
            nursery.start_soon(one, index)
    elapsed = time.perf_counter() - start
    assert sum(drawn) == calls * tokens, "a call stopped early"
    return sum(drawn) / elapsed


async def main(smoke: bool) -> None:
    if smoke:
        config = models.TransformerConfig(d_model=32, heads=2, layers=1, d_ff=64, max_len=64)
        prompt_len, tokens, slots = 8, 16, 32
    else:
        config = models.TransformerConfig(d_model=128, heads=4, layers=2, d_ff=512, max_len=256)
        prompt_len, tokens, slots = 16, 200, 32
    params = models.init(jax.random.key(0), config)
    shape = dict(prompt_len=prompt_len, tokens=tokens)
    print(
        f"model d_model={config.d_model} layers={config.layers} max_len={config.max_len}; "
        f"prompt {prompt_len} tokens, {tokens} drawn per call; backend {jax.default_backend()}"
    )
    async with RolloutServer(config, params, slots=slots) as server:
        await throughput(server, 1, prompt_len=prompt_len, tokens=2)
        alone = await throughput(server, 1, **shape)
        together = await throughput(server, slots, **shape)
        steps = server.stats().steps
    async with RolloutServer(config, params, slots=1) as server:
        await throughput(server, 1, prompt_len=prompt_len, tokens=2)
        single_slot = await throughput(server, 1, **shape)
    print(f"1 call, {slots}-slot server:   {alone:10.1f} tokens/s")
    print(f"{slots} calls, {slots}-slot server: {together:10.1f} tokens/s")
    print(f"1 call, 1-slot server:     {single_slot:10.1f} tokens/s")
    print(f"ratio {slots} calls / 1 call (same server): {together / alone:.1f}x (target >= 8x)")
    print(f"ratio {slots} calls / 1 call on a 1-slot server: {together / single_slot:.1f}x")
    print(f"engine steps on the {slots}-slot server: {steps}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a short run")
    trio.run(main, parser.parse_args().smoke)
