"""What a training step's metrics line holds, and what a run's lines add up to: the scheduler's
record as flat fields, the errors of the call's failed rollouts, the loss metrics of a step of
several updates combined, the checks of a step (a non-finite update stops the run, a LoRA
adapter without gradient is warned of, what `measure` adds must not overwrite the line), and the
run's tally that raises `NothingTrained` when none of its steps had a token to train on.

Apart from `_trainer.py`, which runs the steps, because each is a pure function of a step's
record, metrics and rows (the tally is fed them step by step).
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew.data import Batch
from dew.models.hf.lora import LoRAModel
from dew.objectives.rl.scheduler import SchedulerRecord

logger = logging.getLogger("dew.train")


def json_number(value: Any) -> float | int | None:
    """A metric as JSON holds it: ints stay ints, non-finite floats become null."""
    if isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, int | np.integer):
        return int(value)
    number = float(value)
    return number if math.isfinite(number) else None


def record_fields(record: SchedulerRecord) -> dict[str, float | int | None]:
    """A SchedulerRecord as flat metrics: its fields, `resubmitted/<cause>`, and its metrics under
    their own names (`reward/mean`, `latency/p90`, ...); `updates` is left to the trainer."""
    fields: dict[str, Any] = {
        "version": record.version,
        "lag": record.lag,
        "groups": record.groups,
        "cancelled": record.cancelled,
        "abandoned": record.abandoned,
        "cut": record.cut,
        "waited": record.waited,
    }
    fields |= {f"resubmitted/{cause}": count for cause, count in record.resubmitted.items()}
    fields |= dict(record.metrics)
    return {name: json_number(value) for name, value in fields.items()}


# The most error texts a metrics line shows.
ERRORS_SHOWN = 3


def call_errors(events) -> dict[str, int]:
    """The error texts of a call's failed submissions, the most frequent first (at most
    ERRORS_SHOWN), with how often each came: a metrics line's `errors`, present only when a
    submission failed with one."""
    counts = collections.Counter(e.error for e in events if e.kind == "failed" and e.error)
    return dict(counts.most_common(ERRORS_SHOWN))


class NothingTrained(RuntimeError):
    """A run none of whose steps had a token to train on: every group of every step was
    abandoned, cut or failed (a verifier that raises, answers NaN or a bare float fails every
    rollout it scores). Raised at the run's end, once its state is saved where checkpoints are
    on; the message gives the steps, what became of their groups and the most frequent errors.
    """


class RunTally:
    """What one `Trainer.run` trained on, step by step, to say at its end that it trained on
    nothing: a short run ends before the scheduler's warning of a streak of empty steps."""

    def __init__(self):
        self.steps: list[int] = []  # the updates before each step
        self.trained = 0  # steps with at least one trained token
        self.abandoned = 0
        self.cut = 0
        self.uniform = 0  # groups discarded as uniform (filter_uniform)
        self.truncated: list[float] = []  # each step's share of rollouts that ended TRUNCATED
        self.errors: collections.Counter[str] = collections.Counter()

    def observe(self, updates: int, metrics: Mapping[str, Any], rollout: Any) -> None:
        """Take one step's loss metrics and its rollout's record and event log."""
        self.steps.append(updates)
        # `tokens` is the loss mask's weight over the pool's batch, alike on every process.
        if float(metrics.get("tokens", 1.0)) > 0:
            self.trained += 1
        record = getattr(rollout, "last_record", None)
        if isinstance(record, SchedulerRecord):
            self.abandoned += record.abandoned
            self.cut += record.cut
            if "status/truncated" in record.metrics:
                self.truncated.append(record.metrics["status/truncated"])
        events = getattr(rollout, "last_events", ())
        self.errors.update(e.error for e in events if e.kind == "failed" and e.error)
        self.uniform += sum(e.kind == "discarded" and e.reason == "uniform" for e in events)

    def check(self) -> None:
        """Raise if the run made steps and none trained on anything.

        Raises:
            NothingTrained: naming the steps, the groups abandoned and cut, and the errors.
        """
        if not self.steps or self.trained:
            return
        text = (
            f"the run trained on nothing: none of its {len(self.steps)} steps (updates "
            f"{self.steps[0]}..{self.steps[-1]}) had a token to train on; groups abandoned "
            f"after failed attempts: {self.abandoned}, cut: {self.cut}"
        )
        if self.uniform:
            text += (
                f"; {self.uniform} groups were discarded as uniform (filter_uniform): every "
                "rollout of each scored alike"
            )
        if self.truncated and max(self.truncated) > 0:
            share = sum(self.truncated) / len(self.truncated)
            text += (
                f"; {share:.0%} of the rollouts delivered ended TRUNCATED, and one cut before "
                "its first call has no token to train (nor, under truncation='mask', does any): "
                "a context or max_tokens too small for the task, or episodes past their turn "
                "limit"
            )
        if self.errors:
            shown = ", ".join(f"{error!r} x{n}" for error, n in self.errors.most_common(3))
            text += f"; rollouts failed with {shown}"
        raise NothingTrained(text)


def check_finite(metrics: Mapping[str, Any], step: int, update: tuple[int, int] = (1, 1)) -> None:
    """Stop at a step whose loss or gradient norm is not finite; `update` is the update of the
    step (1-based) that gave `metrics`, and the step's count of them.

    Raises:
        FloatingPointError: naming the step (and the update, of several) and the values.
    """
    bad = {
        name: float(metrics[name])
        for name in ("loss", "grad_norm")
        if name in metrics and not math.isfinite(float(metrics[name]))
    }
    if bad:
        values = ", ".join(f"{name} {value}" for name, value in bad.items())
        where, before = f"step {step}", "step"
        if update[1] > 1:
            where, before = f"step {step}, update {update[0]} of {update[1]}", "update"
        raise FloatingPointError(
            f"{where}: {values}; training stops, the weights left as the {before} before found "
            "them (look for NaN or infinite rewards, advantages or log-probs in the batch, or "
            "token ids outside the model's vocabulary, which score as non-finite log-probs)"
        )


def check_adapter_gradient(
    model: Any, metrics: Mapping[str, Any], packed: Batch, step: int
) -> None:
    """Say, in one warning, that a LoRA adapter received no gradient at a step whose rows had
    something to learn (a trained token with a nonzero advantage): such an adapter attaches to
    nothing the loss reaches, or its factors are both zero, and the run learns nothing."""
    if not isinstance(model, LoRAModel) or float(metrics.get("grad_norm", 1.0)) != 0:
        return
    signal = np.asarray(packed["advantages"]) * np.asarray(packed["loss_mask"])
    if np.any(signal != 0):
        logger.warning(
            "step %d: the LoRA adapter received no gradient (its gradient is all zeros, with "
            "%d trained tokens of nonzero advantage): it learns nothing",
            step,
            int(np.count_nonzero(signal)),
        )


def check_measured(measured: Any, line: Mapping[str, Any]) -> Mapping[str, Any]:
    """What a trainer's `measure` gave (`measured`), for the step's line.

    Raises:
        ValueError: naming what it gave when that is not a mapping of str keys, or a key
            the step's line has already (the trainer's own figure would be overwritten).
    """
    if not isinstance(measured, Mapping) or not all(isinstance(k, str) for k in measured):
        raise ValueError(
            f"measure must return a mapping of str keys to metrics, got {measured!r:.200}"
        )
    if taken := sorted(set(measured) & set(line)):
        raise ValueError(
            f"measure returned {taken}, keys the trainer's line has already: name its "
            "metrics apart (dew train's evaluation prefixes them with eval/)"
        )
    return measured


LAST = ("loss", "clip_fraction", "clip_fraction/low", "clip_fraction/high", "ratio/mean")
"""The loss metrics a step of several updates also gives as its last update's, `last/<name>`:
where the clip acts, the last update is the one furthest from the proximal policy."""


def combined_updates(updates: Sequence[Mapping[str, Any]], minibatches: int) -> dict[str, Any]:
    """One line's loss metrics for a step of several updates (`ppo_epochs` x `minibatches`).

    Each metric is its mean over the updates, with three exceptions: `tokens` is the batch's,
    the sum over one pass's minibatches (every pass trains each row once); `importance/max`
    is the greatest; and the metrics of `LAST` are also given as the last update's,
    `last/<name>`. A mean is plain, each update weighing one whatever its minibatch's tokens.
    """
    combined: dict[str, Any] = {}
    for name in updates[0]:
        values = [float(update[name]) for update in updates]
        if name == "tokens":
            combined[name] = sum(values[:minibatches])
        elif name == "importance/max":
            combined[name] = max(values)
        else:
            combined[name] = sum(values) / len(values)
    combined |= {f"last/{name}": updates[-1][name] for name in LAST if name in updates[-1]}
    return combined
