"""`dew export`: a run's last checkpoint written as a Hugging Face checkpoint folder.

A `dew train --model` run whose params are sharded over a mesh writes its checkpoint folder,
`checkpoints/model`, only when it ends (`_run._FolderTrainer`); its periodic checkpoints are
orbax shards. `dew export --run RUN` writes the folder from the run's last committed checkpoint,
whichever way it was stored: that of a run that crashed, or of one still running.

An export destroys nothing it did not write. `--to` names a new folder, an empty one, or one an
earlier export wrote: each export writes `dew-export.json` into its folder once the folder is
whole, and a folder holding that record and nothing but the files an export writes is replaced
(one whose export was cut short before its record is refused like any other: nothing is lost).
Any other folder is refused, naming it: the run folder, a folder inside it (but the run's own
`checkpoints/model`) or above it, the current folder, a folder holding other files.

A `--lora` run's export is its adapter as PEFT saves it (the run's own `checkpoints/adapter`
unless `--to` names another folder), or with `--merge` the checkpoint with the adapter merged
into its weights (`dew.models.hf.lora.merged`): a full folder transformers and vLLM load
without PEFT.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax

from dew.models import hf
from dew.models.hf import lora, sharding
from dew.train._checkpoint import COMMIT, _write_atomically, load_variables, read_commit
from dew.train._config import TrainConfig, _read_json
from dew.train._folders import _nearest_existing, _probe
from dew.train._run import ADAPTER

MARKER = "dew-export.json"
"""The record an export writes into its folder (the run and step exported): a folder holding
it, and only the files an export writes, is one a later export may replace."""
_WRITTEN = frozenset(
    {hf.CONFIG, hf.WEIGHTS, *hf.TOKENIZER_FILES, lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, MARKER}
)
# A read that fails because a newer commit replaced the record is made again with the newer
# one, at most this many times in all: a run committing faster than its params read ends it.
_READS = 3


def export(
    run: str | os.PathLike, to: str | os.PathLike | None = None, *, merge: bool = False
) -> tuple[Path, int]:
    """Write the params of `run`'s last checkpoint as a checkpoint folder `transformers` and
    vLLM load: the trained folder's config and tokenizer files, the params' tensors.

    Only the params are read, not the optimizer's state. With more than one device they are
    restored sharded over all of this process's devices (fsdp), so no device holds them whole;
    either way `hf.save` gathers and writes them one tensor at a time.

    Args:
        run: a `dew train --model` run folder.
        to: the folder to write: a new one, an empty one, or one an export wrote (replaced
            whole); None for `run/checkpoints/model` (a `--lora` run's adapter:
            `run/checkpoints/adapter`).
        merge: for a `--lora` run, write the checkpoint with the adapter merged into its
            weights rather than the adapter.

    Returns:
        The folder written and the checkpoint's optimizer updates.

    Raises:
        ValueError: naming the run when it holds no run, no checkpoint, a run of dew's own
            transformer, or a checkpoint folder trained that is gone; `merge` for a run that
            trained every param (there is no adapter to merge); a damaged checkpoint
            (`read_commit`); naming `to` when writing it could destroy what an export did not
            write, or it cannot be written (`_check_destination`).
    """
    run = Path(run)
    saved = run / "config.json"
    if not saved.is_file():
        raise ValueError(f"--run {run} holds no dew train run (no {saved.name})")
    config = TrainConfig.from_json(_read_json(saved))
    if config.model is None:
        raise ValueError(
            f"--run {run} trained dew's own transformer, not a --model checkpoint folder: there "
            "is no Hugging Face folder to write"
        )
    try:
        folder = hf.resolve(config.model)  # a Hub repository id: its snapshot in the cache
    except ValueError as error:
        raise ValueError(f"--run {run} trained --model {config.model}: {error}") from None
    if not (folder.is_dir() or hf.is_gguf(folder)):
        raise ValueError(
            f"--run {run} trained --model {folder}, which is gone: its config.json and "
            "tokenizer files (a GGUF file's metadata) go into the folder written"
        )
    adapter = config.lora_config()
    if merge and adapter is None:
        raise ValueError(
            f"--merge merges a --lora run's adapter into its checkpoint; --run {run} trained "
            "every param, which dew export writes as they are without --merge"
        )
    checkpoints = run / "checkpoints"
    # The folder the run writes itself, with each checkpoint.
    own = checkpoints / ("model" if adapter is None or merge else ADAPTER)
    to = own if to is None else _check_destination(Path(to), run, own)
    model = hf.model_of(folder, dtype=config.dtype)
    if adapter is not None:
        # A LoRA run's checkpoints keep the adapter alone: the base is the folder's.
        shapes = jax.eval_shape(lambda key: lora.init(key, model, adapter), jax.random.key(0))
        record, stored = _committed_params(run, {"adapter": shapes})
        if merge:
            _, params = hf.load(folder, dtype=config.dtype)
            merged = jax.jit(lora.merged, static_argnums=2)(params, stored["adapter"], adapter)
            hf.save(to, model, merged, tokenizer_from=folder)
        else:
            lora.save_adapter(to, stored["adapter"], adapter, base_model=str(folder))
        _mark(to, own, run, record)
        return to, int(record["updates"])
    template = jax.eval_shape(model.init, jax.random.key(0))
    if jax.local_device_count() > 1:
        placed = sharding.param_shardings(model, sharding.make_mesh(devices=jax.local_devices()))
        template = jax.tree.map(
            lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
            template,
            placed,
        )
    record, params = _committed_params(run, template)
    hf.save(to, model, params, tokenizer_from=folder)
    _mark(to, own, run, record)
    return to, int(record["updates"])


def _mark(to: Path, own: Path, run: Path, record: dict) -> None:
    """Write the export's record into `to`, unless it is the run's own folder."""
    if to != own:
        text = _marker(run, record).encode()
        _write_atomically(to / MARKER, lambda file: file.write(text))


def _committed_params(run: Path, template) -> tuple[dict, dict]:
    """The commit record of `run`'s last checkpoint and the params of that same checkpoint.

    The record is read once and its arrays are read by it: a run training alongside commits
    newer checkpoints meanwhile, and a second read of the record would name another step than
    the params read (the export said step 61 and wrote 63's weights). When reading fails
    because a newer commit replaced the record meanwhile (removing the arrays it named), the
    newer record is read and its arrays, so the step said is always the step written.

    Raises:
        ValueError: naming the run when it holds no checkpoint, or commits checkpoints faster
            than they are read; a damaged checkpoint (`read_commit`, `load_variables`).
    """
    checkpoints = run / "checkpoints"
    for _ in range(_READS):
        before = _identity(checkpoints / COMMIT)
        try:
            record = read_commit(checkpoints)
            if record is None:
                raise ValueError(f"--run {run} holds no checkpoint yet")
            return record, load_variables(checkpoints, template, record=record)
        except ValueError:
            if _identity(checkpoints / COMMIT) == before:
                raise  # damaged or missing, not replaced by a newer commit
    raise ValueError(
        f"--run {run} committed a newer checkpoint each of {_READS} times its params were "
        "read; export it once it stops"
    )


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file `path` is now (its inode and change time; None when there is none): a commit
    renames a new record over the old, so a record replaced since has another."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_ctime_ns


def _marker(run: Path, record: dict) -> str:
    """The text of `MARKER`: which run and step the folder holds."""
    exported = {"run": str(run.resolve()), "updates": int(record["updates"])}
    return json.dumps(exported, indent=1) + "\n"


def _check_destination(to: Path, run: Path, own: Path) -> Path:
    """`--to`, made absolute, once writing it is sure to destroy nothing an export did not
    write, and sure to succeed as far as the folder above it goes.

    `own`, the run's `checkpoints/model`, is the run's to replace: `--to` may name it.

    Raises:
        ValueError: one line naming `--to` as given, when it is the current folder or one
            above it, the run folder, inside it or above it, a file, a folder holding files
            an export did not write (naming some), or a place nothing can be written
            (a path through a file, /proc).
    """
    given = f"--to {to}"
    target, run = to.resolve(), run.resolve()
    if target == own.resolve():
        return own
    here = Path.cwd()
    if target == here or target in here.parents:
        raise ValueError(
            f"{given} is the current folder or one holding it, which an export would replace; "
            f"name a new folder to write, such as {to / 'exported'}"
        )
    if target == run or run in target.parents:
        raise ValueError(
            f"{given} is {'the run folder' if target == run else 'inside the run folder'} "
            f"{run}, whose config, logs and checkpoints an export would replace; export to a "
            f"folder outside it, or leave out --to for {own}"
        )
    if target in run.parents:
        raise ValueError(f"{given} holds the run folder {run}; name a new folder to write")
    if target.exists() and not target.is_dir():
        raise ValueError(f"{given} is a file, not a folder to write")
    if target.is_dir():
        entries = sorted(entry.name for entry in target.iterdir())
        marked = _marked(target)
        # Without an export's record every entry is another's; with it, those it never writes.
        foreign = [name for name in entries if not marked or name not in _WRITTEN]
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ValueError(
                f"{given} holds files dew export did not write ({shown}), which writing it "
                "would delete; export to a new or empty folder"
            )
    folder = _nearest_existing(target.parent)
    if not folder.is_dir():
        raise ValueError(f"{given}: {folder} is a file, not a folder")
    _probe(folder, given, directory=True)
    return target


def _marked(folder: Path) -> bool:
    """Whether `folder` holds an export's `MARKER` (a JSON object naming a run)."""
    try:
        record = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "run" in record


def configure_export_cli(parser: argparse.ArgumentParser) -> None:
    """Add `dew export`'s options: `--run` and `--to`."""
    parser.add_argument(
        "--run",
        dest="folder",  # `run` is the command's own entry (dew.cli)
        required=True,
        metavar="DIR",
        help="the folder of a `dew train --model` run",
    )
    parser.add_argument(
        "--to",
        metavar="DIR",
        default=None,
        help="the checkpoint folder to write: a new or empty folder, or one dew export wrote "
        "(replaced whole); never the run folder or a folder holding other files "
        "(default: RUN/checkpoints/model; a --lora run's adapter: RUN/checkpoints/adapter)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="for a --lora run, write the checkpoint with the adapter merged into its weights "
        "(a full folder transformers and vLLM load without PEFT), not the adapter",
    )


def run_export_cli(args: argparse.Namespace) -> int:
    """Run `dew export` from its parsed options; a bad run folder is one line and status 2."""
    try:
        to, updates = export(args.folder, args.to, merge=args.merge)
    except ValueError as error:
        args.parser.error(str(error))
    print(f"dew export: the checkpoint at step {updates} of {args.folder} written to {to}")
    return 0
