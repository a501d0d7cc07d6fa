"""The logs a `dew train` run writes beside `metrics.jsonl`, step by step (`RunLogs`): decoded
samples, TensorBoard, Weights & Biases, and the evaluations on held-out tasks."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from dew.train._config import TrainConfig
from dew.train._evaluation import (
    EVAL_SAMPLES,
    EVAL_SAMPLES_MD,
    EVALUATIONS,
    Evaluation,
    write_eval_samples,
)
from dew.train._folders import BEST, _best_greedy
from dew.train._samples import SampleLog
from dew.train._tensorboard import TensorBoard
from dew.train._trainer import Trainer
from dew.train._wandb import WandbLog

SAMPLES = "samples.jsonl"


class RunLogs:
    """A run's per-step logs beside `metrics.jsonl` (an `on_step` callback): the decoded samples,
    TensorBoard, Weights & Biases, then the caller's own callback; and the evaluations on
    held-out tasks (the trainer's `measure`), whose `eval/...` keys join the line of the step
    they were measured after, in `metrics.jsonl` and every sink alike."""

    def __init__(
        self,
        config: TrainConfig,
        run: Path,
        trainer: Trainer,
        samples: SampleLog | None,
        on_step: Callable[[Mapping[str, Any]], None] | None,
    ):
        self.config = config
        self.run = run
        self.trainer = trainer
        self.samples = samples
        # The sample log numbers a rollout's batch by its group id (its scheduler's groups a
        # batch apart); a resumed scheduler numbers its groups on from its checkpoint's next id
        # (`checkpoint_state`), its first batch's.
        restored = trainer._rollout_state if isinstance(trainer._rollout_state, dict) else {}
        first_group = restored.get("next_group", 0)
        self.first_batch = trainer.position - (first_group // samples.batch_size if samples else 0)
        self.on_step = on_step
        self.evaluation: Evaluation | None = None
        # The greedy held-out reward `checkpoints/best` holds (a resumed run's too), to beat.
        self.best = _best_greedy(run / BEST) if config.keep_best else None
        self.tensorboard = TensorBoard(run / "tensorboard") if config.tensorboard else None
        self.wandb = None
        if config.wandb is not None:
            self.wandb = WandbLog(
                config.wandb,
                run,
                attrs.asdict(config),
                name=run.resolve().name,
                mode=config.wandb_mode,
            )

    def __call__(self, line: Mapping[str, Any]) -> None:
        if self.samples is not None:
            batch = line["position"] - self.first_batch
            records = [{"step": line["step"], **record} for record in self.samples.take(batch)]
            _append_lines(self.run / SAMPLES, records)
        if self.tensorboard is not None:
            self.tensorboard(line)
        if self.wandb is not None:
            self.wandb(line)
        if self.on_step is not None:
            self.on_step(line)

    def measure(self, updates: int) -> dict[str, Any]:
        """The `eval/...` keys of an evaluation after `updates` updates, every `eval_every`;
        none between."""
        if updates % self.config.eval_every:
            return {}
        return self.evaluate(updates)

    def evaluate(self, updates: int) -> dict[str, Any]:
        """Evaluate the trainer's weights on the held-out tasks: its line to `eval.jsonl`, its
        replies to `eval_samples.jsonl` and `.md`; its numbers as `eval/...` keys. The one
        before the first update (0) goes to TensorBoard and is printed, as no step's line
        carries it."""
        result, shown = self.evaluation(self.trainer.variables, updates)
        if self.config.keep_best and (self.best is None or result["greedy"] > self.best):
            scores = {key: value for key, value in result.items() if key != "rewards"}
            self.trainer.save(self.run / BEST, metadata={"eval": scores})
            self.best = result["greedy"]
        _append_lines(self.run / EVALUATIONS, [result])
        _append_lines(self.run / EVAL_SAMPLES, shown)
        write_eval_samples(self.run / EVAL_SAMPLES, self.run / EVAL_SAMPLES_MD)
        scores = {f"eval/{key}": value for key, value in result.items() if key != "rewards"}
        if updates == 0:
            if self.tensorboard is not None:
                self.tensorboard({"updates": 0, **scores})
            if self.wandb is not None:
                self.wandb({"updates": 0, **scores})
            shown_scores = ", ".join(
                f"{key.removeprefix('eval/')} {value:.3f}"
                for key, value in scores.items()
                if key.startswith(("eval/greedy", "eval/mean@", "eval/pass@"))
            )
            print(f"held-out before training: {shown_scores}", flush=True)
        return scores

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()


def _append_lines(path: Path, records: Sequence[Mapping[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as log:
        for record in records:
            log.write(json.dumps(record, allow_nan=False) + "\n")
