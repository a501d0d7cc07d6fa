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
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew import _pool_guard
from dew.data import Dataset

__all__ = [
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


class Pool(Protocol):
    """Where the processes of one trainer meet, once per call for each method.

    `share_size` is how many consecutive processes read one data share (a tensor or sequence
    axis across processes): only a share's first reader samples, the others train on its rows.
    """

    share_size: int

    def agree(self, error: BaseException | None) -> None:
        """Raise on every process if any process's admission failed: the failed process
        raises its own error, the others an error naming the failed process."""
        ...

    def rescore(self, objective: Any, variables: Any, rows: Mapping[str, np.ndarray]) -> np.ndarray:
        """This process's proximal log-probs, float32[rows, width], computed once over the
        pool's batch."""
        ...

    def is_first_reader(self) -> bool:
        """Whether this process samples for its data share of `share_size` processes."""
        ...


class LocalPool:
    """The pool of a single-process trainer: it reads its data alone, a share of one."""

    share_size = 1

    def agree(self, error: BaseException | None) -> None:
        """Raise `error`, this process's failure, if there is one: no other process to tell."""
        if error is not None:
            raise error

    def rescore(self, objective: Any, variables: Any, rows: Mapping[str, np.ndarray]) -> np.ndarray:
        """The proximal log-probs of this process's rows, float32[rows, width]."""
        return np.asarray(objective.packed_log_probs(variables, rows), np.float32)

    def is_first_reader(self) -> bool:
        """A lone process reads its share alone: True."""
        return True


class DistributedPool:
    """The pool of every `jax.distributed` process, each with its own scheduler and rows.

    Construct it after `jax.distributed.initialize`, with the same `share_size` on every
    process (or from the trainer's mesh with `from_mesh`); every process must make each call, in
    the same order, with rows of one structure.

    Args:
        share_size: consecutive processes that read one data share: the share's first process
            samples and the others train on its rows (`first_reader_batch`).

    Raises:
        ValueError: unless share_size is an int >= 1 dividing the process count.
    """

    def __init__(self, *, share_size: int = 1):
        _raise(_share_size_problem(share_size, jax.process_count()))
        self.share_size = int(share_size)
        self._agreements = 0

    @classmethod
    def from_mesh(cls, mesh: Mesh, *, data_axes: tuple[str, ...]) -> DistributedPool:
        """The pool of a trainer whose batch is split over `mesh`'s `data_axes`.

        Processes whose devices sit at the same coordinates of the data axes hold the same data
        slice (the other axes split the model, or the sequence), so they read one share.

        Args:
            mesh: the trainer's mesh over every process's devices.
            data_axes: the mesh axes the batch's rows are split over.

        Returns:
            The pool, its share_size the processes that read each data slice.

        Raises:
            ValueError: naming a data axis the mesh lacks, or where processes that share a data
                slice are not consecutive runs of one length, each holding that slice whole.
        """
        return cls(share_size=_mesh_share_size(mesh, data_axes))

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
        _pool_guard.arrived(self._agreements)
        self._agreements += 1
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

    def is_first_reader(self) -> bool:
        """Whether this process samples for its share: True where process_index % share_size
        == 0, the share's first process."""
        return jax.process_index() % self.share_size == 0


def first_reader_batch(
    batch: Mapping[str, np.ndarray], *, share_size: int
) -> dict[str, np.ndarray]:
    """The rows of each share's first reader, bit for bit, on every process of the share.

    Where consecutive processes read one data share (a tensor or sequence axis across processes),
    their devices must hold the same rows, which independent draws would not give them: the
    share's first process (index % share_size == 0) samples and packs, and the others train on
    its rows. The arrays travel as their bytes, so every dtype numpy holds without Python objects
    comes back exactly as the first reader had it (int64 and float64 unnarrowed, -0.0 and
    subnormals kept), whatever JAX's own dtype settings.

    Args:
        batch: on a share's first reader, its packed arrays; on the others, arrays of the same
            keys, shapes and dtypes (e.g. `pack` of no groups), whose values are ignored.
        share_size: consecutive processes that read one data share; 1 returns batch as it is.

    Returns:
        The first reader's arrays, as numpy, on every process of its share.

    Raises:
        ValueError: on every process, unless share_size is an int >= 1 dividing the process count
            on every process, every process's batch has one structure, and no array holds
            Python objects (whose bytes are pointers, meaningless in another process).
    """
    arrays = {key: np.asarray(value) for key, value in sorted(batch.items())}
    processes = jax.process_count()
    problem = _share_size_problem(share_size, processes) or _bytes_problem(arrays)
    if processes == 1:
        _raise(problem)
        return arrays
    description = f"share_size {share_size!r}, {_structure(arrays)}"
    _agree(description, problem, what="first_reader_batch")
    if share_size == 1 or not any(value.nbytes for value in arrays.values()):
        return arrays
    payload = np.concatenate([np.frombuffer(v.tobytes(), np.uint8) for v in arrays.values()])
    local = jax.local_device_count()
    by_process = NamedSharding(_mesh(), PartitionSpec("rows"))
    # Each local device holds a copy, so the share's bytes reach the devices of every process.
    copies = jax.make_array_from_process_local_data(
        by_process, np.broadcast_to(payload, (local, payload.size))
    )
    spread = _first_of_each_share(copies, shares=processes // share_size, sharding=by_process)
    received = _own_rows(spread, by_process)[0]
    ends = np.cumsum([value.nbytes for value in arrays.values()])
    return {
        key: received[end - value.nbytes : end].copy().view(value.dtype).reshape(value.shape)
        for (key, value), end in zip(arrays.items(), ends, strict=True)
    }


class DataParallelUpdate:
    """One optimizer step over the pool's global batch, each process handing over its own rows.

    The global batch is every process's rows in process order, sharded by rows over every device
    of the pool; the variables and the optimizer state are replicated on every device. The step
    is one jitted function over them, so JAX reduces the gradients across the pool and every
    process ends the step with the same variables and state: the step a single process would
    take over the whole global batch, to float rounding.

    Every process must make each call, in the same order, with rows of one structure.

    Args:
        update: `update(variables, opt_state, batch) -> (variables, opt_state, metrics)`, pure
            and jittable, e.g. `GRPOObjective.update_fn(optimizer)`; rows whose arrays are all
            zero (padding) must not change it, as for a loss masked by `loss_mask`.
    """

    def __init__(self, update: Callable):
        mesh = _mesh()
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.by_rows = NamedSharding(mesh, PartitionSpec("rows"))
        self._update = jax.jit(
            update,
            in_shardings=(self.replicated, self.replicated, self.by_rows),
            out_shardings=self.replicated,
        )

    def replicate(self, tree: Any) -> Any:
        """tree's leaves as arrays replicated over the pool.

        Args:
            tree: leaves equal on every process (numpy, local jax arrays), or already global.
        """
        return jax.tree.map(lambda leaf: _replicate(leaf, self.replicated), tree)

    def __call__(
        self, variables: Any, opt_state: Any, rows: Mapping[str, np.ndarray]
    ) -> tuple[Any, Any, dict[str, np.ndarray]]:
        """Take one step over the pool's global batch.

        Rows are padded with zero rows to a multiple of this process's device count, so that
        they split evenly over its devices.

        Args:
            variables, opt_state: replicated over the pool (`replicate`), as this returns them.
            rows: this process's `[rows, ...]` arrays; every process hands over the same keys,
                shapes and dtypes.

        Returns:
            The variables and optimizer state after the step, replicated over the pool, and the
            step's metrics as numpy, equal on every process.

        Raises:
            ValueError: on every process, where the rows' leading axes differ or the processes'
                rows differ in structure, naming the processes.
        """
        arrays = {key: np.asarray(value) for key, value in sorted(rows.items())}
        count = _agree_on_rows(arrays)
        padding = -count % jax.local_device_count()
        batch = {
            key: jax.make_array_from_process_local_data(self.by_rows, _pad_rows(value, padding))
            for key, value in arrays.items()
        }
        variables, opt_state, metrics = self._update(
            self.replicate(variables), self.replicate(opt_state), batch
        )
        return variables, opt_state, jax.tree.map(_local, metrics)


def local_copy(tree: Any) -> Any:
    """tree's leaves as numpy on this process: a replicated global array's own copy, which
    single-process code (an engine, a checkpoint writer) can read."""
    return jax.tree.map(_local, tree)


@attrs.frozen
class ProcessRows:
    """This process's rows of each of a dataset's batches, which are the pool's global batches.

    Process p of N reads the p-th of N equal blocks of every batch's rows, so the pool's global
    batch is every process's rows in process order, as `DataParallelUpdate` lays it out; a
    single process reads every row. The stream reopens at any batch index, as its dataset's.

    Args:
        dataset: the global batches: `[rows, ...]` arrays whose rows the processes split.
    """

    dataset: Dataset

    def stream(self, start: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """This process's block of each batch from batch index `start` on.

        Raises:
            ValueError: naming the key whose rows do not split evenly over the processes.
        """
        index, count = jax.process_index(), jax.process_count()
        for batch in self.dataset.stream(start):
            own = {}
            for key, value in batch.items():
                value = np.asarray(value)
                if value.ndim == 0 or len(value) % count:
                    raise ValueError(
                        f"every batch's rows must split evenly over the {count} processes; "
                        f"{key} has shape {value.shape}"
                    )
                block = len(value) // count
                own[key] = value[index * block : (index + 1) * block]
            yield own


# How each field of a step's metrics line combines over the pool's processes: counts add up, the
# worst lag and wait and the oldest version stand for the pool, and the rest are means.
_SUMMED = ("groups", "cancelled", "abandoned", "cut", "resubmitted/")
_WORST = {"lag": np.max, "waited": np.max, "version": np.min}


def pool_fields(fields: Mapping[str, float | int | None]) -> dict[str, float | int | None]:
    """One metrics line for the pool from every process's own: the step's numbers pooled.

    Counts (`groups`, `cancelled`, `abandoned`, `cut`, `resubmitted/...`) are summed, `lag` and
    `waited` are the pool's largest, `version` its smallest, and every other field is the mean
    over the processes that have it (None where none has: a field some processes lack, such as
    a reward component none of their rollouts had, is theirs alone). A single process's line
    comes back as it is. Every process must call it.

    Args:
        fields: this process's flat metrics: numbers, or None for a number it lacks.

    Returns:
        The pooled line, equal on every process, over every field any process has; counts and
        int fields stay ints.
    """
    if jax.process_count() == 1:
        return dict(fields)
    names = _every_name(fields)
    mine = np.array([_number(fields.get(name)) for name in names], np.float32)
    every = multihost_utils.process_allgather(mine)
    kinds = multihost_utils.process_allgather(
        np.array([isinstance(fields.get(name), int) for name in names], np.int32)
    )
    pooled: dict[str, float | int | None] = {}
    for column, name in enumerate(names):
        values = every[:, column]
        known = values[np.isfinite(values)]
        whole = bool(kinds[:, column].any())
        if name.startswith(_SUMMED):
            pooled[name] = int(known.sum()) if whole else float(known.sum())
        elif not known.size:
            pooled[name] = None
        elif name in _WORST:
            worst = _WORST[name](known)
            pooled[name] = int(worst) if whole else float(worst)
        else:
            pooled[name] = float(known.mean())
    return pooled


def _number(value: float | int | None) -> float:
    return np.nan if value is None else float(value)


def _every_name(fields: Mapping[str, Any]) -> list[str]:
    """Every field name any process of the pool has, sorted: each process's names travel as
    their bytes, padded to the longest process's."""
    mine = np.frombuffer("\n".join(sorted(fields)).encode(), np.uint8)
    lengths = multihost_utils.process_allgather(np.int32(mine.size))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: mine.size] = mine
    every = multihost_utils.process_allgather(padded)
    names = set()
    for length, row in zip(lengths.tolist(), every, strict=True):
        names.update(name for name in row[:length].tobytes().decode().split("\n") if name)
    return sorted(names)


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


def _bytes_problem(arrays: Mapping[str, np.ndarray]) -> str | None:
    """Why some array cannot travel as its bytes, or None."""
    objects = [key for key, value in arrays.items() if value.dtype.hasobject]
    if objects:
        return (
            f"first_reader_batch carries arrays as their bytes, and {', '.join(objects)} holds "
            f"Python objects; hand over numeric, bool or fixed-width string arrays"
        )
    return None


def _mesh_share_size(mesh: Mesh, data_axes: tuple[str, ...]) -> int:
    """How many consecutive processes hold each data slice of mesh, split over data_axes."""
    missing = [axis for axis in data_axes if axis not in mesh.axis_names]
    if isinstance(data_axes, str) or missing:
        raise ValueError(
            f"data_axes must be a tuple of the mesh's axis names {mesh.axis_names}, "
            f"got {data_axes!r}"
        )
    kept = [mesh.axis_names.index(axis) for axis in data_axes]
    slices: dict[int, set] = {}
    for where, device in np.ndenumerate(mesh.devices):
        slices.setdefault(device.process_index, set()).add(tuple(where[i] for i in kept))
    readers: dict[frozenset, list[int]] = {}
    for process in sorted(slices):
        readers.setdefault(frozenset(slices[process]), []).append(process)
    groups = list(readers.values())
    size = len(groups[0])
    consecutive = all(
        group == list(range(group[0], group[0] + size)) and group[0] % size == 0 for group in groups
    )
    overlapping = sum(len(key) for key in readers) != len(set().union(*readers))
    if not consecutive or overlapping:
        raise ValueError(
            f"the processes reading each data slice of the mesh over {data_axes} must be "
            f"consecutive runs of one length, each holding its slices alone; they are {groups}"
        )
    return size


def _local(leaf: Any) -> np.ndarray:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if not leaf.is_fully_replicated:
            raise ValueError(f"a {leaf.sharding} array is not whole on any one process")
        return np.asarray(leaf.addressable_data(0))
    return np.asarray(leaf)


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
def _first_of_each_share(value: jax.Array, *, shares: int, sharding: NamedSharding) -> jax.Array:
    """Each share's first row in place of every row of the share: a `[shares * k, ...]` array,
    k consecutive rows to a share."""
    split = value.reshape(shares, -1, *value.shape[1:])
    spread = jnp.broadcast_to(split[:, :1], split.shape).reshape(value.shape)
    return jax.lax.with_sharding_constraint(spread, sharding)
