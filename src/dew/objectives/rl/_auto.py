"""The adaptive cut (`admit="auto"`): each call's `admit`, chosen from this run's own durations.

A fixed `admit` is a guess about the tail: too high and the trainer waits on the slowest groups,
too low and the cut throws work away (or, under carry_over, leaves groups running toward their
staleness bound). The core asks `choose` at each hand-over, with what it knows at that instant:
how long each of the batch's running groups has run, how long this run's groups took to
complete (a Kaplan-Meier estimate over a recent window, where a group cut before completing
counts as censored at its age rather than being dropped, which would favour short groups), and
how long the trainer's steps take. `choose` returns the cut that maximises the call's estimated
goodput (groups delivered per second of the trainer's step and wait) among those whose
estimated waste stays within the budget, or where none does the least wasteful (and says
so); the `Choice` names the estimate, so each record says why its call cut where it did.
Under carry_over the core asks `hold` instead which admit to wait for: one held for a stretch of
calls and re-chosen between stretches from the waste the run measured (a carried group's waste
shows only calls after its cut, so each call's own best swings), and `choose` gives only that
admit's estimate, for the record. The budget is held in slot-seconds (each submission from its
start on an engine slot), what the engines gave to work thrown away: counted from submission,
a queued rollout's wait would weigh as work, admitted or not.

Everything here is a pure function of numbers the core holds (times on the scheduler's clock),
so a run under the mock clock, and its replay, choose alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

# Recent groups an estimate rests on: enough for a tail quantile, recent enough to follow a run
# whose rollouts grow longer as it trains.
WINDOW = 256
# Recent trainer steps whose median is the step-time estimate.
STEP_WINDOW = 16
# Under carry_over, auto holds one admit for a stretch of this many times max_lag calls: the
# first max_lag of them settle (a group a cut carries goes stale up to max_lag calls on, so a
# change of admit shows in the measured waste only then) and the rest measure it.
STRETCH = 3
# Until the admit first turns back (a step up after steps down, or down after up), a stretch is
# this many times max_lag calls: max_lag settle and max_lag measure. The run is still finding
# its way from half the batch, and each stretch at an admit it is leaving is a stretch lost
# (issue 46: on the light tails 45 of 300 calls above the admit the run settled at).
FIRST_STRETCH = 2
# A stretch steps down only where its measured waste is within this share of the budget: the
# waste a lower admit adds shows calls after the step, so one near the budget would overshoot.
DOWN_WITHIN = 0.8
# Stretches after which an admit measured past the budget may be tried again: one stretch's
# measure is noisy (on heavy tails 10 calls' waste ranges from 1 % to 30 %), and an admit
# barred for good on one unlucky stretch kept runs at a higher admit than the budget needed.
FORGET = 3


@attrs.frozen
class Running:
    """A group still running at the hand-over: its age in seconds and, under carry_over, the
    calls after this one that may still admit it before its oldest call passes `max_lag`."""

    age: float
    calls_left: int = 0


@attrs.frozen
class Choice:
    """One call's cut and the estimate that chose it.

    admit: the batch's own groups the call waits for (the batch size: no cut).
    wait: estimated seconds the trainer waits; goodput: estimated groups delivered per second
    of the call (step and wait); waste: estimated share of the call's group-seconds the cut
    throws away (cancelled, or carried past the bound); step: the trainer's estimated seconds
    per step; observed: completed groups the duration estimate rests on (0: too few yet, and
    the estimates are None: no cut, or under carry_over half the batch).
    """

    admit: int
    wait: float | None = None
    goodput: float | None = None
    waste: float | None = None
    step: float | None = None
    observed: int = 0
    # The call's estimated group-seconds lost and delivered, weighed with the run's measured.
    lost: float = 0.0
    kept: float = 0.0
    # The share of the run's rollout-seconds so far thrown away, measured (None before any
    # submission has ended).
    wasted: float | None = None
    # The same share in slot-seconds (each submission from its start on an engine slot), as
    # dew simulate's slot waste counts it: what the engines, not their queues, gave away, and
    # what the budget weighed the call's estimate against.
    slot_wasted: float | None = None
    # No admit kept the run within its budget, so the call takes the one estimated to throw
    # least away (without carry_over, no cut); under carry_over the core then cancels carried
    # groups beyond a batch's worth, `drained` of them.
    over_budget: bool = False
    drained: int = 0
    # Under carry_over, the slot waste measured over the last stretch's settled calls (see
    # `hold`), which chose this admit (None before the first stretch has ended).
    stretch_wasted: float | None = None

    def metrics(self) -> dict[str, float]:
        """The record's `auto/*` figures, those estimated and finite (a record's figures are
        finite)."""
        figures = {
            "auto/admit": self.admit,
            "auto/wait": self.wait,
            "auto/goodput": self.goodput,
            "auto/waste": self.waste,
            "auto/step": self.step,
            "auto/observed": self.observed,
            "auto/wasted": self.wasted,
            "auto/slot_wasted": self.slot_wasted,
            "auto/over_budget": self.over_budget,
            "auto/drained": self.drained,
            "auto/stretch_wasted": self.stretch_wasted,
        }
        return {k: float(v) for k, v in figures.items() if v is not None and math.isfinite(v)}


@attrs.frozen
class Stretch:
    """Under carry_over, the admit auto holds and how its stretch stands.

    admit: the batch's own groups each call of the stretch waits for; calls: the calls made at
    it so far; mark: the run's slot-seconds (thrown away, all) once its settling calls had
    passed, or at its first call where the stretch before held the same admit (None before);
    since: that stretch's mark, where the admit held (the waste is measured over both); over:
    (admit, stretch number) for each admit a stretch measured past the budget in the last
    FORGET stretches, which the run does not step down to; wasted: the last stretch's measured
    slot waste; number: the stretches ended so far; way: the admit's last step (-1 down, 1 up,
    0 none yet); turned: whether it has stepped both ways (then stretches are STRETCH x
    max_lag calls, FIRST_STRETCH x max_lag before).
    """

    admit: int
    calls: int = 0
    mark: tuple[float, float] | None = None
    since: tuple[float, float] | None = None
    over: tuple[tuple[int, int], ...] = ()
    wasted: float | None = None
    number: int = 0
    way: int = 0
    turned: bool = False

    def overspent(self, admit: int) -> bool:
        """Whether a stretch at `admit` was measured past the budget lately."""
        return any(a == admit for a, _ in self.over)


def hold(
    stretch: Stretch | None,
    *,
    size: int,
    max_lag: int,
    budget: float,
    slot_spent: tuple[float, float],
) -> Stretch:
    """Under carry_over, the stretch this call belongs to: the admit it holds, re-chosen only
    once a stretch has ended, from the slot waste the run measured over the stretch.

    Why a held admit and not each call's best: under carry_over a cut costs nothing at its own
    call; the groups it carries go stale, if they do, up to max_lag calls later, so each call's
    estimate of its cut's waste is a guess the measured waste confirms only calls on, and a
    choice made afresh at every call swings between cutting too much and not at all (issue
    46: on light tails the whole batch at four calls in five with the budget unspent, on heavy
    ones cuts spending the budget faster than the run could sustain). A steady admit's waste is
    steady, and measured. Each stretch is STRETCH x max_lag calls at one admit (FIRST_STRETCH
    x max_lag until the admit first turns back, while the run is still finding its way): the
    first max_lag settle, the rest measure the slot waste it costs. A stretch that holds the
    admit of the one before settles nothing, so it is max_lag calls shorter, and it is judged on
    its own measure and that one's together (one stretch's is noisy). Then the admit steps up by
    one where the measure spent more than the budget and what the run has saved below it (so a
    run past its budget comes back), and that admit is barred for FORGET stretches; down where
    the measure was within DOWN_WITHIN of the budget and the run as a whole within it (a lower
    admit waits on fewer of the batch's groups: the trainer waits less, and carry-over refills
    the call), by as many admits as the measure's headroom below DOWN_WITHIN x budget reaches
    were the waste to grow evenly to it at admit 1, one at least, never to or past an admit
    barred; else it holds. The run so settles at about the least admit whose steady waste fits
    the budget. It starts at half the batch: a carried group costs no work. The core drains the
    carried groups beyond a batch's worth at a step up: a lower admit's backlog stays in play
    otherwise (a call admits at most a batch), and its queueing keeps the waste up whatever the
    admit.

    Args:
        stretch: the previous call's (None at the run's first call).
        size: the batch's groups.
        max_lag: the scheduler's bound, in calls.
        budget: the most slot waste the run may spend, a share of its slot-seconds.
        slot_spent: the run's slot-seconds so far, thrown away and all, measured.

    Returns:
        the stretch, its admit the one this call waits for.
    """
    if stretch is None:
        return Stretch(admit=-(-size // 2), calls=1)
    calls = stretch.calls + 1
    # A stretch that holds the admit of the one before has nothing to settle: it only measures.
    length = (STRETCH if stretch.turned else FIRST_STRETCH) - (stretch.since is not None)
    if calls <= length * max_lag:
        settled = stretch.mark is None and calls == max_lag + 1
        mark = slot_spent if settled else stretch.mark
        return attrs.evolve(stretch, admit=min(stretch.admit, size), calls=calls, mark=mark)
    start = stretch.since or stretch.mark or (0.0, 0.0)
    lost, total = slot_spent[0] - start[0], slot_spent[1] - start[1]
    wasted = lost / total if total > 0 else 0.0
    run = slot_spent[0] / slot_spent[1] if slot_spent[1] > 0 else 0.0
    number = stretch.number + 1
    over = tuple((a, n) for a, n in stretch.over if number - n <= FORGET)
    admit = min(stretch.admit, size)
    target = admit
    # The stretch may spend what the run has saved so far, no more: past it, one admit higher.
    if wasted > budget + (budget - run):
        over = (*((a, n) for a, n in over if a != admit), (admit, number))
        target = min(size, admit + 1)
    elif wasted <= DOWN_WITHIN * budget and run <= budget:
        # As far down as the stretch's headroom reaches, were the waste to grow evenly as the
        # admit falls, to DOWN_WITHIN x budget at admit 1 (on a light tail a stretch at half
        # the batch wastes next to nothing, and each admit above the least costs goodput: on
        # the reference workload admit 4 at 0.82 of admit 1's); one at least, and never to or
        # past an admit lately barred.
        headroom = 1.0 - wasted / (DOWN_WITHIN * budget) if budget > 0 else 0.0
        steps = max(1, round((admit - 1) * headroom))
        target = max(1, admit - steps, *(a + 1 for a, _ in over if a < admit))
    way = (target > admit) - (target < admit)
    if way == 0:
        # The admit holds, settled: the next stretch measures from its first call, and its
        # decision weighs this stretch's measure with its own (one stretch's is noisy).
        return Stretch(
            admit=admit,
            calls=1,
            mark=slot_spent,
            since=stretch.mark,
            over=over,
            wasted=wasted,
            number=number,
            way=stretch.way,
            turned=stretch.turned,
        )
    return Stretch(
        admit=target,
        calls=1,
        over=over,
        wasted=wasted,
        number=number,
        way=way,
        turned=stretch.turned or stretch.way == -way,
    )


def survival(durations: Sequence[float], complete: Sequence[bool]):
    """Kaplan-Meier: the distinct completion times and S(t) just after each.

    A censored duration (a group cut at that age) counts among those at risk up to it and
    completes nowhere.
    """
    d = np.asarray(durations, dtype=float)
    e = np.asarray(complete, dtype=bool)
    times = np.unique(d[e])
    if times.size == 0:
        return times, times
    at_risk = (d[None, :] >= times[:, None]).sum(axis=1)
    events = (d[e][None, :] == times[:, None]).sum(axis=1)
    return times, np.cumprod(1.0 - events / at_risk)


def _survive(times: np.ndarray, s: np.ndarray, t: np.ndarray) -> np.ndarray:
    """S(t) for each t: the step function, 1 before the first completion."""
    index = np.searchsorted(times, t, side="right")
    return np.concatenate(([1.0], s))[index]


def _completing(times, s, ages: np.ndarray, waits: np.ndarray) -> np.ndarray:
    """[waits, groups]: the probability that a group of each age completes within each wait.

    A group older than every completion seen (S = 0 at its age) is beyond this run's
    experience: it is taken not to complete, so that no cut waits on it.
    """
    if ages.size == 0:
        return np.zeros((waits.size, 0))
    alive = _survive(times, s, ages)
    later = _survive(times, s, ages[None, :] + waits[:, None])
    with np.errstate(divide="ignore", invalid="ignore"):
        done = np.where(alive > 0, 1.0 - later / alive, 0.0)
    return done


def choose(
    *,
    size: int,
    complete: int,
    running: Sequence[Running],
    carried_complete: int,
    carried_running: Sequence[float],
    seen: Sequence[tuple[float, bool]],
    steps: Sequence[float],
    budget: float,
    carry_over: bool,
    spent: tuple[float, float] = (0.0, 0.0),
    slot_spent: tuple[float, float] = (0.0, 0.0),
    admits: Sequence[int] | None = None,
) -> Choice:
    """The call's cut: the admit in 1..size of highest estimated goodput within the waste budget.

    Args:
        size: the batch's groups.
        complete: its groups complete at the hand-over.
        running: its groups still running.
        carried_complete, carried_running: under carry_over, the complete carried groups a call
            may admit and the ages of the running ones (a call admits them first).
        seen: this run's recent groups, (seconds from submission to completion or cut, whether
            it completed).
        steps: the trainer's recent step seconds (from a delivery to the next hand-over).
        budget: the most waste the run's cuts may cost, as a share of its group-seconds: a
            call may cut more than its share where earlier calls cut less (a rare long
            straggler is worth cutting even when that one call's cut is costly).
        carry_over: whether the groups a cut leaves out keep running (their waste is their risk
            of passing the bound) or are cancelled (their waste is what they ran).
        spent: the group-seconds the run's ended submissions threw away, and all they ran,
            measured (the core's own record: each one's seconds from submission to its end).
        slot_spent: the same in slot-seconds, each from its start on an engine slot (from its
            submission where the engine never said): the budget's measure. The estimate's
            group-seconds, which count from submission as `seen` does, are weighed in it at
            the run's measured share of a submission's seconds spent on a slot.
        admits: the admits to weigh (by default 1..size); under carry_over the core weighs only
            the one its stretch holds (`hold`), for the record's estimate.
    """
    wasted = spent[0] / spent[1] if spent[1] > 0 else None
    slot_wasted = slot_spent[0] / slot_spent[1] if slot_spent[1] > 0 else None
    on_slot = min(1.0, slot_spent[1] / spent[1]) if spent[1] > 0 else 1.0
    completed = [d for d, done in seen if done]
    if len(completed) < size or not steps:
        # Nothing to estimate from yet: under carry_over a cut costs no work, so the first
        # calls take half the batch rather than wait on its slowest group; else none is cut.
        return Choice(
            admit=-(-size // 2) if carry_over else size, wasted=wasted, slot_wasted=slot_wasted
        )
    times, s = survival([d for d, _ in seen], [done for _, done in seen])
    step = float(np.median(steps))
    mean = float(np.mean(completed))
    ages = np.array([r.age for r in running], dtype=float)
    calls_left = np.array([r.calls_left for r in running], dtype=float)
    carried_ages = np.array(carried_running, dtype=float)
    # Every wait at which a running group's completion chance changes, and none.
    marks = [times[None, :] - ages[:, None], times[None, :] - carried_ages[:, None]]
    waits = np.unique(np.concatenate([np.zeros(1), *(m[m > 0] for m in marks)]))
    p_own = _completing(times, s, ages, waits)
    p_carried = _completing(times, s, carried_ages, waits)
    own_pmf = _count_pmf(p_own)
    carried_sf = np.cumsum(_count_pmf(p_carried)[:, ::-1], axis=1)[:, ::-1]  # P(count >= m)
    carried_sf = np.concatenate([carried_sf, np.zeros((waits.size, 1))], axis=1)
    expected = complete + p_own.sum(axis=1) + carried_complete + p_carried.sum(axis=1)
    best = least = None
    for admit in range(1, size + 1) if admits is None else admits:
        # The call is ready once `admit` of its own are complete, or, under carry_over, once
        # complete groups fill it: the chance it is by each wait, the groups independent.
        own_enough = np.arange(own_pmf.shape[1]) + complete >= admit
        if carry_over:
            short = size - complete - carried_complete - np.arange(own_pmf.shape[1])
            fill = carried_sf[:, np.clip(short, 0, carried_sf.shape[1] - 1)]
            fill[:, short > carried_sf.shape[1] - 2] = 0.0
            fill[:, short <= 0] = 1.0
            ready = (own_pmf * np.where(own_enough, 1.0, fill)).sum(axis=1)
        else:
            ready = own_pmf[:, own_enough].sum(axis=1)
        if ready[-1] < 1 - 1e-9:
            continue  # it may wait on a group beyond this run's experience: without end
        # The expected wait: the integral of the chance of not being ready yet.
        wait = float((np.diff(waits) * (1.0 - ready[:-1])).sum())
        at = int(np.argmax(ready >= 0.5))  # the median wait, where the figures below are read
        if carry_over:
            delivered = min(size, expected[at])
        else:
            delivered = max(admit, complete)
        goodput = delivered / (step + wait) if step + wait > 0 else math.inf
        # A carried group has its calls left, each a step and about this wait long.
        horizons = calls_left * (step + wait)
        lost, kept = _waste(
            times,
            s,
            ages,
            horizons,
            float(waits[at]),
            delivered,
            mean,
            carry_over,
            admit == size and not carry_over,
        )
        lost_slot, kept_slot = lost * on_slot, kept * on_slot
        waste = lost / (lost + kept) if lost + kept > 0 else 0.0
        choice = Choice(
            admit, wait, goodput, waste, step, len(completed), lost, kept, wasted, slot_wasted
        )
        # The run's share thrown away, this call's estimate included. Ties go to the larger
        # admit, here and below: the same figure with less cut.
        total = slot_spent[1] + lost_slot + kept_slot
        share = (slot_spent[0] + lost_slot) / total if total > 0 else 0.0
        if least is None or share <= least[0] + 1e-12:
            least = (share, choice)
        if share > budget + 1e-9:
            continue
        if best is None or goodput >= best.goodput:
            best = choice
    if best is not None:
        return best
    # No admit keeps the run within its budget: the one that throws least away. Without
    # carry_over that is no cut, which throws nothing away, its wait estimated or not.
    if least is not None and (carry_over or least[1].admit == size):
        return attrs.evolve(least[1], over_budget=True)
    return Choice(
        size, None, None, 0.0, step, len(completed), 0.0, size * mean, wasted, slot_wasted, True
    )


def _count_pmf(p: np.ndarray) -> np.ndarray:
    """[waits, groups + 1]: the chance that exactly j of the groups are complete by each wait,
    from each one's chance (independent; a Poisson-binomial, by the usual recursion)."""
    pmf = np.zeros((p.shape[0], p.shape[1] + 1))
    pmf[:, 0] = 1.0
    for g in range(p.shape[1]):
        q = p[:, g : g + 1]
        pmf[:, 1:] = pmf[:, 1:] * (1 - q) + pmf[:, :-1] * q
        pmf[:, 0] *= 1 - q[:, 0]
    return pmf


def _waste(times, s, ages, horizons, wait, delivered, mean, carry_over, whole):
    """The estimated group-seconds a cut after `wait` throws away, and those it delivers.

    Without carry_over, a group still running then is cancelled with what it ran (age + wait).
    Under carry_over it keeps running and is lost only if it does not complete within the
    seconds it has left before its bound; it then has run age + wait + horizon.
    """
    kept = delivered * mean
    if whole or ages.size == 0:
        return 0.0, kept
    left = 1.0 - _completing(times, s, ages, np.array([wait]))[0]
    spent = ages + wait
    if carry_over:
        alive = _survive(times, s, spent)
        past = _survive(times, s, spent + horizons)
        with np.errstate(divide="ignore", invalid="ignore"):
            stale = np.where(alive > 0, past / alive, 1.0)
        lost = float((left * stale * (spent + horizons)).sum())
    else:
        lost = float((left * spent).sum())
    return lost, kept
