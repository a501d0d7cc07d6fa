"""What a pool of processes buys `dew train`: samples/s of 1, 2 and 4 processes side by side, and
the pool's collectives as a share of a step.

For each pool size N it measures two things:

- end to end: `dew train --processes N` on the default task (a smaller model, one global batch of
  `batch_size` tasks split over the processes); samples/s is the rollouts of a step over the
  median `seconds/step` of the steps after the first `warmup` (which compile);
- the collectives, in a pool of N processes of this script (`--worker`) at the trainer's shapes:
  each process times the pool's agreement, the proximal rescoring over the pool's batch, and the
  data-parallel update, and the same update on its own rows alone; the update's excess over the
  lone update is the gradient reduction (with the wait for the slowest process: on a machine
  with fewer cores than processes, mostly the wait for the other process to be scheduled).
  Their sum is shown as a share of the end-to-end step; the two are measured in separate runs,
  so on a busy machine the share is a rough figure.

    python benchmarks/parallel.py [--smoke] [--processes 1,2,4]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dew._launch import run_pool

# dew train's options for the end-to-end runs: the default task, a model small enough that the
# 2-core machine spends its time on the pool rather than on the model alone.
TRAIN = {"d-model": 32, "layers": 1, "heads": 2, "d-ff": 64, "groups": 8, "checkpoint-every": 1000}


def end_to_end(
    processes: int, *, steps: int, batch_size: int, groups: int, warmup: int
) -> dict[str, float]:
    """Run `dew train --processes N` in a fresh folder; samples/s and step seconds after warmup."""
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        options = {**TRAIN, "groups": groups, "steps": steps, "batch-size": batch_size}
        command = [sys.executable, "-m", "dew", "train", "--run", str(run)]
        command += [f"--{name}={value}" for name, value in options.items()]
        command += ["--processes", str(processes)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            logs = "".join(p.read_text() for p in sorted((run / "logs").glob("*.log")))
            raise RuntimeError(f"dew train --processes {processes} failed:\n{done.stderr}\n{logs}")
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = statistics.median(line["seconds/step"] for line in lines[warmup:])
    samples = batch_size * groups
    return {"samples_per_s": samples / step, "step_s": step}


def collectives(
    processes: int, *, steps: int, batch_size: int, groups: int, warmup: int
) -> dict[str, float]:
    """Run N `--worker` processes of this script as a pool; process 0's median timings."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        commands = [
            [sys.executable, __file__, "--worker", f"{port},{index},{processes}"]
            + ["--steps", str(steps), "--batch-size", str(batch_size), "--warmup", str(warmup)]
            + ["--groups", str(groups)]
            for index in range(processes)
        ]
        logs = [Path(folder) / f"worker-{index}.log" for index in range(processes)]
        echo = io.StringIO()
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        status = run_pool(commands, logs, echo=echo, env=env, report=sys.stderr)
        if status != 0:
            text = "".join(log.read_text() for log in logs)
            raise RuntimeError(f"the pool of {processes} workers failed ({status}):\n{text}")
    return json.loads(echo.getvalue().strip().splitlines()[-1])


def worker(spec: str, *, steps: int, batch_size: int, groups: int, warmup: int) -> None:
    """One process of the timing pool: the trainer's per-process shapes, timed call by call."""
    import jax
    import optax

    # Not dew.train: its imports (the trainer's plots among them) would only slow the start.
    from dew import _pool_guard, models
    from dew.objectives.rl.grpo import GRPOObjective
    from dew.parallel import DataParallelUpdate, DistributedPool, default_pool, local_copy

    port, index, processes = map(int, spec.split(","))
    if processes > 1:
        _pool_guard.join(f"127.0.0.1:{port}", processes, index)
    width = 64  # about the default task's packed row (two chains of its prompt and reply)
    rows = batch_size // processes * groups // 2
    model_config = models.TransformerConfig(
        d_model=TRAIN["d-model"],
        layers=TRAIN["layers"],
        heads=TRAIN["heads"],
        d_ff=TRAIN["d-ff"],
        max_len=width,
    )
    objective = GRPOObjective(models.model(model_config))
    variables = models.init(jax.random.key(0), model_config)
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(variables)
    pool = DistributedPool() if processes > 1 else default_pool()
    parallel = DataParallelUpdate(objective.update_fn(optimizer))
    alone = objective.update_fn(optimizer)
    batch = _rows(np.random.default_rng(index), rows, width)
    timings: dict[str, list[float]] = {"agree": [], "rescore": [], "update": [], "alone": []}
    for step in range(warmup + steps):
        started = time.perf_counter()
        pool.agree(None)
        agreed = time.perf_counter()
        batch["proximal_logprobs"] = pool.rescore(objective, variables, batch)
        rescored = time.perf_counter()
        pooled = parallel(variables, opt_state, batch)
        jax.block_until_ready(pooled[0])
        updated = time.perf_counter()
        jax.block_until_ready(alone(variables, opt_state, batch)[0])
        finished = time.perf_counter()
        variables, opt_state = local_copy(pooled[0]), local_copy(pooled[1])
        if step >= warmup:
            for name, seconds in zip(
                timings,
                (agreed - started, rescored - agreed, updated - rescored, finished - updated),
                strict=True,
            ):
                timings[name].append(seconds)
    medians = {name: statistics.median(values) for name, values in timings.items()}
    medians["reduce"] = max(0.0, medians["update"] - medians["alone"])
    if index == 0:
        print(json.dumps(medians), flush=True)


def _rows(rng: np.random.Generator, rows: int, width: int) -> dict[str, np.ndarray]:
    """Packed rows of two chains each, trained on their second halves, as the trainer packs."""
    half = width // 2
    positions = np.tile(np.arange(half, dtype=np.int32), (rows, 2))
    segments = np.repeat(np.array([1, 2], np.int32), half)[None].repeat(rows, 0)
    trained = (positions >= half // 2).astype(np.float32)
    return {
        "tokens": rng.integers(1, 200, (rows, width), dtype=np.int32),
        "positions": positions,
        "segment_ids": segments,
        "loss_mask": trained,
        "advantages": rng.normal(size=(rows, width)).astype(np.float32) * trained,
        "behavior_logprobs": np.full((rows, width), -3.0, np.float32) * trained,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="a pool of 2 processes, 1 step of 2 x 2 rollouts"
    )
    parser.add_argument("--processes", default=None, help="pool sizes (default: 1,2,4)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--groups", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(
            args.worker,
            steps=args.steps,
            batch_size=args.batch_size,
            groups=args.groups,
            warmup=args.warmup,
        )
        return
    sizes = [int(n) for n in (args.processes or ("2" if args.smoke else "1,2,4")).split(",")]
    # The smoke run checks that every part runs and prints; its figures mean nothing, so its one
    # step is timed, compiles and all (no warm-up step before it).
    steps, warmup, batch_size, groups = (1, 0, 2, 2) if args.smoke else (20, 5, 8, TRAIN["groups"])
    print(
        f"dew train on the default task, batch of {batch_size} tasks x {groups} "
        f"rollouts split over the pool; {os.cpu_count()} CPUs"
    )
    header = "processes  samples/s  step ms  agree ms  rescore ms  reduce ms  collectives/step"
    print(header)
    for processes in sizes:
        shape = {"batch_size": batch_size, "groups": groups, "warmup": warmup}
        e2e = end_to_end(processes, steps=warmup + steps, **shape)
        pool = collectives(processes, steps=steps, **shape)
        share = (pool["agree"] + pool["rescore"] + pool["reduce"]) / e2e["step_s"]
        print(
            f"{processes:>9}  {e2e['samples_per_s']:>9.1f}  {1000 * e2e['step_s']:>7.1f}  "
            f"{1000 * pool['agree']:>8.2f}  {1000 * pool['rescore']:>10.2f}  "
            f"{1000 * pool['reduce']:>9.2f}  {share:>16.1%}"
        )


if __name__ == "__main__":
    main()
