"""Packed against padded scoring: tokens/s of GRPOObjective.packed_log_probs over the same chains.

Rollout lengths are heavy-tailed (lognormal, sigma 1), so padding every chain to the longest
wastes most of each row; packing several chains per row, each its own segment, wastes little.
Three layouts are scored with the same objective and transformer, each shape compiled by an
untimed first pass, then timed in turn `--repeats` times, each keeping its fastest pass:

- packed: chains first fit into rows of `--width`, in calls of `--rows` rows (the trainer's
  fixed shape);
- bucketed, the fair baseline: what a user would write without packing, each chain padded to
  the power of two at or above its length and batched with the chains of its bucket, each call
  holding up to the same `rows * width` cells as a packed call, the last call of a bucket only
  the power of two of rows at or above what it needs (so a training run compiles a bounded
  number of shapes, not new ones every step);
- padded, the old baseline: every chain padded to the longest, `--rows` rows a call.

Real (non-padding) tokens per second are reported for each, with the model FLOPs each layout
spends (matmuls at every cell, attention over every row's full width: a packed row of 512
attends over 512 keys where a bucket of 64 attends over 64) and the FLOP/s reached, and
packed / bucketed (target >= 2x) beside packed / padded. The per-chain log-prob sums of the
layouts are compared (per token, at float32 tolerance), so a fast but wrong path fails the run.

Three ceilings on packed / bucketed are printed beside the measured ratio. The first is the
cells': a power-of-two bucket holds more than half its cells' worth of its chain, so bucketed
calls spend fewer than 2 cells a token (plus what their trimmed last calls leave empty: 2.06 at
the defaults), and no packing, at 1 cell a token, saves more than that on the work done per
cell (every matmul, the output head included); only attention can add to it. The other two are
FLOP ceilings: the layouts' FLOPs as laid out, and a packed layout that fills every cell and
attends only inside each chain. The first (1.26x at the defaults) bounds what this model's
forward can reach, since a packed row's attention spans its whole width under a segment mask;
only the second (2.15x) clears 2x, and it needs a segment-aware (block-diagonal) attention
kernel, which XLA on CPU does not offer. The >= 2x target therefore sits at the edge of what
this workload allows: the more of the work is done per cell (a wider model, a larger
vocabulary), the nearer every ceiling comes to the cells' 2.06x; only a model whose attention
dominates the work, scored by a segment-aware kernel, leaves room above it.

    python benchmarks/logprobs.py            # d_model 128, 2 layers, 256 chains
    python benchmarks/logprobs.py --smoke    # tiny, for CI
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from dew import models
from dew.objectives.rl.grpo import GRPOObjective


def lognormal_lengths(rng: np.random.Generator, count: int, median: int, longest: int):
    """Chain lengths, lognormal with sigma 1 around `median`, in [2, longest]."""
    lengths = np.ceil(rng.lognormal(np.log(median), 1.0, count))
    return np.clip(lengths, 2, longest).astype(int)


def first_fit(lengths, width: int) -> list[list[int]]:
    """Chain indices per row: each chain, in order, into the first row with room for it."""
    rows: list[list[int]] = []
    room: list[int] = []
    for chain, length in enumerate(lengths):
        row = next((r for r, free in enumerate(room) if free >= length), None)
        if row is None:
            rows.append([])
            room.append(width)
            row = len(rows) - 1
        rows[row].append(chain)
        room[row] -= length
    return rows


def lay_out(chains, layout: list[list[int]], width: int, rows_per_call: int, *, trim=False):
    """Calls of `rows_per_call` rows holding `layout`, and where each chain lies.

    Args:
        trim: give the last call only the power of two of rows at or above what it needs.

    Returns:
        The batches (tokens, positions, segment_ids, each int32[rows_per_call, width]) and, per
        chain that `layout` holds, (call, row, start); None for the others.
    """
    calls = -(-len(layout) // rows_per_call)
    last = len(layout) - (calls - 1) * rows_per_call
    if trim:
        last = min(rows_per_call, 1 << (last - 1).bit_length())
    shape = ((calls - 1) * rows_per_call + (last if trim else rows_per_call), width)
    tokens, positions, segment_ids = (np.zeros(shape, np.int32) for _ in range(3))
    where = [None] * len(chains)
    for row, members in enumerate(layout):
        start = 0
        for segment, chain in enumerate(members, start=1):
            span = slice(start, start + len(chains[chain]))
            tokens[row, span] = chains[chain]
            positions[row, span] = np.arange(len(chains[chain]))
            segment_ids[row, span] = segment
            where[chain] = (row // rows_per_call, row % rows_per_call, start)
            start += len(chains[chain])
    batches = [
        {
            "tokens": tokens[i : i + rows_per_call],
            "positions": positions[i : i + rows_per_call],
            "segment_ids": segment_ids[i : i + rows_per_call],
        }
        for i in range(0, shape[0], rows_per_call)
    ]
    return batches, where


def bucketed(chains, lengths, width: int, rows: int):
    """Each chain padded to the power of two at or above its length, batched per bucket in calls
    of up to `rows * width` cells (the last of a bucket with a power of two of rows).

    Returns:
        The batches and, per chain, (call, row, start), the call counted over all buckets.
    """
    buckets = [1 << (int(n) - 1).bit_length() for n in lengths]
    batches, where = [], [None] * len(chains)
    for bucket in sorted(set(buckets)):
        members = [c for c, b in enumerate(buckets) if b == bucket]
        bucket_batches, at = lay_out(
            chains, [[c] for c in members], bucket, max(1, rows * width // bucket), trim=True
        )
        for c in members:
            call, row, start = at[c]
            where[c] = (len(batches) + call, row, start)
        batches += bucket_batches
    return batches, where


def call_flops(config: models.TransformerConfig, rows: int, width: int) -> float:
    """The transformer's FLOPs over one [rows, width] call: its matmuls at every cell, and the
    attention of every query over the row's `width` keys (scores and mixing), padding or not."""
    d = config.d_model
    per_cell = 2 * config.layers * (4 * d * d + 2 * d * config.d_ff) + 2 * d * config.vocab
    attention = 2 * 2 * config.layers * width * d
    return rows * width * (per_cell + attention)


def flop_bounds(config: models.TransformerConfig, lengths, layouts: dict) -> tuple[float, float]:
    """Two ceilings on packed / bucketed that no kernel on these layouts can pass: the ratio of
    the two layouts' FLOPs as laid out (full-row attention in packed rows), and that of a
    packed layout that fills every cell and attends only inside each segment (`len**2` a
    chain) against the bucketed layout as laid out."""
    flops = {
        name: sum(call_flops(config, *batch["tokens"].shape) for batch in batches)
        for name, (batches, _) in layouts.items()
    }
    ideal = sum(call_flops(config, 1, int(n)) for n in lengths)
    return flops["bucketed"] / flops["packed"], flops["bucketed"] / ideal


def score(objective: GRPOObjective, params, layouts: dict, repeats: int):
    """Each layout's log-probs of every call and its best seconds per pass.

    Every shape is compiled by an untimed first pass; then the layouts are timed in turn,
    `repeats` passes each, interleaved so that a shared machine's load falls on all of them
    alike, and each keeps its fastest pass.
    """
    scored = {
        name: [objective.packed_log_probs(params, batch) for batch in batches]
        for name, (batches, _) in layouts.items()
    }
    jax.block_until_ready(scored)
    best = dict.fromkeys(layouts, float("inf"))
    for _ in range(repeats):
        for name, (batches, _) in layouts.items():
            started = time.perf_counter()
            jax.block_until_ready([objective.packed_log_probs(params, batch) for batch in batches])
            best[name] = min(best[name], time.perf_counter() - started)
    return {name: [np.asarray(s) for s in values] for name, values in scored.items()}, best


def chain_sums(scored, where, lengths) -> np.ndarray:
    return np.array(
        [
            scored[call][row, start : start + length].sum(dtype=np.float64)
            for (call, row, start), length in zip(where, lengths, strict=True)
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny, fast run")
    parser.add_argument("--chains", type=int, default=256)
    parser.add_argument("--median", type=int, default=32, help="median chain length")
    parser.add_argument("--width", type=int, default=512, help="packed row width, longest chain")
    parser.add_argument("--rows", type=int, default=16, help="rows per model call")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.smoke:
        args.chains, args.median, args.width, args.rows = 24, 8, 64, 4
        args.d_model, args.layers, args.repeats = 32, 1, 1
    least = {"chains": 1, "median": 1, "width": 2, "rows": 1, "layers": 1, "repeats": 1}
    for name, low in least.items():
        if getattr(args, name) < low:
            parser.error(f"--{name} must be at least {low}, got {getattr(args, name)}")
    if args.d_model < 4 or args.d_model % 4:
        parser.error(f"--d-model must be a positive multiple of the 4 heads, got {args.d_model}")

    config = models.TransformerConfig(
        vocab=260,
        d_model=args.d_model,
        heads=4,
        layers=args.layers,
        d_ff=4 * args.d_model,
        max_len=args.width,
    )
    params = models.init(jax.random.key(args.seed), config)
    objective = GRPOObjective(models.model(config))
    rng = np.random.default_rng(args.seed)
    lengths = lognormal_lengths(rng, args.chains, args.median, args.width)
    chains = [rng.integers(0, config.vocab, n).astype(np.int32) for n in lengths]
    tokens = int(lengths.sum())

    packed_layout = first_fit(lengths, args.width)
    padded_width = int(lengths.max())
    layouts = {
        "packed": lay_out(chains, packed_layout, args.width, args.rows),
        "bucketed": bucketed(chains, lengths, args.width, args.rows),
        "padded": lay_out(chains, [[c] for c in range(len(chains))], padded_width, args.rows),
    }
    print(
        f"transformer d_model {config.d_model}, {config.layers} layers, vocab {config.vocab}; "
        f"{jax.default_backend()}"
    )
    print(
        f"{args.chains} chains, lognormal lengths (median {args.median}, sigma 1): "
        f"{tokens} tokens, mean {lengths.mean():.1f}, longest {padded_width}"
    )
    rates, sums = {}, {}
    scores, best = score(objective, params, layouts, args.repeats)
    for name, (batches, where) in layouts.items():
        seconds = best[name]
        sums[name] = chain_sums(scores[name], where, lengths)
        rates[name] = tokens / seconds
        cells = sum(batch["tokens"].size for batch in batches)
        shapes = sorted({batch["tokens"].shape for batch in batches}, key=lambda shape: shape[1])
        flops = sum(call_flops(config, *batch["tokens"].shape) for batch in batches)
        print(
            f"{name:>8}: {len(batches)} calls of shapes {', '.join(f'{r}x{w}' for r, w in shapes)},"
            f" fill {tokens / cells:.1%}; {flops / 1e9:.2f} GFLOP; {seconds * 1e3:.1f} ms,"
            f" {flops / seconds / 1e9:.1f} GFLOP/s, {rates[name]:,.0f} tokens/s"
        )
    print(f"fair: packed / bucketed {rates['packed'] / rates['bucketed']:.2f}x (target >= 2x)")
    print(f"old:  packed / padded   {rates['packed'] / rates['padded']:.2f}x (target was >= 2x)")
    bucketed_cells = sum(batch["tokens"].size for batch in layouts["bucketed"][0])
    print(
        f"cell ceiling on packed / bucketed: {bucketed_cells / tokens:.2f}x (bucketed cells per "
        "token: no packing saves more on the work done per cell)"
    )
    as_laid, ideal = flop_bounds(config, lengths, layouts)
    print(
        f"FLOP ceilings on packed / bucketed: {as_laid:.2f}x as laid out (packed rows attend "
        f"over their whole width); {ideal:.2f}x for packing that fills every cell and attends "
        "only inside each chain"
    )
    mismatch = max(
        float(np.max(np.abs(sums[name] - sums["packed"]) / lengths))
        for name in ("bucketed", "padded")
    )
    print(f"largest difference between layouts, per chain token: {mismatch:.1e}")
    if not mismatch < 1e-4:
        raise SystemExit(f"the layouts' scores differ by {mismatch}")


if __name__ == "__main__":
    main()
