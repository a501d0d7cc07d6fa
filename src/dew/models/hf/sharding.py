"""Sharding a checkpoint's params, optimizer state and training batch over a device mesh.

The mesh has three axes: `data` and `fsdp` split the batch's rows; `fsdp` also splits every
large param (and the optimizer state that mirrors it) along its residual-width axis, and
`tensor` along its heads or MLP columns. Which leaf axis goes to which mesh axis is declared
once, beside the checkpoint's names, in `_params.TABLE` and `_params.LAYER` (each row's `spec`);
this module only turns those into `NamedSharding`s for a given mesh, replicating an axis whose
size the mesh axis does not divide (two key/value heads over four tensor devices stay whole).
The forward pass is written for one device: `jax.jit` partitions it from its inputs' shardings.
The engine's key/value cache is laid out to match (`cache_shardings`: each device keeps the
heads it projects).

Sharded state is saved with orbax-checkpoint, each process writing the shards it holds, and
restored onto the same mesh or another (`dew.train`'s checkpoints of a sharded run are such).

In a pool of processes the mesh spans every process's devices, process by process
(`make_mesh`); a pool's batch is each process's rows (`shard_batch`), and each process's engine
serves the params its own devices hold (`local_view`, `LocalWeights`), which are whole where
only the data axis spans the processes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.models.hf import _params
from dew.models.hf._config import HFConfig


class Configured(Protocol):
    """What this module reads of a model: its checkpoint's config (an `HFModel` is one).

    Named by what it needs rather than as `HFModel`: the model's module lays its cache out with
    `cache_shardings`, so it imports this one, and naming it here made the two a circle.
    """

    config: HFConfig


DATA = "data"
"""The mesh axis that splits only the batch's rows."""
FSDP = _params.FSDP
TENSOR = _params.TENSOR
AXES = (DATA, FSDP, TENSOR)
"""The mesh's axes, in order."""


def make_mesh(
    *,
    data: int = 1,
    fsdp: int | None = None,
    tensor: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh of `devices` (all of them by default, process by process, so that each
    process's devices are one block of the leading axes) with axes `AXES`.

    Args:
        data, tensor: the data and tensor axes' sizes.
        fsdp: the fsdp axis's size; None takes the devices the other axes leave.

    Raises:
        ValueError: when the sizes' product is not the number of devices.
    """
    if devices is None:
        devices = sorted(jax.devices(), key=lambda device: (device.process_index, device.id))
    devices = list(devices)
    for name, size in (("data", data), ("tensor", tensor), ("fsdp", fsdp)):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"{name} must be an int >= 1, got {size!r}")
    if fsdp is None:
        fsdp = len(devices) // (data * tensor)
    if data * fsdp * tensor != len(devices):
        raise ValueError(
            f"a mesh of data {data} x fsdp {fsdp} x tensor {tensor} needs "
            f"{data * fsdp * tensor} devices, there are {len(devices)}"
        )
    return Mesh(np.array(devices).reshape(data, fsdp, tensor), AXES)


def param_specs(model: Configured, mesh: Mesh) -> dict[str, Any]:
    """Each param's `PartitionSpec` on `mesh`: its table row's spec, with each mesh axis that
    does not divide the leaf's axis dropped (that axis replicated), written as `jax.jit` writes
    the params a step hands back (`_written_as_jit`)."""
    tree = _params.empty_tree(model.config)
    for leaf in _params.leaves(model.config):
        spec = [
            axis if axis is not None and size % mesh.shape[axis] == 0 else None
            for axis, size in zip(leaf.entry.spec, leaf.shape, strict=True)
        ]
        _params.set_leaf(tree, leaf.path, _written_as_jit(spec, mesh))
    return tree


def _written_as_jit(axes: Sequence[str | None], mesh: Mesh) -> PartitionSpec:
    """A `PartitionSpec` of `axes` written as `jax.jit` writes the shardings it hands back: a
    mesh axis of size 1 left out (it splits nothing), and no whole axes at the end.

    Jitted steps are compiled once per input sharding as written, not per layout: params or a
    cache declared as `P("fsdp", "tensor", None)` on a mesh whose tensor axis has one device
    come back from a step as `P("fsdp")`, and every step would compile a second time for them.
    """
    parts = [axis if axis is not None and mesh.shape[axis] > 1 else None for axis in axes]
    while parts and parts[-1] is None:
        parts.pop()
    return PartitionSpec(*parts)


def param_shardings(model: Configured, mesh: Mesh) -> dict[str, Any]:
    """Each param's `NamedSharding` on `mesh` (see `param_specs`): what `dew.models.hf.load`
    takes as `shardings` to place each tensor as it is read."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_specs(model, mesh),
        is_leaf=lambda node: isinstance(node, PartitionSpec),
    )


def cache_shardings(model: Configured, mesh: Mesh, cache: Any) -> Any:
    """Each leaf's `NamedSharding` on `mesh` for `model`'s key/value cache (per layer and block
    of positions, [slots, kv_heads, block, head_dim]), whose params are sharded over it as
    `param_shardings` places them: the key/value heads split as the key projection's heads
    are, slots, positions and head width whole.

    Each device then keeps the keys and values of the heads it projects, and a prefill or
    decode step hands the cache back in this layout: a cache that starts in any other would
    make the engine's steps compile a second time, for the layout their first call returned.
    """
    key = param_specs(model, mesh)["layers"][0]["k"]
    spec = _written_as_jit([None, key[1] if len(key) > 1 else None], mesh)
    return jax.tree.map(lambda leaf: NamedSharding(mesh, spec), cache)


def shard(tree: Any, shardings: Any) -> Any:
    """`tree`'s arrays placed on `shardings` (a tree of the same layout)."""
    return jax.device_put(tree, shardings)


def state_shardings(state: Any, params: Any, mesh: Mesh) -> Any:
    """Shardings for an optimizer state of the sharded `params`: each leaf that mirrors a param
    (Adam's moments: a subtree laid out as the params, so its path ends with the param's path,
    and of its shape) as that param; every other leaf (step counts) replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    by_path = {
        tuple(path): (np.shape(leaf), leaf.sharding)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }

    def placed(path, leaf):
        for start in range(len(path)):
            shape, sharding = by_path.get(tuple(path[start:]), (None, None))
            if shape == np.shape(leaf):
                return sharding
        return replicated

    return jax.tree_util.tree_map_with_path(placed, state)


def batch_sharding(mesh: Mesh, rows: int, ndim: int) -> NamedSharding:
    """A batch array's sharding: its leading rows axis over the data and fsdp axes when they
    divide it, else replicated."""
    split = mesh.shape[DATA] * mesh.shape[FSDP]
    if rows % split:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, PartitionSpec((DATA, FSDP), *([None] * (ndim - 1))))


def shard_batch(batch: Mapping[str, Any], mesh: Mesh) -> dict[str, Any]:
    """A packed batch with its numeric arrays' rows split over the mesh's data axes (other
    entries, such as object arrays, kept as they are).

    On a mesh that spans a pool's processes, `batch` is this process's rows, and each array
    becomes the pool's batch: every process's rows in process order (`_process_rows`)."""
    placed = {}
    spans = spans_processes(mesh)
    for key, value in batch.items():
        array = np.asarray(value) if not isinstance(value, jax.Array) else value
        if array.ndim and array.dtype != object and spans:
            placed[key] = _process_rows(np.asarray(array), mesh)
        elif array.ndim and array.dtype != object:
            placed[key] = jax.device_put(array, batch_sharding(mesh, array.shape[0], array.ndim))
        else:
            placed[key] = value
    return placed


def spans_processes(mesh: Mesh) -> bool:
    """Whether `mesh` holds devices of other processes than this one."""
    return any(device.process_index != jax.process_index() for device in mesh.devices.flat)


def _process_rows(array: np.ndarray, mesh: Mesh) -> jax.Array:
    """This process's rows as its block of the pool's batch, the rows split over the data axes.

    They are padded with zero rows (padding, which the loss skips) to a multiple of the data
    slices this process's devices hold; every process must hand over as many rows (a
    scheduler's batches are all `rows` long)."""
    local = mesh.local_mesh
    padding = -array.shape[0] % (local.shape[DATA] * local.shape[FSDP])
    if padding:
        array = np.concatenate([array, np.zeros((padding, *array.shape[1:]), array.dtype)])
    sharding = NamedSharding(mesh, PartitionSpec((DATA, FSDP), *([None] * (array.ndim - 1))))
    return jax.make_array_from_process_local_data(sharding, array)


def local_view(tree: Any) -> Any:
    """`tree`'s arrays sharded over a mesh that spans a pool's processes, each as an array over
    this process's devices alone, made of the shards they hold (nothing copied): what this
    process's engine serves. Other leaves are kept as they are.

    Raises:
        ValueError: naming the sharding, where this process's devices do not hold a leaf whole
            (a mesh axis other than the data axis spans the processes).
    """

    def view(leaf):
        if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
            return leaf
        local = NamedSharding(leaf.sharding.mesh.local_mesh, leaf.sharding.spec)
        if local.shard_shape(leaf.shape) != leaf.sharding.shard_shape(leaf.shape):
            raise ValueError(
                f"a {leaf.sharding} array is not whole on this process's devices: only the "
                f"data axis may span processes"
            )
        shards = {shard.device: shard.data for shard in leaf.addressable_shards}
        devices = local.addressable_devices_indices_map(leaf.shape)
        return jax.make_array_from_single_device_arrays(
            leaf.shape, local, [shards[device] for device in devices]
        )

    return jax.tree.map(view, tree)


class LocalWeights:
    """A Publisher (the scheduler's engine) that is handed weights sharded over a mesh that spans
    a pool's processes and serves this process's view of them (`local_view`): each process's
    engine samples on its own, from the whole params its devices hold.

    Args:
        engine: the publisher (a `RolloutServer`, a vLLM engine) the views are loaded into.
    """

    def __init__(self, engine: Any):
        self.engine = engine

    def load(self, variables: Any, version: int) -> None:
        """Serve this process's view of `variables` under `version`."""
        self.engine.load(local_view(variables), version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


class ShardedRollout:
    """A Rollout (what the Trainer packs its batches with) whose packed rows are split over the
    mesh's data axes before the update, so the step is computed data-parallel; everything else
    (the scheduler's records and events) is the wrapped rollout's.

    Args:
        rollout: the rollout (a `RolloutScheduler`).
        mesh: the mesh the params are sharded over.
    """

    def __init__(self, rollout: Any, mesh: Mesh):
        self.rollout = rollout
        self.mesh = mesh

    def __call__(self, batch, variables, updates: int):
        return shard_batch(self.rollout(batch, variables, updates), self.mesh)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rollout, name)


def save_sharded(directory: str | os.PathLike, tree: Any) -> None:
    """Write a tree of sharded arrays with orbax-checkpoint: each process writes the shards it
    holds, so the whole never passes through one host. Every process calls it alike."""
    import orbax.checkpoint as ocp  # the sharded extra, needed only here

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(Path(directory).absolute(), tree, force=True)


def restore_sharded(directory: str | os.PathLike, like: Any) -> Any:
    """The tree `save_sharded` wrote, each array placed on `like`'s leaf's sharding (any mesh,
    not necessarily the one it was saved from).

    Args:
        like: a tree of the saved layout whose leaves have `shape`, `dtype` and `sharding`
            (arrays, or `jax.ShapeDtypeStruct`s).
    """
    import orbax.checkpoint as ocp

    target = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding), like
    )
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(Path(directory).absolute(), target)
