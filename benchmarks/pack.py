"""Packing throughput and row fill of `pack` when offered more tokens than its rows hold.

Groups of sessions with lognormal chain lengths (clipped to a row, so no group is cut as
too long) are offered at `--offered` times the batch's `rows * width` cells; `pack` keeps the
groups that fit in admission order and cuts the rest. Prints tokens packed per second, tokens
offered per second, and the row fill (target >= 0.95).

    python benchmarks/pack.py            # rows=64 width=2048 groups of 8
    python benchmarks/pack.py --smoke    # a tiny, fast run
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dew.data import Task
from dew.objectives.rl.sessions import Call, Label, Session, Status, pack


def _chain_calls(rng: np.random.Generator, length: int, version: int) -> list[Call]:
    """One chain of `length` tokens made of one call, or of two where the second extends it."""
    turns = 2 if length >= 8 and rng.random() < 0.5 else 1
    cuts = np.sort(rng.choice(np.arange(1, length), size=2 * turns - 1, replace=False))
    bounds = [0, *cuts.tolist(), length]
    tokens = rng.integers(0, 32000, size=length, dtype=np.int32)
    calls = []
    for turn in range(turns):
        prompt_end, completion_end = bounds[2 * turn + 1], bounds[2 * turn + 2]
        completion = tokens[prompt_end:completion_end]
        calls.append(
            Call(
                prompt=tokens[:prompt_end],
                completion=completion,
                logprobs=-rng.exponential(size=len(completion)).astype(np.float32),
                version=version,
            )
        )
    return calls


def _offer(
    rng: np.random.Generator, *, cells: int, width: int, group_size: int, median: float
) -> tuple[list[list[Session]], int]:
    """Groups in admission order until they hold `cells` tokens, and the tokens they hold."""
    groups, offered = [], 0
    while offered < cells:
        group = []
        for sample in range(group_size):
            lengths = np.clip(
                rng.lognormal(np.log(median), 1.0, size=rng.integers(1, 4)), 2, width
            ).astype(int)
            calls = [call for n in lengths for call in _chain_calls(rng, int(n), version=3)]
            group.append(
                Session(
                    status=Status.COMPLETED,
                    calls=calls,
                    reward=float(rng.random()),
                    task=Task(f"task-{len(groups)}"),
                    label=Label(len(groups), sample, 0),
                )
            )
            offered += int(lengths.sum())
        groups.append(group)
    return groups, offered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--median", type=float, default=256.0, help="median chain length")
    parser.add_argument("--offered", type=float, default=1.5, help="tokens offered / cells")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a tiny, fast run")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.width, args.median, args.repeats = 8, 512, 32.0, 2

    rng = np.random.default_rng(0)
    cells = args.rows * args.width
    fills, packed_rates, offered_rates, cut = [], [], [], 0
    for _ in range(args.repeats):
        groups, offered = _offer(
            rng,
            cells=int(args.offered * cells),
            width=args.width,
            group_size=args.group_size,
            median=args.median,
        )
        start = time.perf_counter()
        packed = pack(groups, width=args.width, rows=args.rows)
        seconds = time.perf_counter() - start
        fills.append(packed.fill)
        packed_rates.append(packed.fill * cells / seconds)
        offered_rates.append(offered / seconds)
        cut += len(packed.cut)
    print(
        f"pack rows={args.rows} width={args.width} group_size={args.group_size} "
        f"median_chain={args.median:g} sigma=1 offered={args.offered:g}x "
        f"repeats={args.repeats}"
    )
    print(f"  fill             mean {np.mean(fills):.4f}  min {np.min(fills):.4f}  (target 0.95)")
    print(f"  tokens packed/s  {np.median(packed_rates):,.0f}")
    print(f"  tokens offered/s {np.median(offered_rates):,.0f}")
    print(f"  groups cut       {cut / args.repeats:.1f} per batch")


if __name__ == "__main__":
    main()
