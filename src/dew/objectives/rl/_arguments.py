"""The scheduler's arguments, checked before anything runs: each refusal names the argument,
the bound it broke and the value, or the collaborator and what it lacks."""

from __future__ import annotations

import inspect

import numpy as np

from dew._checks import check_int, check_number
from dew.objectives.rl.sessions import ESTIMATORS, TRUNCATION

# Sizes beyond these cannot work on any machine, and would fail late (a MemoryError after minutes,
# or a hang) rather than at construction.
MAX_WIDTH = 2**20
"""The longest row the scheduler packs, in tokens."""
MAX_CELLS = 2**27
"""The most cells of a packed batch per process: its int32 and float32 arrays take about 32
bytes a cell, so 4 GiB."""
MAX_SAMPLES = 2**16
"""The most rollouts per group (groups + oversample)."""
MAX_IN_FLIGHT = 2**20
"""The most rollouts submitted for one task batch."""


def check_arguments(
    objective,
    source,
    weights,
    tasks,
    log,
    *,
    width: int,
    rows: int,
    groups: int,
    oversample: int,
    admit: int | str | None,
    max_lag: int,
    ahead: int,
    sync_every: int,
    max_attempts: int,
    timeout: float | None,
    estimator: str,
    truncation: str,
    support_capacity: int | None,
    vocab: int | None,
    empty_streak: int | None,
) -> None:
    """Refuse what `RolloutScheduler` cannot run with, as its docstring says.

    Raises:
        TypeError: naming a collaborator that lacks what it needs.
        ValueError: naming the argument and the bound it broke.
    """
    check_collaborators(objective, source, weights, tasks, log)
    for name, value, bound in [
        ("width", width, 1),
        ("rows", rows, 1),
        ("groups", groups, 1),
        ("oversample", oversample, 0),
        ("ahead", ahead, 0),
        ("sync_every", sync_every, 1),
        ("max_attempts", max_attempts, 1),
        ("max_lag", max_lag, 0),
    ]:
        check_int(name, value, low=bound)
    if admit is not None and admit != "auto":
        if isinstance(admit, str):
            raise ValueError(f"admit must be an int >= 1, 'auto' or None, got {admit!r}")
        check_int("admit", admit, low=1)
    for name, value in [
        ("support_capacity", support_capacity),
        ("vocab", vocab),
        ("empty_streak", empty_streak),
    ]:
        if value is not None:
            check_int(name, value, low=1)
    check_sizes(
        width=width,
        rows=rows,
        groups=groups,
        oversample=oversample,
        support_capacity=support_capacity,
    )
    if max_lag < ahead + sync_every - 1:
        raise ValueError(
            f"max_lag must be >= ahead + sync_every - 1 = {ahead + sync_every - 1} "
            f"(a first submission can be that stale at consumption), got {max_lag}"
        )
    if timeout is not None:
        check_number("timeout", timeout, low=0, low_open=True)
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")


def check_collaborators(objective, source, weights, tasks, log) -> None:
    """Refuse a collaborator that cannot do its part, before the first call finds out.

    Raises:
        TypeError: naming the argument and what it needs.
    """

    def refuse(name: str, needs: str, value) -> TypeError:
        return TypeError(f"{name} must {needs}, got {type(value).__name__}")

    if not callable(getattr(objective, "packed_log_probs", None)):
        raise refuse("objective", "have packed_log_probs (a GRPOObjective)", objective)
    if not inspect.iscoroutinefunction(getattr(source, "run", None)):
        raise refuse("source", "have an async run(task, label) method (a SessionSource)", source)
    if not callable(getattr(weights, "load", None)):
        raise refuse("weights", "have a load(variables, version) method (a Publisher)", weights)
    if hasattr(weights, "load_async") and not inspect.iscoroutinefunction(weights.load_async):
        raise refuse("weights", "have load_async as an async method, if any", weights)
    if not callable(tasks):
        raise refuse("tasks", "be callable as tasks(batch) -> Sequence[Task]", tasks)
    if log is not None and not callable(log):
        raise refuse("log", "be None or callable as log(record)", log)


def check_sizes(
    *, width: int, rows: int, groups: int, oversample: int, support_capacity: int | None
) -> None:
    """Refuse sizes no run can hold (see MAX_WIDTH and its neighbours).

    Raises:
        ValueError: naming the argument, the bound and the value.
    """
    if width > MAX_WIDTH:
        raise ValueError(f"width must be <= {MAX_WIDTH} tokens, got {width}")
    if rows * width > MAX_CELLS:
        raise ValueError(
            f"rows * width must be <= {MAX_CELLS} cells (the packed batch), got {rows} * {width}"
        )
    if groups > rows * width:
        raise ValueError(
            f"groups must be <= rows * width = {rows * width}: each rollout of a group takes at "
            f"least one cell of the batch, so a larger group could never be packed; got {groups}"
        )
    if groups + oversample > MAX_SAMPLES:
        raise ValueError(
            f"oversample must keep groups + oversample <= {MAX_SAMPLES} rollouts per group, "
            f"got {groups} + {oversample}"
        )
    if support_capacity is not None and rows * support_capacity > MAX_CELLS:
        raise ValueError(
            f"support_capacity must keep rows * support_capacity <= {MAX_CELLS}, "
            f"got {rows} * {support_capacity}"
        )


def check_pool(pool) -> None:
    """Refuse, as `scheduler.pool`, what is not a `dew.parallel.Pool`.

    Raises:
        TypeError: naming what the value lacks.
    """
    lacking = [
        name
        for name in ("agree", "rescore", "is_first_reader")
        if not callable(getattr(pool, name, None))
    ]
    if not isinstance(getattr(pool, "share_size", None), int):
        lacking.append("share_size")
    if lacking:
        raise TypeError(
            f"scheduler.pool must be a dew.parallel.Pool (LocalPool, DistributedPool); "
            f"{type(pool).__name__} lacks {', '.join(lacking)}"
        )


def check_long_wait(long_wait) -> None:
    """Refuse, as `scheduler.long_wait`, what is neither None nor seconds > 0.

    Raises:
        ValueError: naming the setting and the value.
    """
    if long_wait is not None:
        check_number("long_wait", long_wait, low=0, low_open=True)


def model_vocab(objective) -> int | None:
    """The vocabulary of the objective's model where it declares one (`dew.models.Model`'s
    `vocab`, as `GRPOObjective(model)` holds it); None for an objective without one."""
    vocab = getattr(getattr(objective, "model", None), "vocab", None)
    if isinstance(vocab, bool) or not isinstance(vocab, int | np.integer) or vocab < 1:
        return None
    return int(vocab)


def resolve_vocab(objective, vocab: int | None) -> int | None:
    """The vocabulary the scheduler checks sessions' token ids against: `vocab` where given,
    else the objective's model's, so that an id the model has no logit for is refused by name
    rather than rescored into a non-finite log-prob.

    Raises:
        ValueError: for a `vocab` larger than the model's.
    """
    declared = model_vocab(objective)
    if vocab is None or declared is None:
        return declared if vocab is None else vocab
    if vocab > declared:
        raise ValueError(
            f"vocab must be <= {declared}, the objective's model's vocabulary (an id at or "
            f"above it has no logit to score), got {vocab}"
        )
    return vocab


def check_filtering(objective, *, groups: int, filter_uniform, reference) -> None:
    """Refuse uniform-group filtering that would discard every group, and a reference policy
    without the KL term that reads it (or the term without it).

    Raises:
        ValueError: naming the argument.
    """
    if not isinstance(filter_uniform, bool):
        raise ValueError(f"filter_uniform must be a bool, got {filter_uniform!r}")
    if filter_uniform and groups < 2:
        raise ValueError(
            "filter_uniform discards every group of groups=1: a lone rollout's reward is "
            "always uniform (it has no baseline); use groups >= 2"
        )
    kl_coef = getattr(objective, "kl_coef", 0.0)
    if kl_coef > 0 and reference is None:
        raise ValueError(
            f"reference is required: the objective's kl_coef is {kl_coef}, and its KL term "
            "reads reference_logprobs, rescored under the frozen reference policy's variables"
        )
    if kl_coef == 0 and reference is not None:
        raise ValueError(
            "reference is rescored for the objective's KL term, but its kl_coef is 0: set "
            "GRPOObjective(kl_coef=...) or leave reference out"
        )


def check_carry_over(carry_over, admit: int | str | None) -> None:
    """Refuse carry_over that is not a bool, or without the `admit` whose cut it carries.

    Raises:
        ValueError: naming the argument.
    """
    if not isinstance(carry_over, bool):
        raise ValueError(f"carry_over must be a bool, got {carry_over!r}")
    if carry_over and admit is None:
        raise ValueError(
            "carry_over needs admit: the groups it carries to a later call are those admit "
            "leaves out of their batch"
        )


def check_hedge(hedge) -> None:
    """Refuse a hedge that is not a bool.

    Raises:
        ValueError: naming the argument.
    """
    if not isinstance(hedge, bool):
        raise ValueError(f"hedge must be a bool, got {hedge!r}")


def check_align_starts(align_starts) -> int | None:
    """align_starts as a Python int, or None; anything else refused.

    Raises:
        ValueError: `align_starts must be an int >= 1, got ...` (the engines' decode slots).
    """
    return None if align_starts is None else check_int("align_starts", align_starts, low=1)


def check_waste_budget(waste_budget) -> None:
    """Refuse a waste budget that is not a share in [0, 1).

    Raises:
        ValueError: naming the argument.
    """
    if (
        isinstance(waste_budget, bool)
        or not isinstance(waste_budget, int | float)
        or not 0 <= waste_budget < 1
    ):
        raise ValueError(
            f"waste_budget must be a share of slot-seconds in [0, 1), got {waste_budget!r}"
        )
