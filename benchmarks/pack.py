"""Row fill of `pack` at offered loads around the batch's capacity, beside the trivial bound.

The scheduler packs only the groups it admitted, so a cut group is rollouts thrown away: the
fair test of `pack` offers about what the rows hold. Groups of sessions with lognormal chain
lengths (sigma 1, clipped to a row, so no group is cut as too long) are offered in admission
order until their tokens reach `load` times the batch's `rows * width` cells; at load 1.0 the
group that crosses the capacity cannot fit, so one cut is the least any packer can do.

For each load it prints, over `--repeats` batches: the trivial bound min(1, tokens / cells);
the in-order bound (cells counted alone, groups kept in admission order while they fit: no
packer that keeps that order does better); the fill, its ratio to both, and the groups cut;
the same for group-by-group best fit (each group's chains longest first beside the earlier
ones, never moving them: `pack` before it learnt to lay a batch again); tokens packed per
second. Targets at load 1.0: at most one group cut per batch, mean fill >= 0.97. The old
figure, fill at 1.5x the capacity with a third of the groups cut, is printed beside.

    python benchmarks/pack.py            # rows=64 width=2048 groups of 8, 40 batches per load
    python benchmarks/pack.py --smoke    # a tiny, fast run
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dew.data import Task
from dew.objectives.rl.sessions import Call, Label, Session, Status, pack

LOADS = (0.8, 0.9, 1.0, 1.2, 1.5)
TARGET_LOAD, TARGET_FILL = 1.0, 0.97


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
) -> tuple[list[list[Session]], list[list[int]]]:
    """Groups in admission order until they hold `cells` tokens, and each group's chain lengths."""
    groups, chains, offered = [], [], 0
    while offered < cells:
        group, lengths_of_group = [], []
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
            lengths_of_group += lengths.tolist()
            offered += int(lengths.sum())
        groups.append(group)
        chains.append(lengths_of_group)
    return groups, chains


def group_by_group(chains: list[list[int]], *, width: int, rows: int) -> tuple[int, int]:
    """Cells used and groups cut by best fit one group at a time: each group's chains longest
    first, each into the fullest row that holds it, the group cut if one finds none."""
    free = np.full(rows, width)
    used = cut = 0
    for lengths in chains:
        trial = free.copy()
        for length in sorted(lengths, reverse=True):
            fits = np.flatnonzero(trial >= length)
            if not len(fits):
                cut += 1
                break
            trial[fits[np.argmin(trial[fits])]] -= length
        else:
            free, used = trial, used + sum(lengths)
    return used, cut


def in_order(chains: list[list[int]], *, cells: int) -> tuple[int, int]:
    """Cells used and groups cut by counting cells alone, groups in admission order: a group
    is kept while the tokens kept so far and its own fit the cells. No packer that keeps
    admission order does better, whatever the rows' shapes."""
    used = cut = 0
    for lengths in chains:
        if used + sum(lengths) <= cells:
            used += sum(lengths)
        else:
            cut += 1
    return used, cut


def measure(rng, load: float, args) -> dict[str, list[float]]:
    """Per batch at one offered load: bound, fill, cuts, their group-by-group twins, and the
    tokens packed per second."""
    cells = args.rows * args.width
    figures: dict[str, list[float]] = {
        k: []
        for k in (
            "groups",
            "offered",
            "bound",
            "in_order",
            "fill",
            "cut",
            "gbg_fill",
            "gbg_cut",
            "rate",
        )
    }
    for _ in range(args.repeats):
        groups, chains = _offer(
            rng,
            cells=int(load * cells),
            width=args.width,
            group_size=args.group_size,
            median=args.median,
        )
        offered = sum(map(sum, chains))
        start = time.perf_counter()
        packed = pack(groups, width=args.width, rows=args.rows)
        seconds = time.perf_counter() - start
        used, gbg_cut = group_by_group(chains, width=args.width, rows=args.rows)
        figures["groups"].append(len(groups))
        figures["offered"].append(offered / cells)
        figures["bound"].append(min(1.0, offered / cells))
        figures["in_order"].append(in_order(chains, cells=cells)[0] / cells)
        figures["fill"].append(packed.fill)
        figures["cut"].append(len(packed.cut))
        figures["gbg_fill"].append(used / cells)
        figures["gbg_cut"].append(gbg_cut)
        figures["rate"].append(packed.fill * cells / seconds)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--median", type=float, default=256.0, help="median chain length")
    parser.add_argument("--repeats", type=int, default=40, help="batches per load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny, fast run")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.width, args.median, args.repeats = 8, 512, 32.0, 2

    rng = np.random.default_rng(args.seed)
    print(
        f"pack rows={args.rows} width={args.width} group_size={args.group_size} "
        f"median_chain={args.median:g} sigma=1, {args.repeats} batches per load"
    )
    print(
        "  load offered | bound in-order | fill mean/min  fill/bound fill/in-order  cut mean/max"
        " | group-by-group fill  cut mean/max | tokens packed/s"
    )
    results = {}
    for load in LOADS:
        f = {k: np.array(v) for k, v in measure(rng, load, args).items()}
        results[load] = f
        print(
            f"  {load:4.1f} {f['offered'].mean():7.3f} | {f['bound'].mean():5.3f}"
            f" {f['in_order'].mean():8.3f} | {f['fill'].mean():.4f}/{f['fill'].min():.4f}"
            f" {np.mean(f['fill'] / f['bound']):11.4f} {np.mean(f['fill'] / f['in_order']):13.4f}"
            f"  {f['cut'].mean():5.2f}/{f['cut'].max():<3.0f}"
            f" | {f['gbg_fill'].mean():19.4f}"
            f"  {f['gbg_cut'].mean():5.2f}/{f['gbg_cut'].max():<3.0f}"
            f" | {np.median(f['rate']):15,.0f}"
        )
    at, old = results[TARGET_LOAD], results[1.5]
    print(
        f"fair: load {TARGET_LOAD:g}: mean fill {at['fill'].mean():.4f} (target >= {TARGET_FILL}; "
        f"in-order bound {at['in_order'].mean():.4f}), at most {at['cut'].max():.0f} group(s) "
        f"cut per batch (target <= 1; group by group: {at['gbg_cut'].max():.0f})"
    )
    print(
        f"old:  load 1.5: mean fill {old['fill'].mean():.4f} (target was >= 0.95) with "
        f"{old['cut'].mean():.1f} of {old['groups'].mean():.1f} groups cut per batch"
    )


if __name__ == "__main__":
    main()
