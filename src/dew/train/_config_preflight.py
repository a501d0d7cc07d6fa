"""What `dew train` checks of a config against the files and the machine before a run starts.

A `TrainConfig` checks its fields and how they go together when it is made (`_config`); what it
names outside itself is read here, before the run folder is made, so that a bad one is refused
in one line naming the option: the tokenizer (`_load_tokenizer`: a `tokenizer.json`, or a
`--model` checkpoint's, whose embedding must hold its ids), the devices a `--mesh` needs
(`_mesh_sizes`), a reasoning-gym task's dataset and options (`_check_task`) and an environment
task's package (`_load_environment`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dew.envs.reasoning_gym import PREFIX, ReasoningGym
from dew.serve.tokenizer import BYTES, HuggingFaceTokenizer, Tokenizer

if TYPE_CHECKING:
    from dew.train._config import TrainConfig


def _load_environment(config: TrainConfig) -> None:
    """Load an environment task (`--env`) as the run will, so a bad one is refused before the
    run starts.

    Raises:
        ValueError: naming the environment, the package to install or what it needs.
    """
    try:
        if config.task.startswith("verifiers:"):
            from dew.envs.verifiers import Verifiers

            Verifiers.parse(config.task, size=config.tasks + config.eval_tasks)
        elif config.task.startswith("textarena:"):
            from dew.envs.textarena import TextArena

            TextArena.parse(config.task, seed=config.seed)
    except ImportError as error:
        raise ValueError(str(error)) from error


def _load_tokenizer(config: TrainConfig) -> Tokenizer:
    """The tokenizer `config` names: its `tokenizer.json`, or the byte tokenizer.

    Raises:
        ValueError: naming the path when it is no file, or not a tokenizer the chat template
            can use.
    """
    if config.model is not None:
        return _model_tokenizer(config.model)
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


def _model_tokenizer(model: str) -> Tokenizer:
    """The tokenizer and chat template of the checkpoint `model` names (a folder, a Hub
    repository id or a GGUF file: `dew.models.hf.resolve`), once its config.json and its
    tensors' headers (a GGUF file's metadata and tensors' shapes and types) are checked (before
    any tensor is read) and it is found to have an embedding row for every id.

    Raises:
        ValueError: naming --model and the file, field or tensors at fault.
    """
    from dew.models import hf  # safetensors and the family on demand
    from dew.models.hf._config import read_config
    from dew.models.hf._gguf import GGUF, is_gguf

    folder = model
    try:
        folder = hf.resolve(model)
        if is_gguf(folder):  # its metadata and tensors' types and shapes, no tensor read
            checkpoint = hf.model_of(folder).config
            tokenizer = GGUF.open(folder).template_tokenizer()
            holders = ("tokenizer.ggml.tokens", "token_embd.weight")
        else:
            checkpoint, _ = read_config(folder)
            tokenizer = HuggingFaceTokenizer.from_folder(folder)
            holders = ("tokenizer.json", "config.json's vocab_size")
        if tokenizer.vocab_size > checkpoint.vocab:
            raise ValueError(
                f"its {holders[0]} has {tokenizer.vocab_size} ids, more than the "
                f"{checkpoint.vocab} embedding rows of its {holders[1]}"
            )
        hf.model_of(folder)  # every tensor's name, shape and file, from the headers
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(f"--model {model}: {error}") from None
    return tokenizer


def _mesh_sizes(
    config: TrainConfig, processes: int = 1, *, count: bool = True
) -> tuple[int, int, int] | None:
    """The data, fsdp and tensor sizes of `config.mesh`, or None.

    `count=False` leaves the devices uncounted: a process about to join a pool must not start
    JAX's backend before `jax.distributed.initialize` (`train` counts them once joined).

    Raises:
        ValueError: naming --mesh when its devices are not this process's (in a pool, the
            pool's), or in a pool when its data axis does not span the processes.
    """
    if config.mesh is None:
        return None
    import jax

    data, fsdp, tensor = (int(size) for size in config.mesh.split("x"))
    if processes > 1:
        # Each process's engine samples on its own from the params its devices hold, so they
        # must hold them whole: only the data axis spans processes.
        if data % processes:
            raise ValueError(
                f"--mesh {config.mesh} in a pool of {processes} processes: its data axis "
                f"({data}) must be a multiple of {processes}, so that each process's devices "
                "hold whole params for its engine (fsdp and tensor split within a process)"
            )
        devices = jax.local_device_count() * processes if count else data * fsdp * tensor
        if data * fsdp * tensor != devices:
            raise ValueError(
                f"--mesh {config.mesh} needs {data * fsdp * tensor} devices, the pool of "
                f"{processes} processes has {devices} ({jax.local_device_count()} each)"
            )
        return data, fsdp, tensor
    # A pool of one (`--processes 1`) joins it too: its devices are counted once it has.
    if count and data * fsdp * tensor != jax.device_count():
        raise ValueError(
            f"--mesh {config.mesh} needs {data * fsdp * tensor} devices, this process has "
            f"{jax.device_count()}"
        )
    return data, fsdp, tensor


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
