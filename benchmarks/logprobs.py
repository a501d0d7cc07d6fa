"""Packed against padded scoring: tokens/s of GRPOObjective.packed_log_probs over the same chains.

Rollout lengths are heavy-tailed (lognormal, sigma 1), so padding every chain to the longest
wastes most of each row; packing several chains per row, each its own segment, wastes little.
Both layouts are scored with the same objective and the transformer in calls of the same number
of rows, after a warm-up call compiles each shape; real (non-padding) tokens per second are
reported for both, with their ratio (target: packed >= 2x padded). The per-chain log-prob sums of
the two layouts are compared (per token, at float32 tolerance), so a fast but wrong packed path
fails the run.

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


def lay_out(chains, layout: list[list[int]], width: int, rows_per_call: int):
    """Fixed-shape calls of `rows_per_call` rows holding `layout`, and where each chain lies.

    Returns:
        The batches (tokens, positions, segment_ids, each int32[rows_per_call, width]) and, per
        chain, (call, row, start).
    """
    calls = -(-len(layout) // rows_per_call)
    shape = (calls * rows_per_call, width)
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


def score(objective: GRPOObjective, params, batches, repeats: int):
    """Log-probs of every call (compiled by a first warm-up call) and the seconds per pass."""
    objective.packed_log_probs(params, batches[0]).block_until_ready()
    started = time.perf_counter()
    for _ in range(repeats):
        scored = [objective.packed_log_probs(params, batch) for batch in batches]
        jax.block_until_ready(scored)
    return [np.asarray(s) for s in scored], (time.perf_counter() - started) / repeats


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
    packed, packed_at = lay_out(chains, packed_layout, args.width, args.rows)
    padded_width = int(lengths.max())
    padded, padded_at = lay_out(chains, [[c] for c in range(len(chains))], padded_width, args.rows)

    packed_scores, packed_seconds = score(objective, params, packed, args.repeats)
    padded_scores, padded_seconds = score(objective, params, padded, args.repeats)
    difference = chain_sums(packed_scores, packed_at, lengths) - chain_sums(
        padded_scores, padded_at, lengths
    )
    mismatch = float(np.max(np.abs(difference) / lengths))

    packed_rate, padded_rate = tokens / packed_seconds, tokens / padded_seconds
    print(
        f"transformer d_model {config.d_model}, {config.layers} layers, vocab {config.vocab}; "
        f"{jax.default_backend()}"
    )
    print(
        f"{args.chains} chains, lognormal lengths (median {args.median}, sigma 1): "
        f"{tokens} tokens, mean {lengths.mean():.1f}, longest {padded_width}"
    )
    for name, layout, width, rows, seconds, rate in (
        ("packed", packed_layout, args.width, len(packed) * args.rows, packed_seconds, packed_rate),
        ("padded", chains, padded_width, len(padded) * args.rows, padded_seconds, padded_rate),
    ):
        print(
            f"{name}: {len(layout)} rows of {width} in {rows // args.rows} calls of {args.rows}, "
            f"fill {tokens / (rows * width):.1%}; {seconds * 1e3:.1f} ms, {rate:,.0f} tokens/s"
        )
    print(f"packed / padded: {packed_rate / padded_rate:.2f}x (target >= 2x)")
    print(f"largest difference between layouts, per chain token: {mismatch:.1e}")
    if not mismatch < 1e-4:
        raise SystemExit(f"packed and padded scores differ by {mismatch}")


if __name__ == "__main__":
    main()
