"""Train a policy on rollouts: the Rollout protocol, the Trainer, its checkpoints, and `dew train`.

`Trainer` owns what a run must not lose: the model's variables, the optax optimizer state, the
count of optimizer updates and the data position (the stream index of the next batch to hand
over). Each step it reads the task stream `ahead` batches beyond the batch it hands over (so a
`RolloutScheduler` has them running early), asks its `Rollout` for that batch's packed rows,
applies one jitted `GRPOObjective` update, writes one flat JSON line of what the step did, and
every `checkpoint_every` updates writes a checkpoint. A resumed trainer reopens the stream at the
checkpoint's position: the scheduler then cancels whatever the old stream left in flight, and
the rollouts of the batches it re-reads are run again rather than trained twice or skipped.

A checkpoint is two files, neither of them a pickle: an `.npz` of the flattened leaves of the
variables and the optimizer state, and `checkpoint.json`, the commit record, which names the
arrays file and holds the tree paths, shapes, dtypes, `updates`, `position` and metadata. Each
is written to a temporary file in the same directory, fsynced and renamed over its target; the
arrays file has a fresh name each time and the commit record is renamed last, so a crash at any
point leaves the previous checkpoint whole.

`dew train` runs a built-in task (`dew.envs.tasks`) end to end on the CPU: a `RolloutServer`
samples, a `RolloutScheduler` keeps the rollouts in flight, and the trainer trains, writing a run
folder with `config.json`, `metrics.jsonl`, `checkpoints/` and `curves.png` (reward, loss, KL,
lag, wait and row fill per step); `dew train --run DIR --resume` continues it.

The package's modules: `_trainer` (the Rollout protocol, `Trainer`), `_step_lines` (a step's
metrics line: `record_fields`, `NothingTrained`), `_trainer_files` (what a Trainer keeps in its
run folder), `_update` (the jitted update), `_reference` (a KL reference that follows the
policy), `_checkpoint` (writing and reading checkpoints), `_export` (`dew export`), `_fit`
(`fit`: your own task in a few lines), `_progress` (what `dew train` prints), `_curves`
(`curves.png`, drawn with matplotlib), `_samples`, `_tensorboard` and `_wandb` (what a run logs
beside its metrics), `_timing` (`step_seconds`: a run's step timed at other row counts, for
`dew tune`), and `dew train` itself: `_config` (`TrainConfig`, its fields, checks and
preflight), `_tasks` (what each task trains on), `_folders` (path checks), `_memory` (the
start-up memory estimate), `_evaluation` (held-out evaluation), `_run` (`train`, one run end to
end, with its checks, logs and vLLM servers), `_interrupt` (Ctrl-C) and `_cli` (the command
line).
`ServedSource` lives in `dew.serve` and is re-exported here.
"""

from dew.serve import ServedSource
from dew.train._checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    COMMIT,
    Checkpoint,
    Variables,
    load_checkpoint,
    load_variables,
    read_kept,
    save_checkpoint,
)
from dew.train._cli import configure_cli, run_cli
from dew.train._config import TrainConfig
from dew.train._config_fields import TASKS
from dew.train._curves import curves_figure, write_curves
from dew.train._export import configure_export_cli, export, run_export_cli
from dew.train._fit import Sizes, fit, measure, task_list
from dew.train._progress import Progress
from dew.train._run import train
from dew.train._samples import SampleLog, sample_record
from dew.train._step_lines import NothingTrained, record_fields
from dew.train._tensorboard import TensorBoard
from dew.train._timing import step_seconds
from dew.train._trainer import METRICS, Rollout, Trainer

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "COMMIT",
    "METRICS",
    "NothingTrained",
    "TASKS",
    "Checkpoint",
    "Progress",
    "Rollout",
    "SampleLog",
    "ServedSource",
    "Sizes",
    "TensorBoard",
    "TrainConfig",
    "Trainer",
    "Variables",
    "configure_cli",
    "configure_export_cli",
    "curves_figure",
    "export",
    "fit",
    "load_checkpoint",
    "load_variables",
    "measure",
    "read_kept",
    "record_fields",
    "run_cli",
    "run_export_cli",
    "sample_record",
    "save_checkpoint",
    "step_seconds",
    "task_list",
    "train",
    "write_curves",
]
