"""The figures of one step's sessions and their packed batch, for the scheduler's record.

Statuses, masked shares, rewards and their components, completion lengths, latency quantiles,
trained tokens and their lag, and the rows' fill: `session_metrics`, public through
`dew.objectives.rl.sessions`. Apart from `_packing`, which lays the rows these figures read.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from dew.objectives.rl._chains import merge_ratio
from dew.objectives.rl._packing import Packed
from dew.objectives.rl._rewards import _training_statuses
from dew.objectives.rl._session import TRUNCATION_REASONS, Session, Status


def session_metrics(
    sessions: Sequence[Session], packed: Packed, *, version: int | None = None
) -> dict[str, float]:
    """Figures of one step's sessions and their packed batch, for the scheduler's record.

    A figure is present exactly when it is defined, and then it is a finite float: a share,
    mean or quantile over nothing (no sessions, no calls, no rewards, no trained tokens) is left
    out, as a reward component no session reported is, never 0.0, None or NaN. A step that
    admitted nothing has only `tokens/trained` and `fill` (0.0 each); a reader of a log that
    wants a number for every step writes `metrics.get(key, math.nan)`.

    Args:
        sessions: the step's rollouts.
        packed: their packed batch; its truncation policy decides which sessions are masked.
        version: the trainer's version at consumption, to measure each trained token's lag.

    Returns:
        `merge_ratio`; `status/<status>` shares; `masked/share` (sessions with no loss weight)
        and `masked/<truncation reason>` shares; `reward/mean` and `reward/std` (over
        sessions with a reward) and `reward/<component>` means (a component named `mean` or
        `std` is shadowed by the overall figure); `length/mean` and `length/max`, the
        completion tokens (every call's, summed) of the sessions that train; `latency/p50`,
        `/p90`, `/p99`, `/max` of finished - submitted (where both are stamped);
        `tokens/trained`; `lag/token_mean` and `lag/token_max` (with `version`);
        `fill`.
    """
    metrics: dict[str, float] = {}
    total = len(sessions)
    if sum(len(s.calls) for s in sessions):
        metrics["merge_ratio"] = merge_ratio(sessions)
    if total:
        # Counted in one pass each: a small step's metrics are a fixed cost of every call.
        statuses = Counter(s.status for s in sessions)
        for status in Status:
            metrics[f"status/{status.value}"] = statuses[status] / total
        trains = _training_statuses(packed.truncation)
        masked = [s for s in sessions if s.status not in trains]
        metrics["masked/share"] = len(masked) / total
        reasons = Counter(s.truncation for s in masked)
        for reason in TRUNCATION_REASONS:
            metrics[f"masked/{reason}"] = reasons[reason] / total
    for name in sorted({name for s in sessions for name in s.components}):
        metrics[f"reward/{name}"] = float(
            np.mean([float(s.components[name]) for s in sessions if name in s.components])
        )
    rewards = [float(s.reward) for s in sessions if s.reward is not None]
    if rewards:
        metrics["reward/mean"] = float(np.mean(rewards))
        metrics["reward/std"] = float(np.std(rewards))
    if total:
        # What the policy wrote in the rollouts that train: a run whose replies grow to the
        # token limit, or collapse to nothing, shows it here first.
        lengths = [sum(len(c.completion) for c in s.calls) for s in sessions if s.status in trains]
        if lengths:
            metrics["length/mean"] = float(np.mean(lengths))
            metrics["length/max"] = float(max(lengths))
    latencies = [
        s.finished - s.submitted
        for s in sessions
        if s.finished is not None and s.submitted is not None
    ]
    if latencies:
        ordered = sorted(latencies)
        p50, p90, p99 = (_percentile(ordered, q) for q in (50, 90, 99))
        metrics |= {"latency/p50": p50, "latency/p90": p90, "latency/p99": p99}
        metrics["latency/max"] = float(ordered[-1])
    trained = packed.batch["loss_mask"] > 0
    metrics["tokens/trained"] = float(trained.sum())
    if version is not None and trained.any():
        lags = version - packed.batch["versions"][trained].astype(np.int64)
        metrics["lag/token_mean"] = float(lags.mean())
        metrics["lag/token_max"] = float(lags.max())
    metrics["fill"] = float(packed.fill)
    return metrics


def _percentile(ordered: Sequence[float], q: float) -> float:
    """The q-th percentile of ascending values, as `np.percentile`'s default (linear) method
    gives it, bit for bit.

    In plain Python: numpy's own call costs more than a small step's other metrics together.
    Numpy places the percentile at index (n - 1) * q / 100 between its neighbours a and b, at
    fraction t, as a + (b - a) t below t = 0.5 and b - (b - a)(1 - t) from there.

    Args:
        ordered: finite values, ascending, at least one.
        q: the percentile, in [0, 100].

    Returns:
        The percentile, a float.
    """
    index = (len(ordered) - 1) * (q / 100)
    below = math.floor(index)
    above = min(below + 1, len(ordered) - 1)
    fraction = index - below
    low, high = float(ordered[below]), float(ordered[above])
    gap = high - low
    return high - gap * (1 - fraction) if fraction >= 0.5 else low + gap * fraction
