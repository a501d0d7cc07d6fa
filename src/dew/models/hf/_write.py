"""A checkpoint folder's tensors written: each params leaf gathered whole to the host one at a
time (from a pool's processes too), converted back to the checkpoint's layout and streamed into
a safetensors file, so the host never holds the params' bytes at once; and the folder swapped in
whole. `dew.models.hf.save` writes a folder with them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from dew.models.hf import _params
from dew.models.hf._modeling import HFModel

# safetensors' dtype name of each dtype dew keeps params in.
_DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16"}


def _gathered(value: Any) -> np.ndarray:
    """One params leaf whole on this host: its shards fetched from this process's devices, or,
    for an array sharded over a pool's processes, gathered from every process (a collective
    each process joins)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(jax.device_get(value))


def _tensors_of(model: HFModel, params: dict) -> Iterator[tuple[str, np.ndarray]]:
    """Each checkpoint tensor of `params`, converted back to the checkpoint's layout, one at a
    time (a sharded leaf gathered to the host only as it is written)."""
    for leaf in _params.leaves(model.config):
        value = _gathered(_params.get_leaf(params, leaf.path))
        yield leaf.name, np.ascontiguousarray(leaf.entry.layout.to_tensor(value))


def _check_params(model: HFModel, params: dict) -> None:
    want = jax.eval_shape(model.init, jax.random.key(0))
    if jax.tree.structure(params) != jax.tree.structure(want):
        raise ValueError("params must have the tree layout of the model's init")
    for (path, leaf), wanted in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want), strict=True
    ):
        if np.shape(leaf) != wanted.shape or jnp.result_type(leaf) != wanted.dtype:
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} must be {wanted.dtype}{list(wanted.shape)}, "
                f"got {jnp.result_type(leaf)}{list(np.shape(leaf))}"
            )


def _write_safetensors(
    path: Path, tensors: Iterator[tuple[str, np.ndarray]], model: HFModel
) -> None:
    """Write a safetensors file one tensor at a time: the header (every tensor's dtype, shape
    and byte range, computed from the table beforehand) then each tensor's bytes as it comes,
    so the host never holds all the params' bytes at once (the safetensors library's writers
    take every tensor in one dict)."""
    kind = _DTYPE_NAMES[model.dtype]
    itemsize = jnp.dtype(model.dtype).itemsize
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for leaf in _params.leaves(model.config):
        size = int(np.prod(leaf.tensor_shape)) * itemsize
        header[leaf.name] = {
            "dtype": kind,
            "shape": list(leaf.tensor_shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for name, tensor in tensors:
            entry = header[name]
            if list(tensor.shape) != entry["shape"]:
                raise AssertionError(f"{name} is {tensor.shape}, its header says {entry['shape']}")
            file.write(tensor.tobytes())


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _swap_in(staging: Path, folder: Path) -> None:
    """Rename the written folder to `folder`; an old `folder` is moved aside first and removed
    after, so `folder` is the old checkpoint or the new one, never a mix."""
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.old")
        os.replace(folder, old)
    os.replace(staging, folder)
    _fsync(folder.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
