"""Calibrate the long-tail simulation from recorded runs, and measure a recorded run alike.

`calibrate(traces)` reads what a `dew.replay` trace holds about the workload a scheduler faced:

- every rollout's duration, from its submission to its end on the scheduler's clock (slot
  queueing included, so a trace from an engine that queued calls overstates its model time),
  its calls and how it ended. A rollout the scheduler cancelled (surplus, stale, a reopened
  stream, the close) never finished: its duration is only a lower bound, a right-censored
  sample, and dropping it would favour short rollouts exactly as oversample and admit do. The
  duration distribution is therefore the Kaplan-Meier estimate over finished and cancelled
  rollouts (`scipy.stats.ecdf`), and each finished rollout is resampled with the probability
  mass that estimate puts on its duration; mass beyond the longest finished rollout (when a
  cancelled one ran longer) goes to the longest finished one and is reported as `beyond`.
  A lognormal is fitted to the same censored sample by maximum likelihood, for reference.
- each recorded group is a pool of its own, which the simulation's group of the same number
  resamples (`SimulatedConfig.observed`): rollouts vary from batch to batch, with the tasks and
  with a policy that learns to take more turns, and one task's rollouts resemble each other;
  pooled, every simulated batch would meet the run's average mix and the trainer's waits on a
  batch's slowest rollout would come out wrong. Groups are numbered `tasks` a batch in a row
  while the trainer keeps one stream, which is how a pool finds its batch. Given several
  traces, pool n holds each one's n-th group and a simulated task draws its group whole from
  one of them (picked per task), so that the simulation meets every trace, each in step with
  its training, and several runs of one setting average out how fast each run's engine ran.
- a trace holds each rollout's duration, not each call's: a rollout's seconds are split over
  its calls in proportion to their completion tokens, the decode time's main term.
- the engine's slot count: the most rollouts in flight at once. It is the slot count of an
  engine that never queued a call (as `dew train`'s, with one slot per rollout that can be in
  flight); one with fewer slots queued the rest, and their durations include the queueing.
- the trainer's step times: from each call's return (the batch's delivery) to the next call's
  hand-over, which covers packing, rescoring, the update and the trainer's own overhead; the
  simulation replays them in their order.

- how the trainer's and the engine's CPU work slow each other (`Contention`): on one machine
  a step that runs while rollouts decode takes longer than one that runs alone, and a rollout
  that decodes while the trainer steps takes longer too. Each step's overlap is the seconds of
  it during which some rollout was in flight, each rollout's the seconds of it during which the
  trainer stepped; `contention_factor` fits a side's slowdown to them (see there), pooled over
  every trace, and `Calibration.workload(contention=True)` hands the simulation each step's and
  each rollout's solo seconds (its recorded seconds less what the overlap added) with the
  factors, so that the simulation slows each side again by the overlap each setting has.

The first `warmup` trainer calls are left out of the rollouts and step times (a real run's
first steps compile), and `observe` measures a recorded run over the same window as a
simulation with `Workload.warmup` does, with the same definitions, so a prediction and a
measurement compare like with like.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from dew._calibration_fits import MAX_OVERLAP_SHARE as MAX_OVERLAP_SHARE
from dew._calibration_fits import Busy as Busy
from dew._calibration_fits import (
    contention_factor,
    fit_lognormal,
    kaplan_meier_weights,
    weighted_quantiles,
)
from dew._calibration_traces import (
    CalibrationError,
    admitted_groups,
    alternating,
    delivered,
    most_in_flight,
    shared_cpu,
    split_over_calls,
    tasks_per_batch,
    window_start,
    windowed,
)
from dew.envs.simulated import ObservedRollout
from dew.objectives.rl.sessions import Status
from dew.replay import Trace, read_trace
from dew.simulate import WASTED, Contention, Workload

__all__ = [
    "CalibrationError",
    "Calibration",
    "RunFigures",
    "calibrate",
    "fit_table",
    "report",
    "observe",
]

INFRA = Status.INFRA_ERROR
# Quantiles the goodness-of-fit table compares, observed (Kaplan-Meier) against fitted.
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)


@attrs.frozen
class Calibration:
    """The workload recorded runs faced, fitted for the simulation.

    Args:
        traces: the trace files it was fitted from.
        warmup: trainer calls of each trace left out.
        observed: the finished rollouts, weighted by the Kaplan-Meier mass of their durations.
        durations: each finished rollout's duration, seconds.
        censored: each cancelled rollout's duration so far, seconds (lower bounds).
        beyond: Kaplan-Meier mass beyond the longest finished rollout, given to it.
        lognormal: (mu, sigma) of the log duration, fitted to the censored sample of the
            rollouts that did not fail partway (INFRA_ERROR).
        calls: per call count, how many finished rollouts made that many calls.
        statuses: per status name, the share of finished rollouts that ended so.
        truncations: per truncation reason, its share of the TRUNCATED rollouts.
        unscored: share of TRUNCATED rollouts without a reward.
        raised: rollouts whose source raised or returned what no trace holds.
        slots: the most rollouts in flight at once over every trace.
        step_times: the trainer's seconds between a batch's delivery and its next hand-over;
            of several traces, step i is one trace's step i, the traces in turn.
        tasks: tasks per batch (one group each).
        groups: rollouts per group that train together.
        aheads: each trace's `ahead`.
        step_overlaps: per step time, the seconds of that step during which some rollout was
            in flight (the engine busy).
        overlaps: per observed rollout, the seconds of it during which the trainer stepped.
        contention: the slowdowns fitted to those overlaps (`contention_factor`).
        admitted: each trace's groups a step trains: its `admit` where that is an int without
            carry-over, else every task's (the rows a trainer sized as `dew train`'s has).
    """

    traces: tuple[str, ...]
    warmup: int
    observed: tuple[ObservedRollout, ...]
    durations: tuple[float, ...]
    censored: tuple[float, ...]
    beyond: float
    lognormal: tuple[float, float]
    calls: Mapping[int, int]
    statuses: Mapping[str, float]
    truncations: Mapping[str, float]
    unscored: float
    raised: int
    slots: int
    step_times: tuple[float, ...]
    tasks: int
    groups: int
    aheads: tuple[int, ...]
    step_overlaps: tuple[float, ...] = ()
    overlaps: tuple[float, ...] = ()
    contention: Contention = Contention()
    admitted: tuple[int, ...] = ()

    @property
    def step_time(self) -> float:
        """The trainer's mean step time, the one the simulation spends on each step."""
        return float(np.mean(self.step_times))

    @property
    def durations_observed(self) -> tuple[float, ...]:
        """Each observed rollout's duration, in `observed`'s order (as `overlaps` is)."""
        return tuple(rollout.duration for rollout in self.observed)

    @property
    def mean_duration(self) -> float:
        """The mean rollout duration under the Kaplan-Meier weights."""
        weights = np.array([rollout.weight for rollout in self.observed])
        durations = np.array([rollout.duration for rollout in self.observed])
        return float(weights @ durations / weights.sum())

    def slowed(self, factor: float) -> Calibration:
        """The same workload on a machine `factor` times slower: every duration and step time
        multiplied by it (to carry a fit to a run on a machine under another load).

        Raises:
            ValueError: unless factor is a finite number > 0.
        """
        return self.scaled(engine=factor, trainer=factor)

    def scaled(self, *, engine: float = 1.0, trainer: float = 1.0) -> Calibration:
        """The workload with every rollout's durations multiplied by `engine` and every
        trainer step time by `trainer`: an engine or a trainer that runs slower or faster
        than the recorded one (e.g. an engine whose decode step costs in proportion to its
        slots, given fewer slots).

        Raises:
            ValueError: naming the factor that is not a finite number > 0.
        """
        for name, factor in (("engine", engine), ("trainer", trainer)):
            if isinstance(factor, bool) or not isinstance(factor, int | float):
                raise ValueError(f"{name} factor must be a finite number > 0, got {factor!r}")
            if not 0 < factor < math.inf:
                raise ValueError(f"{name} factor must be a finite number > 0, got {factor!r}")
        observed = tuple(
            attrs.evolve(
                r,
                seconds=tuple(s * engine for s in r.seconds),
                failing=None if r.failing is None else r.failing * engine,
            )
            for r in self.observed
        )
        mu, sigma = self.lognormal
        return attrs.evolve(
            self,
            observed=observed,
            durations=tuple(d * engine for d in self.durations),
            censored=tuple(d * engine for d in self.censored),
            lognormal=(mu + math.log(engine), sigma),
            step_times=tuple(t * trainer for t in self.step_times),
            step_overlaps=tuple(o * trainer for o in self.step_overlaps),
            overlaps=tuple(o * engine for o in self.overlaps),
        )

    def rollouts_from(self, other: Calibration) -> Calibration:
        """This calibration's trainer with `other`'s rollouts: the run this trainer would have
        had, had its policy produced the rollouts `other`'s run did.

        A setting changes what the policy trains on, and so what it learns and the rollouts it
        goes on to produce (on `dew train --task guess`, a run that admitted 3 of 4 groups
        learned to give up after fewer guesses than the recorded run, and its rollouts were
        shorter; see docs/tuning.md). The simulation resamples the recorded rollouts, so no
        setting's prediction foresees that. Set beside a target run's own rollouts, the
        recorded trainer tells the error of the model of the scheduler, the engine and the
        shared CPU apart from the error of the workload's change
        (`benchmarks/tune_accuracy.py`'s `+rollouts`).

        Keeps this calibration's step times, their overlaps, the contention fitted to them and
        the groups a step trained (`admitted`); takes the rollouts, their overlaps with
        `other`'s trainer, the slots and `aheads` (the engine the rollouts ran on, which
        `tune.sized_to_ahead` sizes from) from `other`.

        Raises:
            CalibrationError: when the two differ in tasks per batch or rollouts per group.
        """
        if (other.tasks, other.groups) != (self.tasks, self.groups):
            raise CalibrationError(
                f"{', '.join(other.traces)}: (tasks, groups) {(other.tasks, other.groups)} "
                f"differ from {(self.tasks, self.groups)} of {', '.join(self.traces)}"
            )
        return attrs.evolve(
            other,
            traces=self.traces + other.traces,
            warmup=self.warmup,
            step_times=self.step_times,
            step_overlaps=self.step_overlaps,
            contention=self.contention,
            admitted=self.admitted,
        )

    def solo(self, contention: Contention) -> tuple[tuple[float, ...], tuple[ObservedRollout, ...]]:
        """The step times and observed rollouts as their side would have run alone, by the
        rate model of `contention`: a side works at 1 / (1 + factor) of its solo speed while
        the other is busy, so `overlap` seconds of it did overlap / (1 + factor) seconds of solo
        work, and the solo seconds are the recorded ones less overlap * factor / (1 + factor).
        A rollout's calls keep their shares of its seconds."""
        trainer = contention.trainer / (1 + contention.trainer)
        engine = contention.engine / (1 + contention.engine)
        steps = tuple(
            max(0.0, t - trainer * o)
            for t, o in zip(self.step_times, self.step_overlaps, strict=True)
        )
        observed = []
        for rollout, overlap in zip(self.observed, self.overlaps, strict=True):
            total = rollout.duration
            keep = (total - engine * overlap) / total if total > 0 else 1.0
            observed.append(
                attrs.evolve(
                    rollout,
                    seconds=tuple(s * keep for s in rollout.seconds),
                    failing=None if rollout.failing is None else rollout.failing * keep,
                )
            )
        return steps, tuple(observed)

    def workload(
        self,
        *,
        steps: int,
        seed: int = 0,
        slots: int | None | str = "observed",
        contention: bool | Contention = False,
    ) -> Workload:
        """The simulation's workload: the observed rollouts resampled group by group, the
        recorded step times in their order, both from the window's first step on.

        Args:
            steps: trainer steps per simulated run, `warmup` of them not measured.
            seed: seeds the resampling.
            slots: the engine's slots; "observed" for `self.slots`, None for unbounded.
            contention: False for the recorded seconds as they are, each side's speed the same
                whatever the other does; True for the fitted `self.contention`, or a Contention
                of one's own: the step times and rollouts are then their solo seconds
                (`solo`), and the simulation slows each side while the other is busy.

        Raises:
            ValueError: naming the Workload field out of bounds.
        """
        step_times, observed, shared = self.step_times, self.observed, None
        if contention is not False:
            shared = self.contention if contention is True else contention
            if not isinstance(shared, Contention):
                raise ValueError(f"contention must be a bool or a Contention, got {contention!r}")
            step_times, observed = self.solo(shared)
        return Workload(
            seed=seed,
            steps=steps,
            slots=self.slots if slots == "observed" else slots,
            tasks=self.tasks,
            groups=self.groups,
            duration_mean=self.mean_duration,
            duration_sigma=self.lognormal[1],
            step_time=float(np.mean(step_times)),
            warmup=self.warmup,
            observed=observed,
            step_times=step_times,
            contention=shared,
        )


def calibrate(traces: Sequence[str | os.PathLike | Trace], *, warmup: int = 2) -> Calibration:
    """Fit the simulation's workload to one or more recorded runs.

    Args:
        traces: trace files (or traces read) of runs of one batch shape.
        warmup: trainer calls of each trace to leave out, from its start.

    Returns:
        The calibration.

    Raises:
        CalibrationError: naming the trace that has too few calls or finished rollouts, or
            whose batch shape differs from the first's.
        TraceError: for a file that is not a trace (from `read_trace`).
        ValueError: for no traces or a negative warmup.
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if not traces:
        raise ValueError("calibrate needs at least one trace")
    read = [t if isinstance(t, Trace) else read_trace(t) for t in traces]
    first = (read[0].config["groups"], tasks_per_batch(read[0]))
    finished, cancelled, raised, steps, slots = [], [], 0, [], 0
    step_spans, rollout_spans = [], []
    # Each finished rollout's pool and run, beside it: a label names a rollout within its
    # trace only.
    pools_of: list[tuple[int, int]] = []
    for run, trace in enumerate(read):
        shape = (trace.config["groups"], tasks_per_batch(trace))
        if shape != first:
            raise CalibrationError(
                f"{trace.path}: (groups, tasks per batch) {shape} differ from the first "
                f"trace's {first}"
            )
        sessions, pools = windowed(trace, warmup, first[1])
        returned = [s for s in sessions if s.outcome == "returned"]
        # Each recorded group is a pool, numbered so that the simulation's task n (its group n)
        # draws from the recorded group n while n is within the window: of one trace, picked
        # per task, where several traces hold a group n.
        pools_of += [(s.label.group % pools, run) for s in returned]
        step, rollout = shared_cpu(trace, warmup, returned)
        step_spans.append(step)
        rollout_spans.append(rollout)
        finished += returned
        cancelled += [s for s in sessions if s.outcome == "cancelled"]
        raised += sum(s.outcome in ("raised", "invalid") for s in sessions)
        timed = delivered(trace)
        steps.append([b.handed_over - a.returned for a, b in itertools.pairwise(timed[warmup:])])
        slots = max(slots, most_in_flight(list(trace.sessions.values())))
    if not finished:
        raise CalibrationError(
            f"{', '.join(t.path for t in read)}: no rollout finished after the first "
            f"{warmup} trainer calls"
        )
    durations = np.array([s.ended - s.submitted for s in finished])
    censored = np.array([s.ended - s.submitted for s in cancelled])
    weights, beyond = kaplan_meier_weights(durations, censored)
    observed = tuple(
        attrs.evolve(split_over_calls(s), weight=float(w), pool=pool, run=run)
        for s, w, (pool, run) in zip(finished, weights, pools_of, strict=True)
        if w > 0
    )
    # The simulation's step i is step i of one trace, the traces taking turns, as its groups
    # are: several runs average, each step in step with its training.
    order = alternating([len(times) for times in steps])
    # Pooled over the traces: traces of settings that overlap differently (a synchronous run
    # beside one ahead) tell the factors apart better than either alone.
    step_fit = [np.concatenate(parts) for parts in zip(*step_spans, strict=True)]
    rollout_fit = [np.concatenate(parts) for parts in zip(*rollout_spans, strict=True)]
    overlaps = rollout_fit[1][weights > 0]
    statuses = collections.Counter(s.session.status.name for s in finished)
    truncated = [s.session for s in finished if s.session.status is Status.TRUNCATED]
    reasons = collections.Counter(session.truncation for session in truncated)
    groups, tasks = first
    return Calibration(
        traces=tuple(t.path for t in read),
        warmup=warmup,
        observed=observed,
        durations=tuple(durations.tolist()),
        censored=tuple(censored.tolist()),
        beyond=beyond,
        lognormal=fit_lognormal(
            np.array([s.ended - s.submitted for s in finished if s.session.status is not INFRA]),
            censored,
        ),
        calls=dict(sorted(collections.Counter(len(s.session.calls) for s in finished).items())),
        statuses={name: n / len(finished) for name, n in sorted(statuses.items())},
        truncations={r: n / len(truncated) for r, n in sorted(reasons.items())},
        unscored=(
            sum(session.reward is None for session in truncated) / len(truncated)
            if truncated
            else 0.0
        ),
        raised=raised,
        slots=slots,
        step_times=tuple(steps[j][i] for j, i in order),
        tasks=tasks,
        groups=groups,
        aheads=tuple(t.config["ahead"] for t in read),
        admitted=tuple(admitted_groups(t, tasks) for t in read),
        step_overlaps=tuple(float(step_spans[j][1][i]) for j, i in order),
        overlaps=tuple(overlaps.tolist()),
        contention=Contention(
            trainer=contention_factor(*step_fit), engine=contention_factor(*rollout_fit)
        ),
    )


def fit_table(calibration: Calibration) -> list[tuple[float, float, float]]:
    """Goodness of fit: per QUANTILES probability, the observed (Kaplan-Meier) duration of the
    rollouts that ran to their end and the fitted lognormal's."""
    import scipy.stats  # here, not at the top: it takes a second to import

    whole = [r for r in calibration.observed if r.status is not INFRA] or calibration.observed
    values = np.array([rollout.duration for rollout in whole])
    weights = np.array([rollout.weight for rollout in whole])
    observed = weighted_quantiles(values, weights, QUANTILES)
    mu, sigma = calibration.lognormal
    fitted = scipy.stats.lognorm.ppf(QUANTILES, max(sigma, 1e-12), scale=math.exp(mu))
    return [(p, float(o), float(f)) for p, o, f in zip(QUANTILES, observed, fitted, strict=True)]


def _share(part: Sequence[float], whole: Sequence[float]) -> str:
    """The share of `whole`'s seconds that `part` overlapped, as a percentage."""
    total = float(np.sum(whole))
    return f"{float(np.sum(part)) / total:.0%} of their seconds" if total > 0 else "never"


def _shares(shares: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {share:.1%}" for name, share in shares.items()) or "none"


def report(calibration: Calibration) -> str:
    """The fit, as `dew tune` prints it above its table."""
    c = calibration
    per_call = np.concatenate([np.array(r.seconds) for r in c.observed if r.seconds])
    step = np.array(c.step_times)
    censored = (
        f", {len(c.censored)} cancelled (censored at their running time)" if c.censored else ""
    )
    lines = [
        f"calibrated from {len(c.traces)} trace(s), the first {c.warmup} trainer calls of "
        f"each left out: {len(c.durations)} finished rollouts{censored}"
        + (f", {c.raised} raised" if c.raised else ""),
        f"  batch: {c.tasks} tasks x {c.groups} rollouts; engine: {c.slots} slots (the most "
        f"rollouts in flight at once)",
        f"  trainer step: mean {c.step_time:.4g}s, median {np.median(step):.4g}s, "
        f"p90 {np.quantile(step, 0.9):.4g}s over {len(step)} steps",
        f"  rollout duration: mean {c.mean_duration:.4g}s; lognormal fit mu {c.lognormal[0]:.4g} "
        f"sigma {c.lognormal[1]:.4g}"
        + (f"; {c.beyond:.1%} of the mass beyond the longest finished" if c.beyond else ""),
        f"  per call (split by completion tokens): median {np.median(per_call):.4g}s, "
        f"p90 {np.quantile(per_call, 0.9):.4g}s",
        "  calls per rollout: "
        + ", ".join(f"{n}: {count / len(c.durations):.1%}" for n, count in c.calls.items()),
        f"  statuses: {_shares(c.statuses)}; truncations: {_shares(c.truncations)}"
        + (f" ({c.unscored:.1%} unscored)" if c.truncations else ""),
        f"  shared CPU: steps overlapped the engine {_share(c.step_overlaps, c.step_times)}, "
        f"rollouts the trainer {_share(c.overlaps, c.durations_observed)}; fitted slowdown "
        f"while overlapped: trainer +{c.contention.trainer:.0%}, engine "
        f"+{c.contention.engine:.0%} (dew tune --contention fit)",
        f"  {'quantile':>10}{'observed s':>12}{'lognormal s':>13}{'ratio':>8}",
    ]
    for p, observed, fitted in fit_table(c):
        ratio = fitted / observed if observed > 0 else math.inf
        lines.append(f"  {p:>10.2f}{observed:>12.4g}{fitted:>13.4g}{ratio:>8.2f}")
    return "\n".join(lines)


@attrs.frozen
class RunFigures:
    """A recorded run's figures over the window a simulation measures, defined as it does.

    Over the calls from `warmup` to the last but one: elapsed runs from the hand-over of call
    `warmup` to the last call's hand-over; waited sums each call's hand-over to its delivery;
    admitted counts the samples delivered; wasted is the share of rollout-seconds of the
    submissions that ended in those calls' event logs that went to cancelled, discarded or
    failed ones.
    """

    trace: str
    steps: int
    elapsed: float
    admitted: int
    waited: float
    lags: tuple[int, ...]
    wasted: float

    @property
    def goodput(self) -> float:
        """Admitted samples per second."""
        return self.admitted / self.elapsed

    @property
    def idle(self) -> float:
        """The trainer's idle share: waited over elapsed."""
        return self.waited / self.elapsed


def observe(trace: str | os.PathLike | Trace, *, warmup: int = 2) -> RunFigures:
    """Measure a recorded run as a simulation of `len(calls) - 1` steps measures itself.

    Raises:
        CalibrationError: when the trace has fewer than warmup + 2 calls that returned.
    """
    trace = trace if isinstance(trace, Trace) else read_trace(trace)
    opens = window_start(trace, warmup)
    timed = delivered(trace)
    window = timed[warmup:-1]
    ends = {
        e.label: e.kind
        for call in window
        for e in call.events
        if e.kind in ("admitted", *WASTED) and e.label in trace.sessions
    }
    spans = {label: trace.sessions[label] for label in ends}
    spent = sum(s.ended - s.submitted for s in spans.values())
    wasted = sum(s.ended - s.submitted for label, s in spans.items() if ends[label] in WASTED)
    return RunFigures(
        trace=trace.path,
        steps=len(window),
        elapsed=timed[-1].handed_over - opens,
        admitted=sum(call.record.groups for call in window) * trace.config["groups"],
        waited=sum(call.returned - call.handed_over for call in window),
        lags=tuple(call.record.lag for call in window),
        wasted=wasted / spent if spent > 0 else 0.0,
    )
