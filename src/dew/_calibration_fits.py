"""The fits `dew.calibrate` makes from a recorded run: the duration distribution of a censored
sample (Kaplan-Meier weights, a lognormal by maximum likelihood, weighted quantiles) and how much
the trainer's and the engine's work slow each other (`contention_factor` over `Busy` spans).

Apart from `calibrate.py` and `_calibration_traces.py`, which read traces into these fits'
inputs, because each is plain statistics over arrays, testable without a trace. Public through
`dew.calibrate`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import numpy as np

# The largest share of an overlapped second `contention_factor` puts down to the other side's
# work (a factor of 9): beyond it the fit says one side stops while the other runs, which no
# sharing of cores does.
MAX_OVERLAP_SHARE = 0.9


def kaplan_meier_weights(durations: np.ndarray, censored: np.ndarray) -> tuple[np.ndarray, float]:
    """Each finished rollout's resampling weight, and the mass beyond the longest one.

    Returns:
        float64[finished] weights summing to 1 (the tail mass included, on the longest), and
        that tail mass.
    """
    import scipy.stats  # here, not at the top: it takes a second to import

    if not len(censored):
        return np.full(len(durations), 1 / len(durations)), 0.0
    data = scipy.stats.CensoredData(uncensored=durations, right=censored)
    survival = scipy.stats.ecdf(data).sf
    times, left = survival.quantiles, survival.probabilities
    mass = np.concatenate([[1.0], left[:-1]]) - left
    at = np.searchsorted(times, durations)
    ties = collections.Counter(at.tolist())
    weights = mass[at] / np.array([ties[i] for i in at.tolist()])
    beyond = float(max(0.0, 1.0 - weights.sum()))
    weights[np.argmax(durations)] += beyond
    return weights, beyond


def fit_lognormal(durations: np.ndarray, censored: np.ndarray) -> tuple[float, float]:
    """(mu, sigma) of the log duration by maximum likelihood over the censored sample (of
    rollouts that ran to their end: an infrastructure failure stops partway)."""
    import scipy.stats  # here, not at the top: it takes a second to import

    positive = durations[durations > 0]
    if len(positive) < 2 or np.ptp(np.log(positive)) == 0:
        mu = float(np.log(positive).mean()) if len(positive) else 0.0
        return mu, 0.0
    data = scipy.stats.CensoredData(uncensored=positive, right=censored[censored > 0])
    sigma, _, scale = scipy.stats.lognorm.fit(data, floc=0)
    return float(math.log(scale)), float(sigma)


class Busy:
    """When one side was busy: the union of its spans, asking how much of a window it covers.

    Args:
        spans: (start, end) pairs, in any order; they may overlap and may be empty.
    """

    def __init__(self, spans: Sequence[tuple[float, float]]):
        starts, ends = [], []
        for start, end in sorted(spans):
            if end <= start:
                continue
            if ends and start <= ends[-1]:
                ends[-1] = max(ends[-1], end)
            else:
                starts.append(start)
                ends.append(end)
        self.starts = np.array(starts, np.float64)
        self.ends = np.array(ends, np.float64)
        self._before = np.concatenate([[0.0], np.cumsum(self.ends - self.starts)])

    def _until(self, times: np.ndarray) -> np.ndarray:
        """The busy seconds before each time."""
        at = np.searchsorted(self.starts, times, side="right") - 1
        inside = np.clip(times - self.starts[np.maximum(at, 0)], 0, None)
        inside = np.minimum(inside, (self.ends - self.starts)[np.maximum(at, 0)])
        return np.where(at >= 0, self._before[np.maximum(at, 0)] + inside, 0.0)

    def covered(self, starts, ends) -> np.ndarray:
        """float64[n]: the busy seconds within each window [starts[i], ends[i]]."""
        starts, ends = np.asarray(starts, np.float64), np.asarray(ends, np.float64)
        if not len(self.starts):
            return np.zeros(np.broadcast(starts, ends).shape)
        return np.maximum(self._until(ends) - self._until(starts), 0.0)


def contention_factor(seconds, overlaps, instruments, units=None) -> float:
    """How much one side slows while the other is busy, fitted to its recorded times.

    The rate model (`dew.simulate.Contention`): a side works at 1 / (1 + factor) of its solo
    speed while the other side is busy, so a span of `seconds` that overlapped the other side
    for `overlap` of them did seconds - share * overlap of solo work, share = factor /
    (1 + factor). Per unit of work (a rollout's calls; a step is one), seconds = solo + share *
    overlap; the share is the slope of seconds on overlap.

    Plain least squares would find a slope where there is none: a span that runs long for any
    reason (a long rollout, a slow moment of the machine) overlaps more of whatever the other
    side did meanwhile. So the slope is an instrumental-variable estimate: each span's
    instrument is the other side's busy share over a fixed stretch from the span's start, which
    says how much it was bound to overlap from when it started, not from how long it ran;
    share = cov(instrument, seconds) / cov(instrument, overlap), clipped to
    [0, MAX_OVERLAP_SHARE]. Where the instruments do not vary (the other side was always busy,
    or never) or do not predict the overlap, the spans say nothing about it and the factor is 0.

    Args:
        seconds: each span's recorded seconds.
        overlaps: the seconds of each span during which the other side was busy.
        instruments: each span's instrument, the other side's busy share from its start.
        units: each span's units of work (None: one each); seconds and overlaps are per unit.

    Returns:
        The factor, share / (1 - share): 0 for no slowdown, 1 for twice as slow while overlapped.

    Raises:
        ValueError: for arguments of different lengths or a unit count <= 0.
    """
    seconds, overlaps, z = (np.asarray(a, np.float64) for a in (seconds, overlaps, instruments))
    units = np.ones_like(seconds) if units is None else np.asarray(units, np.float64)
    if not seconds.shape == overlaps.shape == z.shape == units.shape:
        raise ValueError(
            f"seconds, overlaps, instruments and units must have one length, got "
            f"{len(seconds)}, {len(overlaps)}, {len(z)} and {len(units)}"
        )
    if np.any(units <= 0):
        raise ValueError("units must be > 0")
    if len(seconds) < 3 or np.ptp(z) < 1e-9:
        return 0.0
    y, x = seconds / units, overlaps / units
    zc = z - z.mean()
    reach = float(zc @ (x - x.mean()))
    if reach <= 1e-12 * max(float(np.abs(x).sum()), 1.0):
        return 0.0
    share = float(np.clip(zc @ (y - y.mean()) / reach, 0.0, MAX_OVERLAP_SHARE))
    return share / (1.0 - share)


def weighted_quantiles(values: np.ndarray, weights: np.ndarray, probabilities) -> np.ndarray:
    """The smallest value whose weighted cumulative share reaches each probability."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order]) / weights.sum()
    at = np.searchsorted(cumulative, np.asarray(probabilities) - 1e-12)
    return values[order][np.minimum(at, len(values) - 1)]
