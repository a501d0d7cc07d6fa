"""`dew train`'s config: `TrainConfig`, its fields' checks, and reading it from a file.

A run folder's `config.json` is a `TrainConfig` as JSON; `--config` reads one from TOML or JSON,
with the command line's options over it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from dew import models
from dew._checks import in_range, int_within
from dew.envs.lookup import HARNESSES
from dew.envs.reasoning_gym import PREFIX, ReasoningGym
from dew.serve.tokenizer import BYTES, HuggingFaceTokenizer, Tokenizer

TASKS = ("copy", "guess")
"""The built-in tasks `dew train --task` runs: CopyDigits and GuessDigit."""
HARNESS = "harness:"
"""The prefix of a task that is a built-in agent harness (`--harness NAME` is this plus NAME)."""
# What a harness run needs installed: the gateway extra.
_GATEWAY_PACKAGES = ("hypercorn", "openai", "orjson")
MAX_IN_FLIGHT = 2**16
"""The most rollouts a run has in flight, batch_size x (groups + oversample) x (ahead + 1): the
engine holds a slot, and its cache, for each."""
MAX_WEIGHTS = 2**31
"""The most weights of a run's transformer blocks (8 GiB of float32, before Adam's two more)."""
# Fields that change what a run logs, not what it trains: a resumed run may change them.
_LOGGING = ("steps", "eval_every", "samples", "tensorboard")


def _task_name(instance, attribute, value):
    if isinstance(value, str) and value.startswith(HARNESS):
        _check_harness(value.removeprefix(HARNESS))
    elif not isinstance(value, str) or not (value in TASKS or value.startswith(PREFIX)):
        raise ValueError(
            f"{attribute.name} must be one of {TASKS}, {PREFIX}NAME[,key=value...] or "
            f"{HARNESS}NAME, got {value!r}"
        )


def _check_harness(name: str) -> None:
    """Raises: ValueError naming the built-in harnesses when `name` is not one, or the packages
    of the recording gateway that are not installed."""
    if name not in HARNESSES:
        raise ValueError(
            f"unknown harness {name!r}; the built-in harnesses are: {', '.join(HARNESSES)}"
        )
    missing = [package for package in _GATEWAY_PACKAGES if not importlib.util.find_spec(package)]
    if missing:
        raise ValueError(
            f"a harness trains through the recording gateway, which needs {', '.join(missing)}: "
            "pip install 'dew[gateway]'"
        )


def _flag(instance, attribute, value):
    # A config file's "yes" or 1 is a mistake to name, not a truth to guess.
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be true or false, got {value!r}")


def _path_or_none(instance, attribute, value):
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"{attribute.name} must be a file's path or None, got {value!r}")


def _option(default: Any, validator: Callable, help: str, *, kind: type | None = None) -> Any:
    """A TrainConfig field that is also a `dew train` option, with its help text and, where
    the default (None) does not tell it, the type of its values."""
    kind = type(default) if kind is None else kind
    return attrs.field(default=default, validator=validator, metadata={"help": help, "type": kind})


@attrs.frozen
class TrainConfig:
    """One `dew train` run: the task, the model, the scheduler and the optimizer.

    Args:
        task: the built-in task, `copy` (CopyDigits, single turn) or `guess` (GuessDigit,
            multi-turn), a reasoning-gym dataset, `reasoning-gym:NAME[,key=value...]`
            (`dew.envs.reasoning_gym`), or a built-in agent harness behind the recording
            gateway, `harness:NAME` (`dew.envs.lookup.HARNESSES`; `dew train --harness NAME`).
        steps: optimizer updates to train for.
        batch_size: tasks per batch, one group each.
        groups: rollouts per task that train together.
        tasks: distinct task ids; the stream goes over them in a seeded order, epoch after epoch.
        learning_rate: Adam's step size.
        temperature: the engine's sampling temperature; the objective's log-probs are of the
            same tempered distribution.
        ahead: task batches submitted before the trainer hands them over (the trainer reads
            that far ahead); 0 is synchronous.
        max_lag: the most updates a rollout's oldest call may be behind at training.
        sync_every: updates between weight pushes to the engine.
        oversample: extra rollouts started per group; the first `groups` to finish train and the
            rest are cancelled (the long tail cut, at the price of favouring short rollouts:
            see `dew tune`'s selection column).
        admit: groups trained per batch, the first to complete; the batch's other groups are
            cancelled. None trains every task's group. In a pool each process admits its
            share, so it must split evenly over the processes.
        checkpoint_every: updates between checkpoints.
        seed: seeds the initial weights, the task order and the sampling.
        d_model, layers, heads, d_ff: the transformer's shape (`dew.models.TransformerConfig`).
        max_tokens: a reasoning-gym reply's most tokens (a built-in task sets its own).
        eval_every: steps between greedy evaluations on the held-out tasks; 0 for none.
        eval_tasks: held-out tasks, the ids after the training ones.
        samples: rollouts per step written, decoded, to `samples.jsonl`; 0 for none.
        tensorboard: also write the metrics as TensorBoard scalars (needs tensorboardX).
        tokenizer: a Hugging Face `tokenizer.json` (`dew.serve.tokenizer.HuggingFaceTokenizer`)
            that renders the prompts and decodes the replies; the model's vocabulary is its
            size. None for the byte tokenizer.
    """

    task: str = _option(
        "copy",
        _task_name,
        "copy (repeat digits, one turn), guess (find a digit, turns), "
        "reasoning-gym:NAME[,key=value...] (a reasoning-gym dataset and its config) or "
        "harness:NAME (a built-in agent harness, as --harness NAME)",
    )
    steps: int = _option(400, int_within(1, 10**6), "optimizer updates to train for")
    batch_size: int = _option(8, int_within(1, 4096), "tasks per batch, one group each")
    groups: int = _option(16, int_within(2, 4096), "rollouts per task that train together")
    tasks: int = _option(
        1000, int_within(1, 10**6), "distinct task ids the stream goes over, epoch after epoch"
    )
    learning_rate: float = _option(1e-3, in_range(0, 1, low_open=True), "Adam's step size")
    temperature: float = _option(
        1.0, in_range(0.01, 100), "the sampling temperature, which the objective scores at too"
    )
    ahead: int = _option(
        1, int_within(0, 64), "task batches submitted before the trainer needs them (0 = sync)"
    )
    max_lag: int = _option(
        1, int_within(0, 10**6), "the most updates a rollout may be behind when it trains"
    )
    sync_every: int = _option(
        1, int_within(1, 10**6), "updates between weight pushes to the engine"
    )
    oversample: int = _option(
        0, int_within(0, 4096), "extra rollouts per group; the first `groups` to finish train"
    )
    admit: int | None = _option(
        None,
        attrs.validators.optional(int_within(1, 4096)),
        "groups trained per batch, the first to complete; none trains every task's group",
        kind=int,
    )
    checkpoint_every: int = _option(25, int_within(1, 10**6), "updates between checkpoints")
    seed: int = _option(
        0, int_within(0, 2**32 - 1), "seeds the weights, the task order and the sampling"
    )
    d_model: int = _option(64, int_within(1, 2**14), "the transformer's width")
    layers: int = _option(2, int_within(1, 256), "the transformer's blocks")
    heads: int = _option(4, int_within(1, 256), "the transformer's attention heads")
    d_ff: int = _option(256, int_within(1, 2**16), "the transformer's MLP width")
    max_tokens: int = _option(
        4,
        int_within(1, 2**16),
        "a reasoning-gym reply's most tokens (built-in tasks set their own)",
    )
    eval_every: int = _option(
        0, int_within(0, 10**6), "steps between greedy evaluations on held-out tasks (0 = none)"
    )
    eval_tasks: int = _option(
        16, int_within(1, 10**5), "held-out tasks, the ids after the training ones"
    )
    samples: int = _option(
        4, int_within(0, 10**4), "rollouts per step written, decoded, to samples.jsonl (0 = none)"
    )
    tensorboard: bool = _option(
        False,
        _flag,
        "also write the metrics as TensorBoard scalars to RUN/tensorboard (needs tensorboardX)",
    )
    tokenizer: str | None = _option(
        None,
        _path_or_none,
        "a Hugging Face tokenizer.json for the prompts and replies, with <bos>, <|im_start|> "
        "and <|im_end|> as special tokens; the model's vocabulary is its size (none: bytes)",
        kind=str,
    )

    def __attrs_post_init__(self):
        if self.d_model % self.heads:
            raise ValueError(
                f"d_model must be a multiple of heads {self.heads}, got {self.d_model}"
            )
        # What the engine and the model allocate grows with products of the fields: each field
        # within its bound can still multiply up to terabytes.
        in_flight = self.batch_size * (self.groups + self.oversample) * (self.ahead + 1)
        if in_flight > MAX_IN_FLIGHT:
            raise ValueError(
                f"batch_size x (groups + oversample) x (ahead + 1) is the rollouts in flight, "
                f"which must be <= {MAX_IN_FLIGHT}, got {in_flight}"
            )
        weights = self.layers * (4 * self.d_model**2 + 2 * self.d_model * self.d_ff)
        if weights > MAX_WEIGHTS:
            raise ValueError(
                f"layers x (4 d_model^2 + 2 d_model d_ff) is the transformer's weights, which "
                f"must be <= {MAX_WEIGHTS}, got {weights}"
            )
        if self.tasks < self.batch_size:
            raise ValueError(f"tasks must be >= batch_size {self.batch_size}, got {self.tasks}")
        if self.admit is not None and self.admit > self.batch_size:
            raise ValueError(f"admit must be <= batch_size {self.batch_size}, got {self.admit}")
        if self.max_lag < self.ahead + self.sync_every - 1:
            raise ValueError(
                f"max_lag must be >= ahead + sync_every - 1 = {self.ahead + self.sync_every - 1}, "
                f"got {self.max_lag}"
            )

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "config.json") -> TrainConfig:
        """The config a run folder's `config.json` (or a `--config` file) holds.

        Raises:
            ValueError: naming a key that is not a field, or a field out of bounds.
        """
        return cls(**_fields_of(data, where))

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> TrainConfig:
        """The config of a TOML or JSON file (a run folder's `config.json` among them), with
        `overrides` (the options given on the command line) over it.

        Raises:
            ValueError: naming the file when it cannot be read or parsed, a key that is not a
                field, or a field out of bounds.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
            toml = path.suffix.lower() == ".toml"
            data = tomllib.loads(text) if toml else json.loads(text)
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise ValueError(f"cannot read the config file {str(path)!r}: {error}") from error
        if not isinstance(data, Mapping):
            raise ValueError(f"{str(path)!r} must hold a table of TrainConfig fields")
        return cls(**{**_fields_of(data, str(path)), **overrides})

    def model_config(
        self, max_len: int, *, vocab: int = BYTES.vocab_size
    ) -> models.TransformerConfig:
        """The transformer's config for this run, with positions up to `max_len` and `vocab`
        token ids (the tokenizer's)."""
        return models.TransformerConfig(
            vocab=vocab,
            d_model=self.d_model,
            heads=self.heads,
            layers=self.layers,
            d_ff=self.d_ff,
            max_len=max_len,
        )


def _load_tokenizer(config: TrainConfig) -> Tokenizer:
    """The tokenizer `config` names: its `tokenizer.json`, or the byte tokenizer.

    Raises:
        ValueError: naming the path when it is no file, or not a tokenizer the chat template
            can use.
    """
    if config.tokenizer is None:
        return BYTES
    if Path(config.tokenizer).exists() and not Path(config.tokenizer).is_file():
        raise ValueError(f"--tokenizer {config.tokenizer}: not a file (a tokenizer.json is)")
    try:
        return HuggingFaceTokenizer.from_file(config.tokenizer)
    except FileNotFoundError:
        raise ValueError(f"--tokenizer {config.tokenizer}: there is no such file") from None
    except Exception as error:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"--tokenizer {config.tokenizer}: {error}") from error


def _check_task(config: TrainConfig) -> None:
    """Refuse a reasoning-gym task that names no dataset, or options its dataset refuses,
    before the run folder is made: reasoning-gym only says so when the task is built.

    Raises:
        ValueError: naming the task and what reasoning-gym refuses.
    """
    if not config.task.startswith(PREFIX):
        return
    try:
        # One entry is enough to meet the dataset's refusals: they come with its config or
        # its first draw.
        ReasoningGym.parse(config.task, size=1, seed=config.seed).entry(0)
    except ImportError as error:
        raise ValueError(f"--task {config.task}: {error}") from None
    except (TypeError, ValueError, AssertionError) as error:
        raise ValueError(f"--task {config.task}: {error}") from None


def _fields_of(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The fields `data` (the file `where`) gives, each checked by its own validator, so that a
    bad value is refused naming the file it is in.

    Raises:
        ValueError: naming `where` and the key that is not a field or the value out of bounds.
    """
    fields = attrs.fields_dict(TrainConfig)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where} has keys that are not TrainConfig fields: {unknown}")
    for name, value in data.items():
        try:
            fields[name].validator(None, fields[name], value)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    return dict(data)


def _read_json(path: Path) -> Any:
    """A JSON file's value.

    Raises:
        ValueError: naming the file when it is truncated or not JSON.
    """
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is damaged (not JSON: {error})") from None
