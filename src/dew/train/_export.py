"""`dew export`: a run's last checkpoint written as a Hugging Face checkpoint folder.

A `dew train --model` run whose params are sharded over a mesh writes its checkpoint folder,
`checkpoints/model`, only when it ends (`_run._FolderTrainer`); its periodic checkpoints are
orbax shards. `dew export --run RUN` writes the folder from the run's last committed checkpoint,
whichever way it was stored: that of a run that crashed, or of one still running.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import jax

from dew.models import hf
from dew.models.hf import sharding
from dew.train._checkpoint import load_variables, read_commit
from dew.train._config import TrainConfig, _read_json


def export(run: str | os.PathLike, to: str | os.PathLike | None = None) -> tuple[Path, int]:
    """Write the params of `run`'s last checkpoint as a checkpoint folder `transformers` and
    vLLM load: the trained folder's config and tokenizer files, the params' tensors.

    Only the params are read, not the optimizer's state. With more than one device they are
    restored sharded over all of this process's devices (fsdp), so no device holds them whole;
    either way `hf.save` gathers and writes them one tensor at a time.

    Args:
        run: a `dew train --model` run folder.
        to: the folder to write (replaced whole if it exists); None for `run/checkpoints/model`.

    Returns:
        The folder written and the checkpoint's optimizer updates.

    Raises:
        ValueError: naming the run when it holds no run, no checkpoint, a run of dew's own
            transformer, or a checkpoint folder trained that is gone; a damaged checkpoint
            (`read_commit`).
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
    if not folder.is_dir():
        raise ValueError(
            f"--run {run} trained --model {folder}, which is gone: its config.json and "
            "tokenizer files go into the folder written"
        )
    checkpoints = run / "checkpoints"
    record = read_commit(checkpoints)
    if record is None:
        raise ValueError(f"--run {run} holds no checkpoint yet")
    model = hf.model_of(folder, dtype=config.dtype)
    template = jax.eval_shape(model.init, jax.random.key(0))
    if jax.local_device_count() > 1:
        placed = sharding.param_shardings(model, sharding.make_mesh(devices=jax.local_devices()))
        template = jax.tree.map(
            lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
            template,
            placed,
        )
    params = load_variables(checkpoints, template)
    to = checkpoints / "model" if to is None else Path(to)
    hf.save(to, model, params, tokenizer_from=folder)
    return to, int(record["updates"])


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
        help="the checkpoint folder to write, replaced whole if it exists "
        "(default: RUN/checkpoints/model)",
    )


def run_export_cli(args: argparse.Namespace) -> int:
    """Run `dew export` from its parsed options; a bad run folder is one line and status 2."""
    try:
        to, updates = export(args.folder, args.to)
    except ValueError as error:
        args.parser.error(str(error))
    print(f"dew export: the checkpoint at step {updates} of {args.folder} written to {to}")
    return 0
