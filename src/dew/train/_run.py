"""`train`: one run of `dew train` in this process, end to end (the logs it writes step by step:
`_run_logs`; the checks of what its options ask of the process: `_run_checks`; its vLLM
servers: `_run_vllm`).

A run folder holds `config.json` (which `--config` reads back), `metrics.jsonl` (one line per
step, with the `eval/...` keys of the evaluation after it where there was one), `samples.jsonl`
(a few decoded rollouts per step), `eval.jsonl` (the evaluations on held-out tasks before the
first update and every `eval_every` updates, `dew.train._evaluation`), `eval_samples.jsonl`
and `eval_samples.md` (held-out replies at each evaluation beside the base model's),
`checkpoints/`, `curves.png` and, with `tensorboard`, TensorBoard's event files under
`tensorboard/` and, with `wandb`, Weights & Biases' files under `wandb/`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import jax
import numpy as np
import optax
from jax.sharding import Mesh

from dew import models, replay
from dew._gc import map_large_blocks_apart
from dew.models import hf
from dew.models.hf import lora, sharding
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.parallel import ProcessRows, default_pool
from dew.serve._lora import serving
from dew.train._checkpoint import COMMIT, _write_atomically, is_sharded
from dew.train._config import TrainConfig
from dew.train._config_preflight import _check_task, _load_tokenizer, _mesh_sizes
from dew.train._curves import write_curves
from dew.train._evaluation import (
    EVAL_SAMPLES,
    EVALUATIONS,
    Evaluation,
)
from dew.train._folders import (
    Misfit,
    _check_record,
    _check_run,
    _check_split,
    _RunLock,
)
from dew.train._interrupt import _Interrupted
from dew.train._memory import machine_memory
from dew.train._reference import reference_sync, synced_reference
from dew.train._run_checks import _check_memory, _check_minibatches, _shares
from dew.train._run_logs import SAMPLES, RunLogs
from dew.train._run_vllm import _served_folder, _vllm_engine
from dew.train._samples import SampleLog
from dew.train._tasks import _check_checkpoint_task, _objective, _sampling, _task
from dew.train._trainer import METRICS, Trainer

ADAPTER = "adapter"
"""A `--lora` run's checkpoints hold its adapter in this folder, as PEFT saves it."""


def train(
    config: TrainConfig,
    run: str | os.PathLike,
    *,
    resume: bool = False,
    on_step: Callable[[Mapping[str, Any]], None] | None = None,
    record: str | os.PathLike | None = None,
    deadline: float | None = None,
) -> Trainer:
    """Train `config`'s built-in task end to end, in the run folder `run`.

    Writes `run/config.json`, then trains with a RolloutServer, a RolloutScheduler (truncated
    rollouts train on their verifier's score) and a Trainer logging to `run/metrics.jsonl` and
    checkpointing to `run/checkpoints`, and finally draws `run/curves.png`.

    Args:
        config: the run.
        run: the run folder.
        resume: continue the run in `run` from its last checkpoint (from the start when it has
            none); otherwise `run` must not hold a run yet.
        on_step: called with each step's metrics line.
        record: write a `dew.replay` trace of the run here: every session the environment
            returned, every push and every call, so `dew replay` can reproduce the scheduler's
            decisions and packed batches without the engine (a single process's run only).
        deadline: in a pool, the seconds a step may take before every process stops.

    In a pool of `jax.distributed` processes (`dew train --processes`), every process calls it
    alike: each runs its own server and scheduler on its own rows of each global batch of
    `batch_size` tasks, and process 0 writes the run folder, which every process must read.

    Returns:
        The trainer, after its last step.

    Raises:
        RunInUse: when another run holds `run` (a `dew train` into it that has not ended).
        ValueError: on every process of a pool, when `run` cannot be made or written (a
            file, a path through a file, a folder that takes no new entry), holds a run and
            `resume` is not set, or holds a different config, or the batch does not split
            over the processes; when `record` exists already, is a folder, or its folder is
            missing or takes no new file; when the task cannot fit (`_check_checkpoint_task`:
            an environment's first prompt past --max-context, a checkpoint's limits).
    """
    run = Path(run)
    index, processes = jax.process_index(), jax.process_count()
    problem = None
    try:
        _check_run(config, run, resume=resume)
        _check_split(config, processes)
        tokenizer = _load_tokenizer(config)
        _mesh_sizes(config, processes)
        _check_task(config)
        # An environment's first prompts are sized (and a checkpoint's fit checked) before
        # the folder is written: one that cannot fit left a folder of only config.json.
        _check_checkpoint_task(config, tokenizer)
        memory = _check_memory(config, tokenizer, processes)
        _check_minibatches(config, tokenizer, processes)
        if record is not None and processes > 1:
            raise ValueError("--record traces a single process's run; run it without a pool")
        if config.keep_best and processes > 1:
            raise ValueError("--keep-best saves as process 0 evaluates; run it without a pool")
        if record is not None:
            _check_record(record)
    except ValueError as error:
        problem = error
    # Every process refuses alike, before process 0 writes anything.
    default_pool().agree(problem)
    if index == 0:
        print(memory.line(machine_memory()), flush=True)
    # Process 0, the one that writes the folder, holds it for the run's length: a second run
    # into it (a --resume typed while the first still trains) would log and train alongside.
    with _RunLock(run) if index == 0 else contextlib.nullcontext():
        # The run's weights, freed and made again at every push, stay out of the C heap, where
        # their holes stood resident under the first update's compilation and the updates.
        map_large_blocks_apart()
        return _train(config, run, resume=resume, on_step=on_step, record=record, deadline=deadline)


def _train(
    config: TrainConfig,
    run: Path,
    *,
    resume: bool,
    on_step: Callable[[Mapping[str, Any]], None] | None,
    record: str | os.PathLike | None,
    deadline: float | None,
) -> Trainer:
    """`train`, once the run is checked and process 0 holds its folder."""
    index, processes = jax.process_index(), jax.process_count()
    if index == 0:
        _write_atomically(
            run / "config.json",
            lambda file: file.write(json.dumps(attrs.asdict(config), indent=1).encode()),
        )

    tokenizer = _load_tokenizer(config)
    task = _task(config, tokenizer)
    shape = task.shape
    model, variables = _model(config, shape.max_len, tokenizer)
    served = _served_folder(config, run, model, variables)
    # The initial weights, kept as the KL term's reference; a resumed run derives them again.
    # Re-synced, the reference is the optimizer state's (`reference_sync`), which checkpoints
    # keep: the scheduler reads it as each batch is packed, at the update that batch trains at.
    reference = variables if config.kl_coef > 0 else None
    mesh = _mesh(config, model)
    if mesh is not None:
        variables = sharding.shard(variables, sharding.param_shardings(model, mesh))
    objective = _objective(model, config.temperature, **_levers(config))
    optimizer, learning_rate = _optimizer(config)
    if config.lora:
        optimizer = lora.frozen(optimizer)
    if config.ref_sync_every:  # last: it copies the params the update leaves, LoRA's base too
        optimizer = optax.chain(optimizer, reference_sync(config.ref_sync_every))
    trainer = _FolderTrainer(
        objective,
        optimizer,
        variables,
        learning_rate=learning_rate,
        directory=run,
        checkpoint_every=config.checkpoint_every,
        keep_checkpoints=config.keep_checkpoints,
        ppo_epochs=config.ppo_epochs,
        minibatches=config.minibatches,
        shuffle_seed=config.seed,
        dropout_seed=config.seed,
        deadline=deadline,
        logs=(SAMPLES, EVALUATIONS, EVAL_SAMPLES),
        folder=None if config.model is None else str(hf.resolve(config.model)),
        # Each checkpoint keeps the config it was trained with (--resume takes it from there)
        # and what the model was built from besides, which a resume that no longer fits names.
        metadata={"config": attrs.asdict(config), **_built_from(model, shape.max_len)},
    )
    # The trainer steps its own copy: the loaded params stay only as the KL term's reference.
    del variables
    if mesh is not None:  # Adam's moments as their params, its count replicated over the mesh
        placed = sharding.state_shardings(trainer.opt_state, trainer.variables, mesh)
        trainer.opt_state = sharding.shard(trainer.opt_state, placed)
    if resume:
        try:
            trainer.resume()
        except ValueError as error:
            raise _misfit(run, model, shape.max_len, error) from None
        if mesh is not None:  # an npz checkpoint's arrays come back whole: split them again
            trainer.variables = sharding.shard(
                trainer.variables, sharding.param_shardings(model, mesh)
            )
            placed = sharding.state_shardings(trainer.opt_state, trainer.variables, mesh)
            trainer.opt_state = sharding.shard(trainer.opt_state, placed)
    tasks, admit, slots, rollouts = _shares(config, processes)
    if config.engine == "vllm":
        # Stopped in the `finally` below; should an error come before it, at the interpreter's
        # exit.
        server = _vllm_engine(config, run, served, model, tokenizer, shape.max_len, trainer.updates)
    else:
        server = serving(model)(
            model,
            sharding.local_view(trainer.variables),  # a pool's mesh: this process's whole params
            slots=slots,
            max_len=shape.max_len,
            version=trainer.updates,
            tokenizer=tokenizer,
        )
    source = task.source(server, _sampling(config))
    samples = None
    logs = None
    if index == 0:  # one process writes the run's logs beside metrics.jsonl
        if config.samples:
            source = samples = SampleLog(
                source, tokenizer, batch_size=tasks, keep=config.samples, seed=config.seed
            )
        logs = RunLogs(config, run, trainer, samples, on_step)
        if config.eval_every:
            ids = np.arange(config.tasks, config.tasks + config.eval_tasks)
            logs.evaluation = Evaluation(
                task,
                ids,
                server,
                slots,
                samples=config.eval_samples,
                temperature=config.temperature,
                seed=config.seed,
            )
            if trainer.updates == 0:  # the base model's, which each later one is set beside
                # Its lines go with the state before any update: the logs cut back to that
                # state first (a run resumed without a checkpoint), measured with them after.
                trainer._cut_logs()
                logs.evaluate(0)
                trainer._measure_logs()
    trainer.on_step = on_step if logs is None else logs
    if logs is not None and logs.evaluation is not None:
        trainer.measure = logs.measure
    source = task.serve(source, server)
    publisher = server
    if mesh is not None and sharding.spans_processes(mesh):
        publisher = sharding.LocalWeights(server)
    recorder = None
    if record is not None:
        recorder = replay.Recorder(record)
        source = replay.RecordingSource(source, recorder)
        publisher = replay.RecordingPublisher(server, recorder)
    scheduler = RolloutScheduler(
        objective,
        source,
        publisher,
        width=shape.width,
        rows=shape.rows(rollouts),
        tasks=task.tasks,
        groups=config.groups,
        max_lag=config.max_lag,
        ahead=config.ahead,
        sync_every=config.sync_every,
        oversample=config.oversample,
        admit=admit,
        estimator=config.estimator,
        truncation="score",
        vocab=model.vocab,
        filter_uniform=config.filter_uniform,
        reference=(
            (
                lambda: synced_reference(
                    trainer.opt_state, trainer.variables, every=config.ref_sync_every
                )
            )
            if config.ref_sync_every
            else reference
        ),
        carry_over=config.carry_over,
        waste_budget=config.waste_budget,
        hedge=config.hedge,
        narrow=True,
    )
    per_epoch = config.tasks // config.batch_size * config.batch_size
    dataset = ProcessRows(
        task.dataset(
            config.tasks,
            config.batch_size,
            shuffle_seed=config.seed,
            epochs=-(-config.steps * config.batch_size // per_epoch),
        )
    )
    try:
        if recorder is None:
            try:
                trainer.run(
                    _split(scheduler, mesh),
                    scheduler.tasks(dataset),
                    steps=config.steps,
                    ahead=config.ahead,
                )
            finally:
                scheduler.close()
        else:
            with recorder.record(scheduler):  # closes the scheduler, then ends the trace
                trainer.run(
                    _split(recorder, mesh),
                    recorder.tasks(dataset),
                    steps=config.steps,
                    ahead=config.ahead,
                )
    except _Interrupted:
        trainer.save()  # the last completed step's, which no periodic checkpoint may hold
        trainer.export()
        raise
    finally:
        if logs is not None:
            logs.close()
        if config.engine == "vllm":
            server.close()
    trainer.export()
    if index == 0:
        write_curves(run / METRICS, run / "curves.png", evaluations=run / EVALUATIONS)
    return trainer


def _model(config: TrainConfig, max_len: int, tokenizer) -> tuple[models.Model, Any]:
    """The run's model and its first params: the `--model` checkpoint folder's, or dew's
    transformer of the config's shape, seeded, with `max_len` positions and the tokenizer's
    vocabulary; with `--lora`, a fresh adapter of either (seeded) beside them.

    Raises:
        ValueError: naming the folder when the task's sequences are longer than the checkpoint
            takes (or the checkpoint is malformed: see `dew.models.hf.load`).
    """
    if config.model is None:
        model_config = config.model_config(max_len, vocab=tokenizer.vocab_size)
        model = models.model(model_config, remat=config.remat)
        params = models.init(jax.random.key(config.seed), model_config)
    else:
        model, params = hf.load(config.model, dtype=config.dtype)
        if max_len > model.max_len:
            raise ValueError(
                f"--model {config.model}: the task's sequences reach {max_len} tokens, beyond "
                f"its max_position_embeddings {model.max_len}"
            )
        # Rows past the tokenizer's ids decode to no text: never sampled, never scored.
        model = attrs.evolve(model, vocab_limit=tokenizer.vocab_size, remat=config.remat)
    adapter = config.lora_config()
    if adapter is None:
        return model, params
    adapted = lora.LoRAModel(model, adapter)
    return adapted, adapted.variables(params, jax.random.key(config.seed))


def _built_from(model, max_len: int) -> dict[str, Any]:
    """What a run's model was built from, besides its config: the task's sequence length
    (dew's transformer has a position per token) and a `--model` folder's config.json."""
    built: dict[str, Any] = {"max_len": max_len}
    if isinstance(model, lora.LoRAModel):
        model = model.base
    if isinstance(model, hf.HFModel):
        built["model_config"] = model.config.to_json(model.dtype)
    return built


def _misfit(run: Path, model, max_len: int, error: ValueError) -> Misfit:
    """The one-line refusal of a resume whose checkpoint did not load into the model built
    now (`error`, naming the leaf): naming what changed since the checkpoint, where it says."""
    commit = run / "checkpoints" / COMMIT
    try:
        then = dict(json.loads(commit.read_text())["metadata"])
    except (OSError, ValueError, TypeError, KeyError):
        then = {}
    now = _built_from(model, max_len)
    if "model_config" in then and then["model_config"] != now.get("model_config"):
        was, is_ = then["model_config"], now.get("model_config") or {}
        keys = sorted(k for k in set(was) | set(is_) if was.get(k) != is_.get(k))
        shown = "; ".join(f"{k} {was.get(k)} then, {is_.get(k)} now" for k in keys[:3])
        changed = f"its --model folder's config.json changed ({shown})"
    elif "max_len" in then and then["max_len"] != max_len:
        changed = (
            f"the task's sequences reach {max_len} tokens now, {then['max_len']} when it was "
            "trained: the task changed"
        )
    else:
        changed = "what it was built from changed (its --model folder, or its task)"
    return Misfit(
        f"--resume: the checkpoint in {commit.parent} does not fit the model this run builds "
        f"now, {changed} since it was trained ({error}); resume it as it was, or start afresh "
        "with another --run"
    )


def _mesh(config: TrainConfig, model) -> Mesh | None:
    """The device mesh `--mesh` names, or None."""
    sizes = _mesh_sizes(config, jax.process_count())
    if sizes is None:
        return None
    data, fsdp, tensor = sizes
    return sharding.make_mesh(data=data, fsdp=fsdp, tensor=tensor)


def _split(rollout, mesh: Mesh | None):
    """The rollout whose packed rows go to the update split over the mesh's data axes."""
    return rollout if mesh is None else sharding.ShardedRollout(rollout, mesh)


class _FolderTrainer(Trainer):
    """A Trainer whose checkpoints of a `--model` run also hold the params as a checkpoint
    folder, `checkpoints/model` (config.json, model.safetensors and the tokenizer's files of the
    folder trained), which transformers and vLLM load as they are; the optimizer's and the
    trainer's state stay beside it in the checkpoint's own files, which resume reads.

    Params sharded over a mesh have their folder written at the run's end only (its last step,
    or where Ctrl-C stopped it), not with each periodic checkpoint: the folder is one file,
    written by one process from every tensor gathered to it, which is what a sharded
    checkpoint's orbax shards avoid; resume never reads it, and `dew export` writes it from any
    checkpoint of the run.

    Args:
        folder: the checkpoint folder trained, or None for dew's transformer (no folder kept).
    """

    def __init__(self, *args, folder: str | None, **options):
        super().__init__(*args, **options)
        self.folder = folder

    def save(self, directory: Path | None = None, **options) -> Path:
        # The best evaluation's folder goes with it, sharded or not (one process gathers it).
        if directory is not None or not is_sharded(self.variables):
            self._write_folder(directory)
        return super().save(directory, **options)

    def export(self) -> None:
        """Write `checkpoints/model` of sharded params, gathered one tensor at a time; every
        process of a pool calls it alike (the gathers are collectives), process 0 writes. The
        folder of unsharded params is written with each checkpoint instead."""
        if is_sharded(self.variables):
            self._write_folder()

    def _write_folder(self, directory: Path | None = None) -> None:
        """The folder beside the checkpoint in `directory` (`checkpoints` unless given)."""
        if self.folder is None or self.checkpoints is None:
            return
        directory = self.checkpoints if directory is None else directory
        model = self.objective.model
        if isinstance(model, lora.LoRAModel):
            if self._writes:
                lora.save_adapter(
                    directory / ADAPTER,
                    self.variables["adapter"],
                    model.lora,
                    base_model=self.folder,
                )
            return
        if self._writes or is_sharded(self.variables):
            hf.save(directory / "model", model, self.variables, tokenizer_from=self.folder)


def _optimizer(config: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Adam at the run's learning rate schedule, behind a clip of the gradient's global norm
    where `max_grad_norm` asks for one; and the schedule, for the record.

    The schedule is a linear warmup from 0 over `warmup_steps`, then `lr_decay` to 0 at
    `steps` x the optimizer updates a step (`ppo_epochs` x `minibatches`): optax counts its
    updates. A run of the defaults gets plain `optax.adam(learning_rate)`, whose state is
    that of every checkpoint written before these options: those resume as they were.
    """
    peak, warmup = config.learning_rate, config.warmup_steps
    decay_steps = max(1, config.optimizer_updates - warmup)
    if config.lr_decay == "linear":
        decay = optax.linear_schedule(peak, 0.0, decay_steps)
    elif config.lr_decay == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    schedule = decay
    if warmup:
        schedule = optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])
    plain = not warmup and config.lr_decay == "constant"
    optimizer = optax.adam(peak if plain else schedule)
    if config.max_grad_norm is not None:
        optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optimizer)
    return optimizer, schedule


def _levers(config: TrainConfig) -> dict[str, Any]:
    """The objective's settings a run's config holds (`GRPOObjective`'s keyword arguments)."""
    names = (
        "kl_coef",
        "aggregation",
        "importance_level",
        "correction",
        "importance_cap",
        "importance_floor",
        "proximal",
        "clip",
        "clip_high",
        "clip_dual",
        "ratio_level",
        "kl_estimator",
        "entropy_coef",
    )
    return {name: getattr(config, name) for name in names}
