"""The engine's key/value cache, held only as far as its calls reach.

dew's models keep a cache in blocks of positions that double (`dew.models.cache_blocks`: 0..32,
32..64, 64..128, ...), one array per block in each layer's keys and values, and a cache made
for a shorter length is the first blocks of the longer one. So the engine need not hold every
slot at `max_len` from its start: it holds the blocks its running calls reach (the longest
call's length, rounded up to a block's end), adds the next block when a call's prompt or its
next token needs it, and lets the later ones go when the calls that reached them end, and
when it falls idle. A run of 128 slots at a 4,096-token context whose calls are mostly short
then holds a fraction of the 4,096 x 128 positions, and an engine idle through the trainer's
update (where a run's memory peaks) holds one block.

Each count of blocks is one more shape to the engine's steps, compiled on its first use, at
most one per block (8 up to 4,096 positions). A model whose cache is laid out otherwise (a
model of one's own) is held whole, as it always was.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dew.models import cache_blocks


def blocked(model: Any, *, slots: int, max_len: int) -> bool:
    """Whether `model.init_cache` lays its cache out in `cache_blocks(max_len)`'s blocks, one
    list of arrays per layer and name whose third axis is the block's positions, and lays a
    shorter one out as the first of those blocks: only such a cache can grow and shrink.
    Traced, not allocated."""

    def shape(length: int):
        return jax.eval_shape(lambda: model.init_cache(slots=slots, max_len=length))

    full, first = shape(max_len), shape(cache_blocks(max_len)[0][1])
    sizes = [stop - start for start, stop in cache_blocks(max_len)]

    def laid_out(cache, want: list[int]) -> bool:
        return isinstance(cache, list) and all(
            isinstance(layer, dict)
            and all(
                isinstance(blocks, list)
                and [getattr(block, "shape", (0, 0, 0))[2:3] for block in blocks]
                == [(size,) for size in want]
                for blocks in layer.values()
            )
            for layer in cache
        )

    return (
        laid_out(full, sizes)
        and laid_out(first, sizes[:1])
        and len(full) == len(first)
        and all(
            held.keys() == short.keys() and all(held[name][0] == short[name][0] for name in held)
            for held, short in zip(full, first, strict=False)
        )
    )


def reach(max_len: int, needed: int) -> int:
    """The positions the fewest blocks of `cache_blocks(max_len)` holding positions
    0..needed - 1 cover (one block at least)."""
    for _, stop in cache_blocks(max_len):
        if stop >= needed:
            return stop
    return max_len


def resized(model: Any, cache: list[dict], *, slots: int, length: int) -> list[dict]:
    """`cache` holding positions 0..length - 1 (a block's end): its own blocks up to there,
    as they are, and zeros laid out as `model.init_cache`'s past its end. Only the added blocks
    are allocated: the whole cache of the new length is never made, even for a moment."""
    layout = jax.eval_shape(lambda: model.init_cache(slots=slots, max_len=length))
    return [
        {
            name: [
                *held[name][: len(blocks)],
                *(jnp.zeros(block.shape, block.dtype) for block in blocks[len(held[name]) :]),
            ]
            for name, blocks in shapes.items()
        }
        for held, shapes in zip(cache, layout, strict=True)
    ]
