"""The process pool a multi-process trainer runs on, over `jax.distributed`.

Every process runs its own scheduler on its own rows. The pool meets twice a call: processes
agree that every admission succeeded (a failure raises on every process at that point, rather
than leave the others waiting in the rescoring), and the proximal rescoring runs once over the
pool's global batch, each process reading its own rows back.

Every collective here is entered by every process, and whatever a process could refuse locally
(a bad argument, rows of another shape) is first agreed on across the pool, so a refusal raises on
every process instead of leaving the others blocked in a collective that one of them never joins.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["DistributedPool", "LocalPool", "Pool", "default_pool", "first_reader_batch"]


class Pool(Protocol):
    """Where the processes of one trainer meet, once per call for each method."""

    def agree(self, error: BaseException | None) -> None:
        """Raise on every process if any process's admission failed: the failed process
        raises its own error, the others an error naming the failed process."""
        ...

    def rescore(self, objective: Any, variables: Any, rows: Mapping[str, np.ndarray]) -> np.ndarray:
        """This process's proximal log-probs, float32[rows, width], computed once over the
        pool's batch."""
        ...

    def is_first_reader(self, share_size: int) -> bool:
        """Whether this process samples for its data share of `share_size` processes."""
        ...


class LocalPool:
    """The pool of a single-process trainer."""

    def agree(self, error: BaseException | None) -> None:
        """Raise `error`, this process's failure, if there is one: no other process to tell."""
        if error is not None:
            raise error

    def rescore(self, objective: Any, variables: Any, rows: Mapping[str, np.ndarray]) -> np.ndarray:
        """The proximal log-probs of this process's rows, float32[rows, width]."""
        return np.asarray(objective.packed_log_probs(variables, rows), np.float32)

    def is_first_reader(self, share_size: int) -> bool:
        """A lone process reads its share alone: True, for a share_size of 1."""
        _raise(_share_size_problem(share_size, 1))
        return True


class DistributedPool:
    """The pool of every `jax.distributed` process, each with its own scheduler and rows.

    Construct it after `jax.distributed.initialize`; every process must make each call, in the
    same order, with rows of one structure.
    """

    def agree(self, error: BaseException | None) -> None:
        """Raise on every process if any process's admission failed this call.

        Each process says whether its admission failed, and all hear every answer, so a failure
        stops the whole pool here rather than leave the others waiting for it in the rescoring.

        Args:
            error: what this process's admission raised, or None.

        Raises:
            BaseException: `error` itself, on the process it failed on.
            RuntimeError: on every other process, naming the processes that failed.
        """
        failed = multihost_utils.process_allgather(np.int32(error is not None))
        if error is not None:
            raise error
        culprits = np.flatnonzero(failed).tolist()
        if culprits:
            raise RuntimeError(
                f"admission failed on {_processes(culprits)} of {jax.process_count()}; "
                f"process {jax.process_index()} stops with it"
            )

    def rescore(self, objective: Any, variables: Any, rows: Mapping[str, np.ndarray]) -> np.ndarray:
        """This process's proximal log-probs, computed once over the pool's batch.

        The pool's batch is every process's rows in process order, sharded by rows over all
        devices, so the model runs once across the pool and each process reads its own rows back.
        Rows are padded, for the scoring only, to a multiple of the local device count.

        Args:
            objective: has `packed_log_probs(variables, batch) -> float[rows, width]`.
            variables: the trainer's weights: global arrays as the trainer holds them, or arrays
                equal on every process, which are replicated over the pool.
            rows: this process's packed `[rows, ...]` arrays; every process hands over the same
                keys, shapes and dtypes.

        Returns:
            float32[rows, width]: the log-probs of this process's rows, equal to what the
            objective gives for them alone.

        Raises:
            ValueError: on every process, where the rows' leading axes differ or the processes'
                rows differ in structure, naming the processes.
        """
        arrays = {key: np.asarray(value) for key, value in sorted(rows.items())}
        count = _agree_on_rows(arrays)
        mesh = _mesh()
        by_rows = NamedSharding(mesh, PartitionSpec("rows"))
        padding = -count % jax.local_device_count()
        batch = {
            key: jax.make_array_from_process_local_data(by_rows, _pad_rows(value, padding))
            for key, value in arrays.items()
        }
        replicated = NamedSharding(mesh, PartitionSpec())
        variables = jax.tree.map(lambda leaf: _replicate(leaf, replicated), variables)
        scores = objective.packed_log_probs(variables, batch)
        return _own_rows(scores, by_rows)[:count].astype(np.float32, copy=False)

    def is_first_reader(self, share_size: int) -> bool:
        """Whether this process samples for its share: the share's first process does.

        Args:
            share_size: consecutive processes that read one data share.

        Returns:
            True where process_index % share_size == 0.

        Raises:
            ValueError: unless share_size is an int >= 1 dividing the process count.
        """
        _raise(_share_size_problem(share_size, jax.process_count()))
        return jax.process_index() % share_size == 0


def first_reader_batch(
    batch: Mapping[str, np.ndarray], *, share_size: int
) -> dict[str, np.ndarray]:
    """The rows of each share's first reader, on every process of the share.

    Where consecutive processes read one data share (a tensor or sequence axis across processes),
    their devices must hold the same rows, which independent draws would not give them: the
    share's first process (index % share_size == 0) samples and packs, and the others train on
    its rows.

    Args:
        batch: on a share's first reader, its packed arrays; on the others, arrays of the same
            keys, shapes and dtypes (e.g. `pack` of no groups), whose values are ignored.
        share_size: consecutive processes that read one data share; 1 returns batch as it is.

    Returns:
        The first reader's arrays, as numpy, on every process of its share.

    Raises:
        ValueError: on every process, unless share_size is an int >= 1 dividing the process count
            on every process, and every process's batch has one structure.
    """
    arrays = {key: np.asarray(value) for key, value in sorted(batch.items())}
    processes = jax.process_count()
    problem = _share_size_problem(share_size, processes)
    if processes == 1:
        _raise(problem)
        return arrays
    description = f"share_size {share_size!r}, {_structure(arrays)}"
    _agree(description, problem, what="first_reader_batch")
    if share_size == 1:
        return arrays
    local = jax.local_device_count()
    by_process = NamedSharding(_mesh(), PartitionSpec("rows"))
    # Each local device holds a copy, so the share's rows reach the devices of every process.
    copies = {
        key: jax.make_array_from_process_local_data(
            by_process, np.broadcast_to(value, (local, *value.shape))
        )
        for key, value in arrays.items()
    }
    spread = _first_of_each_share(copies, shares=processes // share_size, sharding=by_process)
    return {key: _own_rows(value, by_process)[0] for key, value in spread.items()}


def default_pool() -> Pool:
    """The pool of the running trainer: every `jax.distributed` process, or this one alone.

    A trainer that is not distributed gets `LocalPool` without starting a JAX backend, so a
    scheduler built before `jax.distributed.initialize` does not block it (and is local).
    """
    if jax.distributed.is_initialized() and jax.process_count() > 1:
        return DistributedPool()
    return LocalPool()


def _mesh() -> Mesh:
    """A 1-D mesh over every device, process by process, so that a rows-sharded array holds
    process p's rows as its p-th block."""
    devices = sorted(jax.devices(), key=lambda device: (device.process_index, device.id))
    return Mesh(np.array(devices), ("rows",))


def _structure(arrays: Mapping[str, np.ndarray]) -> str:
    return ", ".join(f"{key} {value.dtype}{list(value.shape)}" for key, value in arrays.items())


def _agree_on_rows(arrays: Mapping[str, np.ndarray]) -> int:
    """Agree across the pool on rows: arrays of one structure everywhere, sharing a leading
    axis; return its length."""
    description = _structure(arrays)
    leading = {value.shape[0] if value.ndim else None for value in arrays.values()}
    problem = None
    if not arrays:
        problem = "rows must hold at least one array"
    elif len(leading) != 1 or None in leading:
        problem = f"rows must share one leading rows axis, got {description}"
    _agree(description, problem, what="rows")
    return leading.pop()


def _agree(description: str, problem: str | None, *, what: str) -> None:
    """Raise on every process if any process found a problem or described its part otherwise.

    Args:
        description: this process's part of the collective, which every process must share.
        problem: why this process cannot take part, or None.
        what: the collective, for the messages.

    Raises:
        ValueError: this process's own problem; or, on the others, naming the processes with
            one, or those whose description differs from process 0's.
    """
    fingerprint = np.uint32(zlib.crc32(description.encode())).view(np.int32)
    answers = multihost_utils.process_allgather(
        np.array([fingerprint, problem is not None], np.int32)
    )
    _raise(problem)
    failed = np.flatnonzero(answers[:, 1]).tolist()
    if failed:
        raise ValueError(f"{what} was refused on {_processes(failed)}")
    differing = np.flatnonzero(answers[:, 0] != answers[0, 0]).tolist()
    if differing:
        raise ValueError(
            f"every process must hand {what} of one structure, but process 0's differs from "
            f"that of {_processes(differing)} (process {jax.process_index()} has {description})"
        )


def _processes(indices: list[int]) -> str:
    if len(indices) == 1:
        return f"process {indices[0]}"
    return f"processes {', '.join(map(str, indices))}"


def _raise(problem: str | None) -> None:
    if problem is not None:
        raise ValueError(problem)


def _share_size_problem(share_size: object, processes: int) -> str | None:
    if (
        isinstance(share_size, bool)
        or not isinstance(share_size, int | np.integer)
        or share_size < 1
        or processes % share_size
    ):
        return (
            f"share_size must be an int >= 1 dividing the {processes} processes, got {share_size!r}"
        )
    return None


def _pad_rows(value: np.ndarray, padding: int) -> np.ndarray:
    """value with `padding` zero rows after its own; zero segment ids are padding to score."""
    if padding == 0:
        return value
    return np.concatenate([value, np.zeros((padding, *value.shape[1:]), value.dtype)])


def _replicate(leaf: Any, replicated: NamedSharding) -> Any:
    """leaf as the pool sees it: a global array stays as the trainer sharded it."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return leaf
    return jax.device_put(leaf, replicated)


def _own_rows(array: jax.Array, by_rows: NamedSharding) -> np.ndarray:
    """This process's block of a global array's rows, as numpy."""
    # A no-op where the computation already laid its result out by rows, as it usually does.
    array = jax.device_put(array, by_rows)
    shards = sorted(array.addressable_shards, key=lambda shard: shard.index[0].start)
    return np.concatenate([np.asarray(shard.data) for shard in shards])


@functools.partial(jax.jit, static_argnames=("shares", "sharding"))
def _first_of_each_share(arrays: dict, *, shares: int, sharding: NamedSharding) -> dict:
    """Each share's first row in place of every row of the share: `[shares * k, ...]` arrays,
    k consecutive rows to a share."""

    def first(value: jax.Array) -> jax.Array:
        split = value.reshape(shares, -1, *value.shape[1:])
        spread = jnp.broadcast_to(split[:, :1], split.shape).reshape(value.shape)
        return jax.lax.with_sharding_constraint(spread, sharding)

    return jax.tree.map(first, arrays)
