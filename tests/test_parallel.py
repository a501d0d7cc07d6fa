"""dew.parallel over a real `jax.distributed` pool of processes on the loopback interface.

Each pool is launched once per module: every process runs tests/_parallel_worker.py, which plays
the cases in lockstep and writes what each process saw; the tests compare the processes' files.
The two-process pool gives each process two CPU devices, so rows are sharded (and padded) over
several local devices; the four-process pool has two shares of two for first_reader_batch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import dew.parallel
from _parallel_worker import (
    DATA_PARALLEL_STEPS,
    exact_values,
    global_batch,
    synthetic_rows,
    tiny,
    train_alone,
)
from dew.data import ArrayDataset
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

WORKER = pathlib.Path(__file__).with_name("_parallel_worker.py")
# Seconds a pool may take; its workers dump their stacks and exit a little earlier.
TIMEOUT = 150.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(out: pathlib.Path, *, processes: int, local_devices: int, cases: str) -> pathlib.Path:
    """Run one pool of worker processes to the end and return the folder of their results.

    A worker that fails ends the pool at once (the others would wait for it in a collective),
    and a pool past TIMEOUT is killed; either fails the test with every worker's log.
    """
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={local_devices}"
    )
    command = [sys.executable, str(WORKER), "--port", str(port), "--processes", str(processes)]
    command += ["--out", str(out), "--cases", cases, "--timeout", str(TIMEOUT - 10)]
    logs = [out / f"log-{i}.txt" for i in range(processes)]
    with contextlib.ExitStack() as stack:
        workers = [
            subprocess.Popen(
                command + ["--process", str(i)],
                stdout=stack.enter_context(log.open("w")),
                stderr=subprocess.STDOUT,
                env=env,
            )
            for i, log in enumerate(logs)
        ]
        deadline = time.monotonic() + TIMEOUT
        running = list(workers)
        while running and time.monotonic() < deadline:
            if any(worker.returncode for worker in workers if worker not in running):
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                running[0].wait(timeout=0.5)
            running = [worker for worker in running if worker.poll() is None]
        for worker in running:
            worker.kill()
            worker.wait()
    codes = [worker.returncode for worker in workers]
    if any(codes):
        text = "\n".join(f"--- process {i}\n{log.read_text()}" for i, log in enumerate(logs))
        pytest.fail(
            f"the pool of {processes} ended with exit codes {codes} (a worker still running "
            f"after another failed, or after {TIMEOUT}s, is killed):\n{text}"
        )
    return out


@pytest.fixture(scope="module")
def pool2(tmp_path_factory) -> pathlib.Path:
    cases = "rescore,agree,structure,first_reader,scheduler,failure,share,data_parallel,pooled"
    out = tmp_path_factory.mktemp("pool2")
    return launch(out, processes=2, local_devices=2, cases=cases)


@pytest.fixture(scope="module")
def pool4(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("pool4")
    return launch(out, processes=4, local_devices=1, cases="first_reader,agree,mesh")


def result(out: pathlib.Path, case: str, process: int) -> tuple[dict[str, np.ndarray], dict]:
    """What one process wrote for one case: its arrays and its facts."""
    with np.load(out / f"{case}-{process}.npz") as arrays:
        loaded = {key: arrays[key] for key in arrays.files}
    return loaded, json.loads((out / f"{case}-{process}.json").read_text())


# --- the proximal rescoring -----------------------------------------------------------------------


@pytest.mark.slow
def test_rescoring_over_the_pool_equals_each_process_scoring_its_rows_alone(pool2):
    seen = []
    for process in range(2):
        arrays, facts = result(pool2, "rescore", process)
        assert "raised" not in facts
        assert facts["local_devices"] == 2
        for call in range(2):
            scores = arrays[f"pool{call}"]
            assert scores.dtype == np.float32 and scores.shape == (3, 64)
            np.testing.assert_allclose(scores, arrays[f"alone{call}"], rtol=1e-5, atol=1e-5)
            assert np.all(scores[arrays[f"segments{call}"] == 0] == 0)
            assert np.any(scores < 0)
        seen.append(arrays["pool0"])
    # Each process got its own rows back, not another's.
    assert not np.allclose(seen[0], seen[1])


@pytest.mark.slow
def test_rows_of_another_structure_are_refused_on_every_process(pool2):
    for process in range(2):
        _, facts = result(pool2, "structure", process)
        kind, message = facts["raised"]
        assert kind == "ValueError"
        assert "one structure" in message and "differs from that of process 1" in message


# --- the agreement --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("pool, processes", [("pool2", 2), ("pool4", 4)])
def test_a_failed_admission_raises_on_every_process_at_the_agreement(request, pool, processes):
    out = request.getfixturevalue(pool)
    for process in range(processes):
        _, facts = result(out, "agree", process)
        assert facts["default_pool"] == "DistributedPool"
        kind, message = facts["first"]
        if process == 0:
            assert (kind, message) == ("KeyError", "'task 7 broke'")
        else:
            assert kind == "RuntimeError"
            assert f"failed on process 0 of {processes}" in message
            assert f"process {process} stops" in message
        # The pool goes on agreeing afterwards.
        assert facts["second"] == "agreed"


# --- first readers --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("pool, processes", [("pool2", 2), ("pool4", 4)])
def test_later_readers_receive_exactly_their_first_readers_rows(request, pool, processes):
    out = request.getfixturevalue(pool)
    for process in range(processes):
        arrays, facts = result(out, "first_reader", process)
        assert facts["first_reader"] == (process % 2 == 0)
        first, _ = result(out, "first_reader", process - process % 2)
        keys = [key.removeprefix("own/") for key in arrays if key.startswith("own/")]
        assert sorted(keys) == ["advantages", "positions", "segment_ids", "tokens"]
        for key in keys:
            received, sampled = arrays[f"received/{key}"], first[f"own/{key}"]
            assert received.dtype == sampled.dtype
            np.testing.assert_array_equal(received, sampled)
        # The shares differ: each got its own first reader's rows.
        other, _ = result(out, "first_reader", (process + 2) % processes)
        if processes == 4:
            assert not np.array_equal(arrays["received/advantages"], other["received/advantages"])
        np.testing.assert_array_equal(arrays["alone"], np.full(3, process, np.int32))
        assert "share_size" in facts["refused3"] and "got 3" in facts["refused3"]
        assert "share_size" in facts["bad_pool"] and "got 3" in facts["bad_pool"]
        # Every process refuses an array of Python objects, naming it.
        assert "objects holds Python objects" in facts["refused2"]


@pytest.mark.slow
@pytest.mark.parametrize("pool, processes", [("pool2", 2), ("pool4", 4)])
def test_first_reader_batch_carries_every_bit_of_every_dtype(request, pool, processes):
    """int64 past 2**31, float64, -0.0, subnormals and NaN payloads come back as the first
    reader sent them, on the later readers and on the first reader itself, though JAX runs
    without 64-bit types there."""
    out = request.getfixturevalue(pool)
    for process in range(processes):
        arrays, _ = result(out, "first_reader", process)
        first, _ = result(out, "first_reader", process - process % 2)
        sent = exact_values(process - process % 2)
        for key, value in sent.items():
            received = arrays[f"exact_received/{key}"]
            assert received.dtype == value.dtype and received.shape == value.shape, key
            assert received.tobytes() == value.tobytes(), (
                f"{key} came back as {received!r}, the first reader sent {value!r}"
            )
            assert received.tobytes() == first[f"exact_own/{key}"].tobytes()
    assert arrays["exact_received/int64"][0] == 2**40 + 3 + processes - 2


@pytest.mark.slow
def test_the_share_size_of_a_mesh_is_the_processes_that_hold_each_data_slice(pool4):
    for process in range(4):
        _, facts = result(pool4, "mesh", process)
        assert "raised" not in facts, facts
        assert facts["data_model"] == 2  # processes 0, 1 hold data slice 0; 2, 3 slice 1
        assert facts["both_axes"] == 1
        assert facts["line"] == 1
        assert facts["replicated"] == 4  # one slice, every process reads it
        assert "consecutive runs" in facts["strided"] and "[[0, 2], [1, 3]]" in facts["strided"]
        assert "data_axes" in facts["unknown"] and "'rows'" in facts["unknown"]


# --- a scheduler on every process -----------------------------------------------------------------


@pytest.mark.slow
def test_every_processs_scheduler_trains_on_rows_rescored_over_the_pool(pool2):
    for process in range(2):
        arrays, facts = result(pool2, "scheduler", process)
        assert "raised" not in facts and "raised_at" not in facts
        assert len(facts["tasks"]) == 3
        for step, tasks in enumerate(facts["tasks"]):
            # Each step trains on this process's own batch of its own task rows.
            assert [int(task) for task in tasks] == [process + 2 * (2 * step + i) for i in range(2)]
            scores = arrays[f"pool{step}"]
            assert scores.shape == (3, 64)
            np.testing.assert_allclose(scores, arrays[f"alone{step}"], rtol=1e-5, atol=1e-5)
            assert np.any(scores[arrays[f"segments{step}"] > 0] < 0)
        # Every rescoring of the run, and the rescoring case's before it, compiled once.
        assert facts["compilations"] == 1


@pytest.mark.slow
def test_a_shares_later_reader_samples_nothing_and_trains_on_the_first_readers_rows(pool2):
    first, first_facts = result(pool2, "share", 0)
    later, later_facts = result(pool2, "share", 1)
    assert "raised" not in first_facts and "raised" not in later_facts
    assert first_facts["rollouts"] > 0 and later_facts["rollouts"] == 0
    assert first_facts["records"] and not later_facts["records"]  # later readers log nothing
    for step in range(3):
        keys = [key for key in first if key.startswith(f"packed{step}/")]
        assert {key.rpartition("/")[2] for key in keys} >= {"tokens", "advantages", "loss_mask"}
        for key in keys:
            if key.endswith("/proximal_logprobs"):  # rescored on each process's own devices
                np.testing.assert_allclose(later[key], first[key], rtol=1e-6)
                continue
            assert later[key].dtype == first[key].dtype, key
            assert later[key].tobytes() == first[key].tobytes(), key  # byte for byte
        assert (first[f"segments{step}"] > 0).any()


@pytest.mark.slow
def test_a_broken_source_stops_every_process_at_the_same_step(pool2):
    _, healthy = result(pool2, "failure", 0)
    _, broken = result(pool2, "failure", 1)
    assert broken["raised_at"] == [2, "LookupError", "the environment of task 9 is gone"]
    step, kind, message = healthy["raised_at"]
    assert (step, kind) == (2, "RuntimeError")
    assert "admission failed on process 1 of 2" in message
    assert len(healthy["tasks"]) == len(broken["tasks"]) == 2


# --- data-parallel training ----------------------------------------------------------------------


@functools.cache
def trained_alone():
    """The single-process trainer's steps over the pool's global batches, computed once for the
    tests that compare with it (each computation compiles its update)."""
    return train_alone(DATA_PARALLEL_STEPS, processes=2)


@pytest.mark.slow
def test_two_processes_train_to_the_parameters_of_one_over_the_same_global_batches(pool2):
    """Each process steps on its own rows (padded from three to four over its two devices); JAX
    reduces the gradients across the pool; both end with the single process's parameters."""
    alone, alone_metrics = trained_alone()
    expected = {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(alone)[0]
    }
    initial = tiny()[2]
    for process in range(2):
        arrays, facts = result(pool2, "data_parallel", process)
        assert "raised" not in facts, facts
        assert facts["replicated"] and facts["compilations"] == 1
        for key, value in expected.items():
            np.testing.assert_allclose(arrays[key], value, rtol=2e-5, atol=2e-6, err_msg=key)
        for step, metrics in enumerate(alone_metrics):
            for name in ("loss", "tokens", "grad_norm"):
                np.testing.assert_allclose(
                    arrays[f"metrics{step}/{name}"], metrics[name], rtol=1e-5, err_msg=name
                )
    start = jax.tree_util.tree_flatten_with_path(initial)[0]
    moved = any(not np.allclose(expected[jax.tree_util.keystr(path)], leaf) for path, leaf in start)
    assert moved, "the steps left the parameters where they started"


# --- one metrics stream ---------------------------------------------------------------------------


@pytest.mark.slow
def test_the_pools_metrics_line_adds_counts_keeps_the_worst_and_averages_the_rest(pool2):
    for process in range(2):
        _, facts = result(pool2, "pooled", process)
        assert facts["pooled"] == {
            "groups": 7,
            "resubmitted/timeout": 1,
            "lag": 1,
            "waited": 0.5,
            "version": 9,
            "reward/mean": 0.75,
            "latency/p90": 2.0,  # the mean of the processes that have it
            "loss": None,
            "only on 0": 1.5,  # a field one process has is that process's
            "only on 1": 2.5,
        }
        # Batches 1 and 2 of four rows: this process's two.
        assert facts["rows"] == [
            [4 + 2 * process, 5 + 2 * process],
            [8 + 2 * process, 9 + 2 * process],
        ]


# --- one process ----------------------------------------------------------------------------------


def test_a_process_outside_jax_distributed_gets_the_local_pool():
    assert isinstance(default_pool(), LocalPool)


def test_a_lone_process_is_its_own_first_reader():
    batch = {"tokens": np.arange(6, dtype=np.int32).reshape(2, 3)}
    received = first_reader_batch(batch, share_size=1)
    np.testing.assert_array_equal(received["tokens"], batch["tokens"])
    exact = exact_values(0)
    for key, value in first_reader_batch(exact, share_size=1).items():
        assert value.dtype == exact[key].dtype and value.tobytes() == exact[key].tobytes()
    assert LocalPool().is_first_reader() and DistributedPool().is_first_reader()
    assert LocalPool().share_size == DistributedPool().share_size == 1
    for share_size in (0, 2, True, 1.0):
        with pytest.raises(ValueError, match=f"share_size .* got {share_size!r}"):
            first_reader_batch(batch, share_size=share_size)
        with pytest.raises(ValueError, match=f"share_size .* got {share_size!r}"):
            DistributedPool(share_size=share_size)
    with pytest.raises(ValueError, match="objects holds Python objects"):
        first_reader_batch(dict(batch, objects=np.array([None], object)), share_size=1)


def test_a_mesh_of_one_process_is_a_share_of_one():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    assert DistributedPool.from_mesh(mesh, data_axes=("data",)).share_size == 1
    for axes in (("rows",), "data"):
        with pytest.raises(ValueError, match="data_axes must be a tuple"):
            DistributedPool.from_mesh(mesh, data_axes=axes)


def test_the_distributed_pool_of_one_process_is_the_local_pool():
    objective, alone, variables = tiny()
    rows = synthetic_rows(7, rows=2, width=16)
    np.testing.assert_allclose(
        DistributedPool().rescore(objective, variables, rows),
        LocalPool().rescore(alone, variables, rows),
        rtol=1e-6,
        atol=1e-6,
    )
    DistributedPool().agree(None)
    with pytest.raises(KeyError, match="task 3"):
        DistributedPool().agree(KeyError("task 3"))
    ragged = dict(rows, tokens=rows["tokens"][:1])
    with pytest.raises(ValueError, match="one leading rows axis"):
        DistributedPool().rescore(objective, variables, ragged)


@pytest.mark.slow
@jax.numpy_dtype_promotion("standard")  # optax's Adam
def test_the_data_parallel_update_of_one_process_is_the_plain_update():
    """One process steps on the whole of each global batch (the pool's two shares of rows) and
    ends with the plain update's parameters."""
    alone, alone_metrics = trained_alone()
    objective, _, variables = tiny()
    optimizer = optax.adam(1e-2)
    step = DataParallelUpdate(objective.update_fn(optimizer))
    opt_state = optimizer.init(variables)
    for index in range(DATA_PARALLEL_STEPS):
        variables, opt_state, metrics = step(variables, opt_state, global_batch(index, 2))
        assert metrics["loss"] == pytest.approx(float(alone_metrics[index]["loss"]), rel=1e-6)
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7),
        local_copy(variables),
        jax.device_get(alone),
    )
    with pytest.raises(ValueError, match="one leading rows axis"):
        step(variables, opt_state, dict(global_batch(0, 1), tokens=np.zeros((1, 16), np.int32)))


def test_a_lone_process_reads_every_row_and_keeps_its_metrics_line():
    dataset = ArrayDataset({"task_id": np.arange(6)}, batch_size=3)
    assert [b["task_id"].tolist() for b in ProcessRows(dataset).stream(1)] == [[3, 4, 5]]
    line = {"groups": 3, "reward/mean": 0.5, "loss": None}
    assert pool_fields(line) == line
    with pytest.raises(ValueError, match=r"task_id has shape \(\)"):
        next(ProcessRows(Scalars()).stream())


class Scalars:
    """A dataset whose batch has no rows axis."""

    def stream(self, start: int = 0):
        yield {"task_id": np.int32(3)}


def test_the_public_surface():
    assert sorted(dew.parallel.__all__) == [
        "DataParallelUpdate",
        "DistributedPool",
        "LocalPool",
        "Pool",
        "ProcessRows",
        "default_pool",
        "first_reader_batch",
        "local_copy",
        "pool_fields",
    ]
    assert str(inspect.signature(first_reader_batch)) == (
        "(batch: 'Mapping[str, np.ndarray]', *, share_size: 'int') -> 'dict[str, np.ndarray]'"
    )
    for pool in (LocalPool, DistributedPool):
        for name in ("agree", "rescore", "is_first_reader"):
            assert inspect.signature(getattr(pool, name)) == inspect.signature(
                getattr(dew.parallel.Pool, name)
            )
