"""Checkpoints: a run's variables, optimizer state and position, written so a crash loses none."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import attrs
import jax
import jax.numpy as jnp
import numpy as np

Variables = Any
"""A model's variables: any pytree of arrays."""

CHECKPOINT_FORMAT = "dew-checkpoint"
"""The `format` a checkpoint's commit record names."""
CHECKPOINT_VERSION = 1
"""The checkpoint format's version."""
COMMIT = "checkpoint.json"
"""The commit record's file name in a checkpoint directory."""


@attrs.frozen(eq=False)
class Checkpoint:
    """Everything a run needs to continue where it stopped.

    Args:
        variables: the model's variables.
        opt_state: the optimizer's state for them.
        updates: optimizer updates applied.
        position: the stream index of the next batch to hand over.
        metadata: JSON values kept beside them (the trainer keeps its metrics log's length and
            its training seconds there).
    """

    variables: Variables
    opt_state: Any
    updates: int
    position: int
    metadata: Mapping[str, Any] = attrs.field(factory=dict)


def _leaves(tree_name: str, tree: Any) -> list[tuple[str, Any]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(f"{tree_name}{jax.tree_util.keystr(path)}", leaf) for path, leaf in leaves]


def _storable(array: np.ndarray) -> np.ndarray:
    # numpy's own formats hold only its built-in dtypes; others (bfloat16) go as their bits.
    return array if array.dtype.isbuiltin else array.view(f"u{array.dtype.itemsize}")


def _fsync_directory(directory: Path) -> None:
    # A rename is durable once its directory is: without this a power cut can undo it.
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` whole or not at all: to a temporary file beside it, fsynced, then renamed."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def save_checkpoint(directory: str | os.PathLike, checkpoint: Checkpoint) -> Path:
    """Write `checkpoint` into `directory` atomically, replacing the one there.

    The arrays go to a freshly named `.npz`, then `checkpoint.json` (the commit record) is renamed
    over the old one, then the arrays of earlier checkpoints and leftovers of interrupted writes
    are removed. A crash before the commit record's rename leaves the earlier checkpoint whole.

    Args:
        directory: the checkpoint directory, created if missing.
        checkpoint: what to save; its metadata must be JSON.

    Returns:
        The path of the commit record.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    leaves = _leaves("variables", checkpoint.variables) + _leaves("opt_state", checkpoint.opt_state)
    arrays = {path: np.asarray(leaf) for path, leaf in leaves}
    name = f"state-{checkpoint.updates:08d}-{secrets.token_hex(4)}.npz"
    stored = {f"leaf{i}": _storable(array) for i, array in enumerate(arrays.values())}
    _write_atomically(directory / name, lambda file: np.savez(file, **stored))
    record = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "arrays": name,
        "updates": int(checkpoint.updates),
        "position": int(checkpoint.position),
        "metadata": dict(checkpoint.metadata),
        "leaves": [
            {"path": path, "shape": list(array.shape), "dtype": array.dtype.name}
            for path, array in arrays.items()
        ],
    }
    text = json.dumps(record, indent=1, allow_nan=False).encode()
    _write_atomically(directory / COMMIT, lambda file: file.write(text))
    for stale in directory.iterdir():
        if stale.name != name and (stale.suffix == ".npz" or stale.name.endswith(".tmp")):
            stale.unlink(missing_ok=True)
    return directory / COMMIT


def read_commit(directory: str | os.PathLike) -> dict | None:
    """A checkpoint's commit record, with its array archive read through once, so a damaged
    checkpoint is refused before a resumed run starts anything.

    Returns:
        The commit record; None when the directory holds no checkpoint.

    Raises:
        ValueError: naming the file that is truncated, damaged or not a checkpoint's.
    """
    commit = Path(directory) / COMMIT
    if not commit.exists():
        return None
    try:
        record = json.loads(commit.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{commit} is damaged (not a JSON commit record: {error})") from None
    if (
        not isinstance(record, dict)
        or record.get("format") != CHECKPOINT_FORMAT
        or record.get("version") != CHECKPOINT_VERSION
        or not isinstance(record.get("arrays"), str)
        or not isinstance(record.get("leaves"), list)
    ):
        raise ValueError(
            f"{commit} is not a {CHECKPOINT_FORMAT} version {CHECKPOINT_VERSION} commit record"
        )
    arrays = commit.parent / record["arrays"]
    try:
        # Opened here, so a damaged archive's file is closed too (np.load leaks it).
        with open(arrays, "rb") as file, np.load(file, allow_pickle=False) as stored:
            for name in stored.files:
                stored[name]  # reads and checks each array whole
    except Exception as error:  # a zip, npy or file error: the archive is damaged or missing
        problem = f"{type(error).__name__}: {error}"
        raise ValueError(f"{arrays} is damaged or missing ({problem})") from None
    return record


def load_checkpoint(
    directory: str | os.PathLike, variables: Variables, opt_state: Any
) -> Checkpoint | None:
    """Read the checkpoint in `directory` into trees laid out like `variables` and `opt_state`.

    Args:
        directory: where `save_checkpoint` wrote.
        variables, opt_state: templates: the checkpoint's leaves must have their paths, shapes
            and dtypes (their values are not used).

    Returns:
        The checkpoint, its leaves as jax arrays; None when the directory holds none.

    Raises:
        ValueError: naming the file, or the leaf whose path, shape or dtype differs from the
            templates'.
    """
    commit = Path(directory) / COMMIT
    record = read_commit(directory)
    if record is None:
        return None
    trees = {"variables": variables, "opt_state": opt_state}
    expected = [leaf for name, tree in trees.items() for leaf in _leaves(name, tree)]
    saved = record["leaves"]
    if len(saved) != len(expected):
        raise ValueError(
            f"{commit} holds {len(saved)} leaves, the templates have {len(expected)}: "
            f"a checkpoint of another model or optimizer"
        )
    restored = []
    with np.load(commit.parent / record["arrays"], allow_pickle=False) as stored:
        for index, (entry, (path, leaf)) in enumerate(zip(saved, expected, strict=True)):
            want = jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf))
            if entry["path"] != path:
                raise ValueError(f"{commit} leaf {index} is {entry['path']}, the templates' {path}")
            if tuple(entry["shape"]) != want.shape or entry["dtype"] != want.dtype.name:
                raise ValueError(
                    f"{commit} leaf {path} is {entry['dtype']}{entry['shape']}, "
                    f"the templates' {want.dtype.name}{list(want.shape)}"
                )
            array = stored[f"leaf{index}"]
            restored.append(
                jnp.asarray(array.view(want.dtype) if array.dtype != want.dtype else array)
            )
    values = iter(restored)
    rebuilt = {
        name: jax.tree.unflatten(
            jax.tree.structure(tree), [next(values) for _ in jax.tree.leaves(tree)]
        )
        for name, tree in trees.items()
    }
    return Checkpoint(
        rebuilt["variables"],
        rebuilt["opt_state"],
        updates=int(record["updates"]),
        position=int(record["position"]),
        metadata=record["metadata"],
    )
