"""Checkpoints: a run's variables, optimizer state and position, written so a crash loses none.

Arrays on one device each (dew's transformer, a pool's replicated copies) are written by one
process as an `.npz`. Arrays sharded over a mesh of devices are written with orbax-checkpoint
into a folder of their own, every process writing the shards it holds: no host ever holds the
whole params. Either way the commit record, `checkpoint.json`, is written last and names the
arrays, so a checkpoint is the one the record names or none.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from dew._checks import check_int

Variables = Any
"""A model's variables: any pytree of arrays."""

CHECKPOINT_FORMAT = "dew-checkpoint"
"""The `format` a checkpoint's commit record names."""
CHECKPOINT_VERSION = 1
"""The checkpoint format's version."""
COMMIT = "checkpoint.json"
"""The commit record's file name in a checkpoint directory."""
ORBAX = "orbax"
"""A commit record's `storage` when its arrays are an orbax-checkpoint folder (an npz's record
names no storage)."""
STATE = "state-"
"""The prefix of every checkpoint's arrays (an `.npz`, or an orbax folder), which a commit
removes but for the one it names."""


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


def _fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk: a rename is durable once its directory
    is, and without this a power cut can undo it."""
    descriptor = os.open(path, os.O_RDONLY)
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
    _fsync(path.parent)


def save_checkpoint(directory: str | os.PathLike, checkpoint: Checkpoint, *, keep: int = 1) -> Path:
    """Write `checkpoint` into `directory` atomically, replacing the one there (or, with `keep`,
    the oldest of those kept).

    The arrays go to a freshly named `.npz`, then `checkpoint.json` (the commit record) is renamed
    over the old one, then the arrays of earlier checkpoints and leftovers of interrupted writes
    are removed. A crash before the commit record's rename leaves the earlier checkpoint whole.

    When a leaf is sharded over more than one device (`is_sharded`), the arrays go instead to a
    freshly named orbax-checkpoint folder, `state-UPDATES-TOKEN.orbax/`, with `variables/` and
    `opt_state/` in it: every process of a pool must call this alike, each writes the shards it
    holds, and process 0 alone writes the commit record, which lists every file of the folder
    with its size (so a truncated one is refused on reading), then removes earlier arrays.

    With `keep` above 1, the commit record also holds, under `kept`, the records of the
    `keep - 1` checkpoints before it (newest first, each as it was committed), and their arrays
    stay: one rename still commits the new checkpoint and lets the oldest go, so a crash leaves
    either the earlier set or the new one. `read_kept` lists them; `load_variables` and
    `load_checkpoint` read one given its record. Resuming reads the newest, as without `keep`.

    Args:
        directory: the checkpoint directory, created if missing.
        checkpoint: what to save; its metadata must be JSON.
        keep: how many checkpoints the directory holds once this one is committed, at least 1.

    Returns:
        The path of the commit record.

    Raises:
        ValueError: a keep below 1, naming it.
    """
    check_int("keep", keep, low=1)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    leaves = _leaves("variables", checkpoint.variables) + _leaves("opt_state", checkpoint.opt_state)
    if is_sharded([leaf for _, leaf in leaves]):
        return _save_orbax(directory, checkpoint, leaves, keep)
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
    return _commit(directory, record, keep)


def is_sharded(tree: Any) -> bool:
    """Whether a leaf of `tree` is a jax array spread over more than one device: such a tree's
    checkpoints are written with orbax, each process its own shards."""
    return any(
        isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1
        for leaf in jax.tree.leaves(tree)
    )


def _commit(directory: Path, record: dict, keep: int) -> Path:
    """Rename the commit record naming `record["arrays"]` (and, under `kept`, the `keep - 1`
    checkpoints before it) into place, then remove the arrays of every other checkpoint and
    what interrupted writes left (temporary files, orbax's temporary folders)."""
    record = {**record, "kept": _kept(directory, keep)} if keep > 1 else record
    text = json.dumps(record, indent=1, allow_nan=False).encode()
    _write_atomically(directory / COMMIT, lambda file: file.write(text))
    named = {record["arrays"], *(kept["arrays"] for kept in record.get("kept", ()))}
    for stale in directory.iterdir():
        if stale.name in named:
            continue
        if stale.name.startswith(STATE) or stale.name.endswith(".tmp"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
    return directory / COMMIT


def _kept(directory: Path, keep: int) -> list[dict]:
    """The records a new commit keeps beside its own: the one committed now and those it kept,
    newest first, `keep - 1` at most, each without its own `kept`. None from a record that
    does not read (a damaged one is no checkpoint to keep) or whose arrays are gone."""
    try:
        previous = json.loads((directory / COMMIT).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []
    if not isinstance(previous, dict) or not isinstance(previous.get("arrays"), str):
        return []
    earlier = previous.pop("kept", [])
    records = [previous, *(earlier if isinstance(earlier, list) else [])]
    return [
        record
        for record in records
        if isinstance(record, dict) and (directory / str(record.get("arrays"))).exists()
    ][: keep - 1]


def read_kept(directory: str | os.PathLike) -> list[dict]:
    """The commit records of the checkpoints kept before the newest (`save_checkpoint`'s
    `keep`), newest first; each can be handed to `load_variables` or `load_checkpoint` as
    `record`. Empty when there are none (or no checkpoint).

    Raises:
        ValueError: as `read_commit`, for the newest record.
    """
    record = read_commit(directory)
    return [] if record is None else list(record.get("kept", []))


def _fresh_name(updates: int) -> str:
    """A new orbax folder's name, the same on every process of a pool (each writes into it)."""
    token = np.array(secrets.randbits(31), np.int32)
    if jax.process_count() > 1:
        token = multihost_utils.broadcast_one_to_all(token)
    return f"{STATE}{updates:08d}-{int(token):08x}.{ORBAX}"


def _flat(leaves: list[tuple[int, str, Any]], tree_name: str) -> dict[str, Any]:
    # orbax's keys: the leaf's index in the commit record's list, so no tree node of an
    # optimizer's state (an empty one, a named tuple) need survive orbax's own tree handling.
    return {f"leaf{i}": leaf for i, path, leaf in leaves if path.startswith(tree_name)}


def _save_orbax(
    directory: Path, checkpoint: Checkpoint, leaves: list[tuple[str, Any]], keep: int
) -> Path:
    """`save_checkpoint` of sharded arrays: an orbax folder every process writes its shards
    into, then process 0's commit record."""
    import orbax.checkpoint as ocp  # the sharded extra, needed only here

    name = _fresh_name(checkpoint.updates)
    folder = (directory / name).absolute()
    numbered = [(index, path, leaf) for index, (path, leaf) in enumerate(leaves)]
    items = {
        tree: ocp.args.StandardSave(_flat(numbered, tree)) for tree in ("variables", "opt_state")
    }
    # A synchronous checkpointer: every shard is on disk, and orbax has renamed its temporary
    # folder into place on every process's behalf, when `save` returns.
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(folder, ocp.args.Composite(**items))
    if jax.process_index() != 0:
        return directory / COMMIT
    files = {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    # On disk before the record that names them: a power cut must not leave a committed
    # checkpoint whose shards were still in the page cache.
    for path in [*folder.rglob("*"), folder]:
        _fsync(path)
    record = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "storage": ORBAX,
        "arrays": name,
        "updates": int(checkpoint.updates),
        "position": int(checkpoint.position),
        "metadata": dict(checkpoint.metadata),
        "leaves": [
            {"path": path, "shape": list(np.shape(leaf)), "dtype": jnp.result_type(leaf).name}
            for path, leaf in leaves
        ],
        "files": files,
    }
    return _commit(directory, record, keep)


def read_commit(directory: str | os.PathLike) -> dict | None:
    """A checkpoint's commit record, with its array archive read through once (an orbax
    folder's files checked against the sizes the record lists, not read: they are the size of
    the model), so a damaged checkpoint is refused before a resumed run starts anything.

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
    if record.get("storage") == ORBAX:
        _check_files(commit, arrays, record.get("files"))
        return record
    try:
        # Opened here, so a damaged archive's file is closed too (np.load leaks it).
        with open(arrays, "rb") as file, np.load(file, allow_pickle=False) as stored:
            for name in stored.files:
                stored[name]  # reads and checks each array whole
    except Exception as error:  # a zip, npy or file error: the archive is damaged or missing
        problem = f"{type(error).__name__}: {error}"
        raise ValueError(f"{arrays} is damaged or missing ({problem})") from None
    return record


def _check_files(commit: Path, folder: Path, files: Any) -> None:
    """Refuse an orbax folder whose files are not those its commit record lists, of the sizes it
    lists: a file missing, cut short or grown names itself. Nothing is read: a folder of a
    model's shards is the size of the model."""
    if not isinstance(files, dict) or not files:
        raise ValueError(f"{commit} lists no files of its orbax folder {folder.name}")
    if not folder.is_dir():
        raise ValueError(f"{folder} is missing (the commit record {commit} names it)")
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{path} is missing (the commit record {commit} lists it)")
        if path.stat().st_size != size:
            raise ValueError(
                f"{path} is damaged: {path.stat().st_size} bytes, the commit record {commit} "
                f"says {size} (truncated, or written over)"
            )


def _target(leaf: Any) -> jax.ShapeDtypeStruct:
    """What a template leaf restores as: its shape and dtype, placed on its own sharding
    (another mesh than the one saved from, or one device), or on this process's first device
    when it has none (a host value, a ShapeDtypeStruct without one)."""
    placed = getattr(leaf, "sharding", None)  # an array's, or a ShapeDtypeStruct's
    if placed is None:
        placed = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf), sharding=placed)


def _restore_orbax(
    folder: Path, expected: list[tuple[int, str, Any]], trees: list[str]
) -> dict[int, jax.Array]:
    """The arrays of `trees` in an orbax folder `_save_orbax` wrote, by their index in the commit
    record, each placed as its template leaf is (orbax reads on each process only the shards
    of that placement)."""
    import orbax.checkpoint as ocp

    targets = [(index, path, _target(leaf)) for index, path, leaf in expected]
    items = {tree: ocp.args.StandardRestore(_flat(targets, tree)) for tree in trees}
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(folder.absolute(), ocp.args.Composite(**items))
    except Exception as error:  # tensorstore's, orbax's: the folder does not read back
        problem = f"{type(error).__name__}: {error}"
        raise ValueError(f"{folder} is damaged ({problem})") from None
    merged = {key: value for tree in trees for key, value in restored[tree].items()}
    return {index: merged[f"leaf{index}"] for index, _, _ in expected}


def load_variables(
    directory: str | os.PathLike, variables: Variables, *, record: dict | None = None
) -> Variables | None:
    """Only the variables of the checkpoint in `directory`, laid out and placed like the template
    `variables` (as `load_checkpoint`): what an export needs, without reading the optimizer's
    state (Adam's is twice the params).

    Args:
        directory: where `save_checkpoint` wrote.
        variables: the template.
        record: the commit record read already (`read_commit`), whose arrays are read: so the
            variables are that checkpoint's even when a run training alongside has committed
            another since. None reads the record now.

    Returns:
        The variables; None when the directory holds no checkpoint.

    Raises:
        ValueError: as `load_checkpoint`.
    """
    read = _read_trees(directory, {"variables": variables}, record)
    return None if read is None else read[1]["variables"]


def _read_trees(
    directory: str | os.PathLike, trees: dict[str, Any], record: dict | None = None
) -> tuple[dict, dict] | None:
    """The commit record of the checkpoint in `directory` (`record`, or the one there now) and
    its trees named in `trees` (those of "variables" and "opt_state" asked for), rebuilt like
    those templates; None when there is no checkpoint."""
    commit = Path(directory) / COMMIT
    record = read_commit(directory) if record is None else record
    if record is None:
        return None
    expected = [leaf for name, tree in trees.items() for leaf in _leaves(name, tree)]
    saved = [
        (index, entry)
        for index, entry in enumerate(record["leaves"])
        if str(entry.get("path", "")).startswith(tuple(trees))
    ]
    if len(saved) != len(expected):
        raise ValueError(
            f"{commit} holds {len(saved)} leaves of {' and '.join(trees)}, the templates have "
            f"{len(expected)}: a checkpoint of another model or optimizer"
        )
    numbered = []
    for (index, entry), (path, leaf) in zip(saved, expected, strict=True):
        want = jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf))
        if entry["path"] != path:
            raise ValueError(f"{commit} leaf {index} is {entry['path']}, the templates' {path}")
        if tuple(entry["shape"]) != want.shape or entry["dtype"] != want.dtype.name:
            raise ValueError(
                f"{commit} leaf {path} is {entry['dtype']}{entry['shape']}, "
                f"the templates' {want.dtype.name}{list(want.shape)}"
            )
        numbered.append((index, path, leaf))
    arrays = commit.parent / record["arrays"]
    if not arrays.exists():  # a newer commit removed them since `record` was read
        raise ValueError(f"{arrays} is missing (the commit record {commit} named it)")
    if record.get("storage") == ORBAX:
        restored = _restore_orbax(arrays, numbered, list(trees))
    else:
        restored = {}
        with np.load(arrays, allow_pickle=False) as stored:
            for index, _, leaf in numbered:
                want = jnp.result_type(leaf)
                array = stored[f"leaf{index}"]
                value = array.view(want) if array.dtype != want else array
                restored[index] = _placed_like(value, leaf)
    values = iter(restored[index] for index, _, _ in numbered)
    rebuilt = {
        name: jax.tree.unflatten(
            jax.tree.structure(tree), [next(values) for _ in jax.tree.leaves(tree)]
        )
        for name, tree in trees.items()
    }
    return record, rebuilt


def _placed_like(value: np.ndarray, template: Any) -> jax.Array:
    """An npz's array placed as its template leaf is: on the template's device or sharded like
    it (each process building its own shards from the whole value it read), or, for a template
    placed nowhere in particular, on the default device."""
    if isinstance(template, jax.Array) and template.committed:
        return jax.make_array_from_callback(value.shape, template.sharding, lambda i: value[i])
    return jnp.asarray(value)


def load_checkpoint(
    directory: str | os.PathLike,
    variables: Variables,
    opt_state: Any,
    *,
    record: dict | None = None,
) -> Checkpoint | None:
    """Read the checkpoint in `directory` into trees laid out like `variables` and `opt_state`.

    Args:
        directory: where `save_checkpoint` wrote.
        variables, opt_state: templates: the checkpoint's leaves must have their paths, shapes
            and dtypes (their values are not used).
        record: the commit record of the checkpoint to read (one of `read_kept`'s, for an
            earlier one); None reads the newest.

    Returns:
        The checkpoint, its leaves as jax arrays placed as the templates' leaves are; None when
        the directory holds none. A template of arrays sharded over another mesh, or on one
        device, restores the saved arrays (an orbax checkpoint's shards) onto it.

    Raises:
        ValueError: naming the file, or the leaf whose path, shape or dtype differs from the
            templates'.
    """
    read = _read_trees(directory, {"variables": variables, "opt_state": opt_state}, record)
    if read is None:
        return None
    record, rebuilt = read
    return Checkpoint(
        rebuilt["variables"],
        rebuilt["opt_state"],
        updates=int(record["updates"]),
        position=int(record["position"]),
        metadata=record["metadata"],
    )
