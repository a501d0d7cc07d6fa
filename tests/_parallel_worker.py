"""One process of a real `jax.distributed` pool, for tests/test_parallel.py.

Run as `python tests/_parallel_worker.py --port P --process I --processes N --out DIR --cases
a,b`: it joins the pool on the loopback port and runs each case in turn, in lockstep with the
other processes, writing what it saw to DIR/<case>-<I>.npz and DIR/<case>-<I>.json for the test
to compare. A case that raises is recorded, not fatal, so every process still reaches the next
case's collectives; a process still running after --timeout seconds dumps every thread's stack
and exits, so a hang fails the test rather than blocking it.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from dew import models
from dew.data import ArrayDataset
from dew.envs import SimulatedConfig, SimulatedEngine, SimulatedSource
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import pack
from dew.parallel import (
    DataParallelUpdate,
    DistributedPool,
    LocalPool,
    ProcessRows,
    default_pool,
    first_reader_batch,
    local_copy,
    pool_fields,
)

# The task rows of one process: its shard of the pool's, two to a batch.
BATCH_SIZE = 2
BATCHES = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--process", type=int, required=True)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--timeout", type=float, default=90.0)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.timeout, exit=True)

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.distributed.initialize(
        f"127.0.0.1:{args.port}", num_processes=args.processes, process_id=args.process
    )
    for case in args.cases.split(","):
        arrays: dict[str, np.ndarray] = {}
        facts: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            CASES[case](arrays, facts)
        except Exception as error:
            facts["raised"] = [type(error).__name__, str(error)]
        stem = args.out / f"{case}-{args.process}"
        np.savez(stem.with_suffix(".npz"), **arrays)
        stem.with_suffix(".json").write_text(json.dumps(facts))
        print(f"{case}: {time.perf_counter() - start:.2f}s", file=sys.stderr, flush=True)
    faulthandler.cancel_dump_traceback_later()


@functools.cache
def tiny() -> tuple[Any, Any, Any]:
    """A tiny transformer's objective for the pool, another for scoring alone, and variables.

    Shared by the cases, so one pool shape compiles once across all of them. The variables are
    drawn with NumPy (equal on every process): the model's own init runs op by op, slowly.
    """
    config = models.TransformerConfig(vocab=32, d_model=16, heads=2, layers=1, d_ff=32, max_len=64)
    shapes = jax.eval_shape(functools.partial(models.init, config=config), jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    variables = jax.tree.map(
        lambda shape: rng.normal(0.0, 0.3, shape.shape).astype(shape.dtype), shapes
    )
    return GRPOObjective(models.model(config)), GRPOObjective(models.model(config)), variables


def synthetic_rows(seed: int, rows: int, width: int) -> dict[str, np.ndarray]:
    """Packed-looking rows: two segments of random length in each row, then padding."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((rows, width), np.int32)
    positions = np.zeros((rows, width), np.int32)
    segment_ids = np.zeros((rows, width), np.int32)
    for r in range(rows):
        start = 0
        for segment, length in enumerate(rng.integers(1, width // 2, size=2), start=1):
            tokens[r, start : start + length] = rng.integers(1, 32, size=length)
            positions[r, start : start + length] = np.arange(length)
            segment_ids[r, start : start + length] = segment
            start += length
    return {"tokens": tokens, "positions": positions, "segment_ids": segment_ids}


def case_rescore(arrays, facts):
    """Two calls over the pool, each process's rows its own; each also scored alone."""
    objective, alone, variables = tiny()
    pool = DistributedPool()
    # Three rows a process: over two local devices the pool pads them for the scoring.
    for call in range(2):
        rows = synthetic_rows(100 * jax.process_index() + call, rows=3, width=64)
        arrays[f"pool{call}"] = pool.rescore(objective, variables, rows)
        arrays[f"alone{call}"] = LocalPool().rescore(alone, variables, rows)
        arrays[f"segments{call}"] = rows["segment_ids"]
    facts["local_devices"] = jax.local_device_count()


def case_agree(arrays, facts):
    """Process 0's admission fails once, then every admission succeeds."""
    pool = default_pool()
    facts["default_pool"] = type(pool).__name__
    try:
        pool.agree(KeyError("task 7 broke") if jax.process_index() == 0 else None)
    except Exception as error:
        facts["first"] = [type(error).__name__, str(error)]
    pool.agree(None)
    facts["second"] = "agreed"


def case_structure(arrays, facts):
    """The last process hands over rows of another width: every process refuses."""
    objective, _, variables = tiny()
    last = jax.process_index() == jax.process_count() - 1
    rows = synthetic_rows(0, rows=2, width=8 if last else 16)
    DistributedPool().rescore(objective, variables, rows)


def exact_values(index: int) -> dict[str, np.ndarray]:
    """Arrays whose values a float32 or int32 path would change: wide ints and floats, -0.0,
    subnormals, NaN payloads; plus bool, narrow, 0-d, empty and string arrays."""
    offset = np.int64(index)
    return {
        "int64": np.array([2**40 + 3, -(2**62) - 1, 7], np.int64) + offset,
        "uint64": np.array([2**64 - 1 - index], np.uint64),
        "float64": np.array([1 / 3, 1e-310, -0.0, np.pi + index], np.float64),
        "float32": np.array([1e-40, -0.0, -1e-45, np.float32(index)], np.float32),
        "nan_bits": np.array([0x7FC00001 + index, 0xFFA00000], np.uint32).view(np.float32),
        "float16": np.array([[6e-8, -0.0], [65504.0, index]], np.float16),
        "bool": np.array([True, False, index % 2 == 1]),
        "uint8": np.array([255, index], np.uint8),
        "scalar": np.array(2**40 + index, np.int64),
        "empty": np.zeros((0, 3), np.float64),
        "text": np.array([f"process {index}", "ü"]),
    }


def case_first_reader(arrays, facts):
    """Shares of two: the first reader's rows reach its share bit for bit; a share of one keeps
    its own; an array of Python objects is refused on every process."""
    index = jax.process_index()
    pool = DistributedPool(share_size=2)
    first = pool.is_first_reader()
    if first:
        own = synthetic_rows(index, rows=4, width=8)
        own["advantages"] = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
        own["advantages"] += np.float32(index)
        exact = exact_values(index)
    else:
        # A later reader samples nothing: it hands over an empty pack of the same shape.
        template = pack([], width=8, rows=4).batch
        own = {key: template[key] for key in ("tokens", "positions", "segment_ids", "advantages")}
        exact = {key: np.zeros_like(value) for key, value in exact_values(index).items()}
    received = first_reader_batch(own, share_size=pool.share_size)
    arrays.update({f"own/{key}": value for key, value in own.items()})
    arrays.update({f"received/{key}": value for key, value in received.items()})
    received = first_reader_batch(exact, share_size=2)
    arrays.update({f"exact_own/{key}": value for key, value in exact.items()})
    arrays.update({f"exact_received/{key}": value for key, value in received.items()})
    facts["first_reader"] = first
    alone = first_reader_batch({"x": np.full(3, index, np.int32)}, share_size=1)
    arrays["alone"] = alone["x"]
    for share_size in (3, 2):
        batch = own if share_size == 3 else dict(own, objects=np.array([None, index], object))
        try:
            first_reader_batch(batch, share_size=share_size)
        except ValueError as error:
            facts[f"refused{share_size}"] = str(error)
    try:
        DistributedPool(share_size=3)
    except ValueError as error:
        facts["bad_pool"] = str(error)


# The data-parallel steps: each process's rows of every step's global batch, and the step count.
DATA_PARALLEL_ROWS = 3
DATA_PARALLEL_STEPS = 3


def global_batch(step: int, processes: int) -> dict[str, np.ndarray]:
    """Step's global training batch, every process's rows in process order: packed rows with
    advantages, a loss mask, and behaviour and proximal log-probs near the model's."""
    rows = synthetic_rows(1000 + step, rows=DATA_PARALLEL_ROWS * processes, width=16)
    rng = np.random.default_rng(step)
    shape = rows["tokens"].shape
    follows = (rows["segment_ids"] > 0) & (rows["positions"] > 0)
    logprobs = np.where(follows, rng.uniform(-4.0, -2.0, shape), 0.0).astype(np.float32)
    rows["loss_mask"] = follows.astype(np.float32)
    rows["advantages"] = np.where(follows, rng.normal(0.0, 1.0, shape), 0.0).astype(np.float32)
    rows["behavior_logprobs"] = logprobs
    rows["proximal_logprobs"] = logprobs + np.float32(0.01) * follows
    return rows


# optax's Adam raises its float decay to its int32 step count, which strict promotion refuses.
@jax.numpy_dtype_promotion("standard")
def train_alone(steps: int, processes: int) -> tuple[Any, list[dict]]:
    """The single-process trainer's steps over the global batches: its jitted update."""
    objective, _, variables = tiny()
    optimizer = optax.adam(1e-2)
    update = objective.update_fn(optimizer)
    opt_state = optimizer.init(variables)
    metrics = []
    for step in range(steps):
        variables, opt_state, step_metrics = update(
            variables, opt_state, global_batch(step, processes)
        )
        metrics.append(jax.device_get(step_metrics))
    return variables, metrics


@jax.numpy_dtype_promotion("standard")  # Adam, as in train_alone
def case_data_parallel(arrays, facts):
    """Every process steps on its own rows of each global batch; the variables it ends with."""
    objective, _, variables = tiny()
    optimizer = optax.adam(1e-2)
    index, processes = jax.process_index(), jax.process_count()
    step_fn = DataParallelUpdate(objective.update_fn(optimizer))
    variables = step_fn.replicate(variables)
    opt_state = step_fn.replicate(optimizer.init(variables))
    own = slice(index * DATA_PARALLEL_ROWS, (index + 1) * DATA_PARALLEL_ROWS)
    for step in range(DATA_PARALLEL_STEPS):
        rows = {key: value[own] for key, value in global_batch(step, processes).items()}
        variables, opt_state, metrics = step_fn(variables, opt_state, rows)
        arrays.update({f"metrics{step}/{key}": value for key, value in metrics.items()})
    leaves = jax.tree_util.tree_flatten_with_path(local_copy(variables))[0]
    arrays.update({jax.tree_util.keystr(path): leaf for path, leaf in leaves})
    facts["replicated"] = all(leaf.is_fully_replicated for leaf in jax.tree.leaves(variables))
    facts["compilations"] = step_fn._update._cache_size()


def case_pooled(arrays, facts):
    """Each process's metrics line pooled, and its rows of a dataset's global batches."""
    index = jax.process_index()
    line = {
        "groups": 3 + index,
        "resubmitted/timeout": index,
        "lag": index,
        "waited": 0.5 * index,
        "version": 10 - index,
        "reward/mean": 0.25 + index,
        "latency/p90": None if index == 0 else 2.0,
        "loss": None,
    }
    facts["pooled"] = pool_fields({**line, f"only on {index}": 1.5 + index})
    dataset = ArrayDataset({"task_id": np.arange(12)}, batch_size=4)
    facts["rows"] = [batch["task_id"].tolist() for batch in ProcessRows(dataset).stream(1)]


def case_mesh(arrays, facts):
    """The share size of meshes over four processes of one device each."""
    devices = sorted(jax.devices(), key=lambda device: device.process_index)
    square = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("data", "model"))
    line = jax.sharding.Mesh(np.array(devices), ("data",))
    facts["data_model"] = DistributedPool.from_mesh(square, data_axes=("data",)).share_size
    facts["both_axes"] = DistributedPool.from_mesh(square, data_axes=("data", "model")).share_size
    facts["line"] = DistributedPool.from_mesh(line, data_axes=("data",)).share_size
    facts["replicated"] = DistributedPool.from_mesh(line, data_axes=()).share_size
    for name, axes in (("strided", ("model",)), ("unknown", ("rows",))):
        try:
            DistributedPool.from_mesh(square, data_axes=axes)
        except ValueError as error:
            facts[name] = str(error)


def run_scheduler(
    steps: int, source_for: Callable, arrays, facts, *, ahead: int, share_size: int = 1
) -> None:
    """A RolloutScheduler per process on its own task rows, driven by the sync facade."""
    objective, alone, variables = tiny()
    engine = SimulatedEngine(slots=8)
    scheduler = RolloutScheduler(
        objective,
        source_for(engine),
        engine,
        width=64,
        rows=3,
        groups=2,
        ahead=ahead,
        max_lag=ahead,
    )
    scheduler.pool = DistributedPool(share_size=share_size)
    scheduler.long_wait = None
    index, processes = jax.process_index(), jax.process_count()
    shard = np.arange(index, BATCHES * BATCH_SIZE * processes, processes)
    stream = scheduler.tasks(ArrayDataset({"task_id": shard}, batch_size=BATCH_SIZE)).stream(0)
    prefetched = [next(stream)]
    facts["tasks"] = []
    try:
        for updates in range(steps):
            prefetched.append(next(stream))
            # The weights move every step, so a rescoring under stale weights would show.
            scale = np.float32(1 + updates / 10)
            weights = jax.tree.map(lambda leaf, scale=scale: leaf * scale, variables)
            try:
                packed = scheduler(prefetched.pop(0), weights, updates)
            except Exception as error:
                facts["raised_at"] = [updates, type(error).__name__, str(error)]
                break
            rows = {k: v for k, v in packed.items() if k != "proximal_logprobs"}
            arrays[f"pool{updates}"] = packed["proximal_logprobs"]
            arrays[f"alone{updates}"] = LocalPool().rescore(alone, weights, rows)
            arrays[f"segments{updates}"] = packed["segment_ids"]
            arrays[f"tokens{updates}"] = packed["tokens"]
            arrays.update({f"packed{updates}/{key}": value for key, value in packed.items()})
            events = scheduler.last_events if scheduler.last_record is not None else ()
            admitted = {e.task for e in events if e.kind == "admitted"}
            facts["tasks"].append(sorted(admitted, key=int))
            facts["records"] = scheduler.last_record is not None
    finally:
        scheduler.close()
    facts["compilations"] = objective._jitted_log_probs._cache_size()


SMALL = dict(prompt_tokens=(2, 4), completion_tokens=(1, 4), calls=(1, 2), vocab=32)


def case_scheduler(arrays, facts):
    """Three steps of every process's scheduler, rescored over the pool."""

    def source_for(engine):
        return SimulatedSource(engine, SimulatedConfig(seed=0, duration_mean=0.005, **SMALL))

    run_scheduler(3, source_for, arrays, facts, ahead=1)


def case_share(arrays, facts):
    """Both processes read one share: the first samples, the second trains on its rows."""

    def source_for(engine):
        source = SimulatedSource(engine, SimulatedConfig(seed=0, duration_mean=0.005, **SMALL))
        counted = Counting(source)
        facts_source.append(counted)
        return counted

    facts_source: list = []
    run_scheduler(3, source_for, arrays, facts, ahead=1, share_size=2)
    facts["rollouts"] = facts_source[0].runs


class Counting:
    def __init__(self, inner):
        self.inner, self.runs = inner, 0

    async def run(self, task, label):
        self.runs += 1
        return await self.inner.run(task, label)


class BrokenOnTask:
    """A source that raises on one task and runs the others as `inner` does."""

    def __init__(self, inner, broken: str):
        self.inner, self.broken = inner, broken

    async def run(self, task, label):
        if task.name == self.broken:
            raise LookupError(f"the environment of task {task.name} is gone")
        return await self.inner.run(task, label)


def case_failure(arrays, facts):
    """The last process's source breaks on its third batch: every process stops at that step."""
    index, processes = jax.process_index(), jax.process_count()
    # The first task row of the last process's third batch.
    broken = str(index + 2 * BATCH_SIZE * processes) if index == processes - 1 else None

    def source_for(engine):
        inner = SimulatedSource(engine, SimulatedConfig(seed=1, duration_mean=0.005, **SMALL))
        return BrokenOnTask(inner, broken)

    # Batch i is submitted at call i alone, so the failure reaches that very call.
    run_scheduler(4, source_for, arrays, facts, ahead=0)


CASES = {
    "rescore": case_rescore,
    "agree": case_agree,
    "structure": case_structure,
    "first_reader": case_first_reader,
    "mesh": case_mesh,
    "pooled": case_pooled,
    "data_parallel": case_data_parallel,
    "scheduler": case_scheduler,
    "failure": case_failure,
    "share": case_share,
}

if __name__ == "__main__":
    sys.exit(main())
