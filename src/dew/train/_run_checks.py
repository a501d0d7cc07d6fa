"""What a run's options ask of this process, checked before anything is built or written: its
share of each batch, `--minibatches` that divide its rows, and the memory it will hold against
the machine's (`memory_estimate`).

Apart from `_run.py`, which builds and runs the run, because each reads the config and the task
alone; `dew train`'s command line runs the same checks before it starts a pool.
"""

from __future__ import annotations

from typing import Any

from dew import models
from dew.models import hf
from dew.models.hf import lora
from dew.train._config import TrainConfig
from dew.train._memory import GIB, Estimate, estimate, machine_memory
from dew.train._tasks import _task


def _shares(config: TrainConfig, processes: int) -> tuple[int, Any, int, int]:
    """This process's share of each batch: its tasks, the groups it admits (`--admit`), its
    engine's slots (every rollout in flight, `--ahead` batches of them) and the rollouts a
    step packs."""
    tasks = config.batch_size // processes
    admit = config.admit if not isinstance(config.admit, int) else config.admit // processes
    slots = tasks * (config.groups + config.oversample) * (config.ahead + 1)
    # Carry-over trains a batch's cut groups at a later step: a step may take a whole batch.
    full = not isinstance(admit, int) or config.carry_over  # auto may admit the whole batch
    return tasks, admit, slots, (tasks if full else admit) * config.groups


def _check_minibatches(config: TrainConfig, tokenizer, processes: int) -> None:
    """Refuse `--minibatches` that do not divide a step's packed rows (this process's share; a
    narrowed batch has 2, 4, ... 16 times as many, which it divides too).

    Raises:
        ValueError: naming --minibatches and the rows.
    """
    if config.minibatches == 1:
        return
    rows = _task(config, tokenizer).shape.rows(_shares(config, processes)[3])
    if rows % config.minibatches:
        raise ValueError(
            f"--minibatches {config.minibatches} must divide the {rows} rows a step packs "
            f"(this task's rows for --batch-size {config.batch_size} x --groups {config.groups}"
            f"{f' over {processes} processes' if processes > 1 else ''})"
        )


def memory_estimate(config: TrainConfig, tokenizer, processes: int = 1) -> Estimate:
    """What one process of the run will hold (`dew.train._memory.estimate`), from the task's
    shape and the model's, before anything is built: dew's transformer of the config, or the
    `--model` checkpoint's from its config and headers. vLLM's cache is its server's, not
    the run's."""
    shape = _task(config, tokenizer).shape
    _, _, slots, rollouts = _shares(config, processes)
    if config.model is None:
        model_config = config.model_config(shape.max_len, vocab=tokenizer.vocab_size)
        model = models.model(model_config, remat=config.remat)
    else:
        model = hf.model_of(config.model, dtype=config.dtype)
    if config.lora:
        model = lora.LoRAModel(model, config.lora_config())
    return estimate(
        model,
        rows=shape.rows(rollouts),
        width=shape.width,
        slots=0 if config.engine == "vllm" else slots,
        max_len=shape.max_len,
        ahead=config.ahead,
        remat=config.remat,
        reference=config.kl_coef > 0,
    )


def _check_memory(config: TrainConfig, tokenizer, processes: int) -> Estimate:
    """The run's memory estimate, refused before anything is built or written when it exceeds
    the machine's memory (the run was killed by the kernel minutes in, at 18.5 GiB).

    Raises:
        ValueError: naming the estimate, its largest part, the machine's memory and the
            options that lower that part.
    """
    needed = memory_estimate(config, tokenizer, processes)
    available = machine_memory()
    if needed.total <= available:
        return needed
    parts = {
        "weights and Adam": (needed.weights, "--d-model or --layers, or take a smaller --model"),
        "the engine's cache": (needed.cache, "--batch-size, --groups, --ahead, --max-context"),
        "the step's activations": (
            needed.activations,
            "--max-context, --batch-size, --groups" + ("" if config.remat else ", or pass --remat"),
        ),
        "the packed batches": (needed.batches, "--batch-size, --groups, --max-context"),
    }
    part, (size, knobs) = max(parts.items(), key=lambda item: item[1][0])
    raise ValueError(
        f"the run would need about {needed.total / GIB:.1f} GiB, {size / GIB:.1f} of them "
        f"{part}, but this machine has {available / GIB:.1f} GiB: lower {knobs}"
    )
