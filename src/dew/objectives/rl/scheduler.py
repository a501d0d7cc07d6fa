"""Keep agent rollouts in flight and admit complete groups within a staleness bound.

`RolloutScheduler` is the trainer's Rollout for any SessionSource. This module is its front:
the arguments, the two facades, and closing on collection. Behind it, `_admission` holds the
admission rules as a pure function (its values, events and commands in `_admission_values`),
`_shell` (with its parts `_shell_trainer` and `_shell_trio`) the trio side that carries out its
commands (and documents how ties at one instant are ordered), `_arguments` the argument checks
and limits, `_reports` the warnings of a run that trains on nothing, and `_records` the records
and status it returns.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import numpy as np

from dew.data import Batch, Dataset, Task
from dew.objectives.rl._admission import LogEvent
from dew.objectives.rl._arguments import (
    MAX_CELLS,
    MAX_IN_FLIGHT,
    MAX_SAMPLES,
    MAX_WIDTH,
    check_long_wait,
    check_pool,
)
from dew.objectives.rl._records import (
    GroupStatus,
    Publisher,
    SampleStatus,
    SchedulerRecord,
    SchedulerStatus,
    Variables,
)
from dew.objectives.rl._shell import _Scheduler
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.sessions import SessionSource

__all__ = [
    "MAX_CELLS",
    "MAX_IN_FLIGHT",
    "MAX_SAMPLES",
    "MAX_WIDTH",
    "GroupStatus",
    "LogEvent",
    "Publisher",
    "RolloutScheduler",
    "SampleStatus",
    "SchedulerRecord",
    "SchedulerStatus",
    "task_ids",
]


# What may be assigned to a scheduler after construction, each with the check of its value.
_SETTINGS = {"pool": check_pool, "long_wait": check_long_wait}


def task_ids(batch: Batch) -> list[Task]:
    """One task per integer task_id row, named by its decimal id.

    Raises:
        ValueError: when the batch has no 1-D integer `task_id` array.
    """
    if "task_id" not in batch:
        raise ValueError(f"task_ids needs a 'task_id' array in the batch, got {sorted(batch)}")
    ids = np.asarray(batch["task_id"])
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"task_id must be a 1-D integer array, got {ids.dtype}{list(ids.shape)}")
    return [Task(name=str(int(i))) for i in ids]


class RolloutScheduler:
    """Train on complete rollout groups from source, ahead task batches early.

    The trainer's Rollout, twice: `scheduler(batch, variables, updates)` from the trainer's
    thread (the trio machinery then runs in a background thread the scheduler owns), or
    `await scheduler.step(batch, variables, updates)` inside `async with scheduler:` in the
    caller's own trio run (what tests and notebooks drive under a mock clock; packing and
    rescoring then run inline in that run).

    Ties are broken by one documented key, so that a run is a function of its seed, its
    source's behaviour and trio's clock: at one instant, rollouts' finishes apply by (group,
    sample, attempt), then their deadlines, then the trainer's hand-over, reopen or close; a
    batch's groups are admitted, and packed, in order of (completion time, group id), and
    `oversample` and `admit` keep the first to complete in that order. A weight push lands at
    the trainer's call, before anything else of its instant.

    A call that fails (a broken source, a refused batch, a failed push, another process's
    failure met at the pool's agreement point) stops the scheduler: later calls raise,
    naming it.

    close() it, or use it in `with`/`async with`: a scheduler dropped unclosed is closed when
    it is collected (its thread ends, its rollouts are cancelled) with a ResourceWarning, as an
    unclosed file is; its trio thread holds only its workings (`_Scheduler`), never it.

    Args:
        objective: rescores the packed rows under the trainer's weights (proximal policy),
            unless its `proximal` is "current" (the update's forward pass gives them: the
            batch then carries no `proximal_logprobs`, and the record leaves out the figures
            made from them: `importance/masked`, `/p10`, `/p50`, `/p90`, `mismatch/engine`,
            `staleness/kl`; the loss reports `importance/masked` in its place).
        source: runs one rollout of a task.
        weights: where pushed weights go.
        width, rows: the packed batch's shape, rows for this process's share.
        tasks: turns one registered batch into its tasks.
        groups: rollouts per task that train together.
        oversample: extra rollouts per group; the first `groups` to finish are admitted.
        admit: admit the first `admit` groups of a batch to complete, cancel the others.
            "auto" chooses each call's `admit` from this run's own record (see `waste_budget`).
        max_lag: the most updates a rollout's oldest call may be behind at consumption.
        ahead: batches submitted before the trainer hands them over.
        sync_every: push weights when the served version falls this many updates behind.
        max_attempts: failures per sample before its group is abandoned.
        timeout: each rollout's deadline in seconds from its submission.
        estimator, truncation, support_capacity: pack's advantage family, truncation policy and
            per-row support length.
        log: receives a SchedulerRecord per call.
        vocab: the model's vocabulary size: a session holding a token id at or above it is
            refused as broken (`SessionError`, naming task, label and field) rather than
            rescored into non-finite log-probs. None takes the objective's model's `vocab`
            where it declares one (a `dew.models.Model` does), else checks only that ids are
            not negative; a vocab above the model's is refused.
        empty_streak: after this many consecutive calls that train on nothing (every group
            cut, abandoned or failed, or every group trained scored alike, so that each
            advantage is 0), log a warning that gives the streak's counts and most frequent
            errors, once per streak; None never warns. A healthy run rarely has even one
            such call, and 5 wastes few steps before saying so.
        narrow: pack each batch into the narrowest of `width`, width / 2, ... width / 16
            that holds the same groups, with as many times more rows (`pack_narrow`): a row's
            attention costs its width squared, so a batch of short chains trains as its tokens
            need rather than at the longest chain the run allows; at most five shapes compile.
            A process of a `jax.distributed` pool packs at `width` (the pool's processes must
            agree on one shape). `dew train` narrows.
        filter_uniform: discard a complete group whose training rewards are all equal (its
            advantages would all be 0: it takes rows and trains nothing; DAPO's dynamic
            sampling). Its finished rollouts end `discarded` (reason `uniform`), and it does
            not count toward `admit`, so with `admit` below the task batch size the batch's
            later groups take its place; nothing is read beyond the trainer's prefetch for it,
            so a batch whose groups are all uniform trains on nothing. The record's metrics
            count the batch's uniform groups either way (`groups/uniform`, and
            `groups/uniform_trained` of them trained on).
        reference: a frozen reference policy's variables, rescored over the packed rows as
            `reference_logprobs` beside the proximal log-probs, for an objective with a
            `kl_coef`; required by one, refused without one. Or a function of no arguments
            that returns them, called as each batch is packed: a reference that moves during
            the run (`dew train --ref-sync-every`, which reads the trainer's optimizer state).
        carry_over: with `admit`, the groups a batch's cut leaves out keep running instead of
            being cancelled (`carried` in the event log) and are admitted at a later call,
            ahead of its own groups and within its task batch size, while their oldest call
            stays within `max_lag` (else the stale rules resubmit them, as any rollout's). A
            carried group is admitted once or ends with a reason (`reopened` when the stream
            is opened again). The record's metrics say how many a call admitted
            (`carry/admitted`), how many calls old they were (`carry/age_mean`,
            `carry/age_max`) and how many remain in play (`carry/in_play`). A carried group
            one of whose samples has gone stale five times is held (a `held` event, counted in
            `carry/held`): the next call waits for it, which stops its lag from growing, so a
            task whose rollouts always outlive `max_lag` (a hard problem, long every time) is
            trained rather than resubmitted stale for good while its slots burn. `oversample`'s
            surplus is still cancelled: a surplus sample is its group's, of its version, and
            would complete a later group of the same task only when the stream reads that task
            again within `max_lag`, which a dataset's epoch rarely does. A checkpoint keeps the
            carried groups' tasks (`checkpoint_state`), and a resumed run submits them again.
            Under carry_over the cut comes at the batch's call: the call is answered once
            `admit` of its batch's groups are complete, or once complete groups, carried ones
            counted, fill it; it admits them oldest first (carried ones in the order they were
            cut, then the batch's own by completion) up to the task batch size, and carries the
            batch's others, running or complete. A cut before the call would carry groups that
            complete in time, and a call that admits fewer than a batch leaves groups in play
            for good: each makes the rollouts in flight, and so their staleness, grow.
        waste_budget: under `admit="auto"`, the most waste a call's cut may cost, as a share of its
            group-seconds. At each hand-over the scheduler estimates, from this run's own record
            (a Kaplan-Meier estimate of its recent groups' seconds to completion, a group cut
            before completing counted as censored, and the median of its recent steps' seconds),
            for each admit in 1..the task batch size how long the trainer would wait, how many
            groups it would receive (carried ones counted under carry_over) and what the cut
            would waste (the seconds of the groups it cancels; under carry_over, of those it
            carries that would pass `max_lag` before completing), and takes the admit of highest
            estimated goodput (groups per second of step and wait) within the budget, no cut
            until a batch's worth of groups has completed. Under carry_over, where a cut's waste
            shows only calls later, it holds one admit for a stretch of 3 x `max_lag` calls
            instead (2 x until the admit first turns back), one up where the stretch spent past
            the budget, down where it spent well within it, as far as that headroom reaches
            (docs/concepts.md, "The steady admit"). The budget is of what the run has
            really thrown away so far, in slot-seconds, measured from its own events (every
            ended submission's seconds from its start on an engine slot, as its engine said it,
            to its end, those not admitted thrown away: cancelled, stale, failed, unneeded
            hedges; its queueing before that neither kept nor thrown away), plus the call's
            estimate, weighed at the run's share of seconds on a slot; where no admit keeps
            within it, the call cuts nothing, and under carry_over it cancels (as `surplus`)
            running carried groups, those that have run least first, until a batch's worth of
            carried groups is left in play: a call admits at most a batch, so the carried groups
            earlier cuts left in play would otherwise stay, queueing for the engine and going
            stale. The record's metrics carry the choice and its estimate: `auto/admit`,
            `auto/wait`, `auto/goodput` (groups per second), `auto/waste`, `auto/step`,
            `auto/observed` (the completed groups the estimate rests on), `auto/wasted` (the
            run's measured share of rollout-seconds, from submission, thrown away so far),
            `auto/slot_wasted` (the same in slot-seconds, what the budget holds),
            `auto/over_budget` (1 where no admit kept within the budget), `auto/drained` (the
            carried groups that call cancelled) and, under carry_over, `auto/stretch_wasted`
            (the share the last stretch threw away, which chose the held admit); ten calls in a
            row over the budget log a warning, once a streak, since what they still waste is the
            staleness window's rather than the cut's. A run under the mock clock, and its
            replay, choose alike.
        hedge: under carry_over, a carried group still running when the call two before its last
            admissible one hands over gets a fresh sample (a hedge) beside each of its running
            ones, once; a hedge replaces its original only where the original has not finished
            by the group's last admissible call, so a straggler no longer makes its whole group
            stale (resubmitted, its finished samples thrown away). A hedge that is not needed
            ends `surplus`; `carry/hedged` counts those submitted. On by default: on the
            reference long-tail workload it raises goodput and cuts waste, and because a hedge
            stands in only for an original that would go stale (never for one merely slower
            than it), the selection it adds is small (docs/concepts.md, "Carry-over"). False
            resubmits a group whose straggler passes `max_lag` whole. No effect without
            carry_over.
        align_starts: the engines' decode slots, to start rollouts aligned to pushes (None, the
            default: every rollout starts at its submission and queues at the engine). The
            scheduler then starts at most this many rollouts at once, in submission order, and
            a slot freed while the trainer holds its batch waits for the coming push where a
            rollout started now would likely spend its slot-seconds for nothing: started `r`
            seconds before the push it has `r + (max_lag - 1)` periods to finish, after it
            `max_lag`, and it waits when the slot-seconds a start now is expected to throw
            away beyond one at the push (`W S(W) - M S(M)`, `S` this run's own chance that a
            rollout outlives so many seconds on a slot) exceed the `r` seconds it idles. The
            next hand-over ends every wait, and nothing waits while the trainer waits on the
            scheduler, so no wait holds back what the trainer needs. The record counts the
            starts that waited (`align/waited`) and the slot-seconds held idle for pushes
            (`align/wait_seconds`); a run under the mock clock, and its replay, wait alike
            (docs/concepts.md, "Push-aligned starts").

    Settings, assigned after construction (any other assignment is refused, naming them):

    - `scheduler.pool`: where this process meets the others of a multi-process trainer, twice
      a call (`dew.parallel.Pool`): `default_pool()` unless assigned, which is a
      `DistributedPool` of one process a share in a pool of processes, else a `LocalPool`.
      Assign `DistributedPool(share_size=k)` (or `DistributedPool.from_mesh(...)`) when k
      consecutive processes read one data share (a tensor or sequence axis across processes):
      only a share's first reader then samples, and the others train on its rows.
    - `scheduler.long_wait`: seconds the trainer waits before the scheduler logs what it waits
      on (then after twice as long, and so on), 60 unless assigned; None logs nothing.

    Limits: width <= MAX_WIDTH, rows * width <= MAX_CELLS, groups <= rows * width (a larger
    group could never be packed), groups + oversample <= MAX_SAMPLES, rows * support_capacity
    <= MAX_CELLS, and at each call a task batch of at most MAX_IN_FLIGHT rollouts.

    Raises:
        ValueError: naming the argument and the bound it broke.
        TypeError: naming a collaborator (objective, source, weights, tasks, log) that lacks
            what it needs.
    """

    def __init__(
        self,
        objective: GRPOObjective,
        source: SessionSource,
        weights: Publisher,
        *,
        width: int,
        rows: int,
        tasks: Callable[[Batch], Sequence[Task]] = task_ids,
        groups: int = 4,
        oversample: int = 0,
        admit: int | str | None = None,
        max_lag: int = 1,
        ahead: int = 1,
        sync_every: int = 1,
        max_attempts: int = 3,
        timeout: float | None = None,
        estimator: str = "group",
        truncation: str = "mask",
        support_capacity: int | None = None,
        log: Callable[[SchedulerRecord], None] | None = None,
        vocab: int | None = None,
        empty_streak: int | None = 5,
        filter_uniform: bool = False,
        reference: Variables | None = None,
        carry_over: bool = False,
        waste_budget: float = 0.2,
        hedge: bool = True,
        narrow: bool = False,
        align_starts: int | None = None,
    ):
        inner = _Scheduler(
            objective,
            source,
            weights,
            width=width,
            rows=rows,
            tasks=tasks,
            groups=groups,
            oversample=oversample,
            admit=admit,
            max_lag=max_lag,
            ahead=ahead,
            sync_every=sync_every,
            max_attempts=max_attempts,
            timeout=timeout,
            estimator=estimator,
            truncation=truncation,
            support_capacity=support_capacity,
            log=log,
            vocab=vocab,
            empty_streak=empty_streak,
            filter_uniform=filter_uniform,
            reference=reference,
            carry_over=carry_over,
            waste_budget=waste_budget,
            hedge=hedge,
            narrow=narrow,
            align_starts=align_starts,
        )
        object.__setattr__(self, "_inner", inner)
        finalizer = weakref.finalize(self, inner.dropped)
        # At interpreter exit the process frees the thread; joining it could wait on a stuck
        # environment step.
        finalizer.atexit = False
        object.__setattr__(self, "_finalizer", finalizer)

    # Everything else (records, events, settings such as long_wait) lives on the workings.
    def __getattr__(self, name: str):
        if name == "_inner":  # not built (a copy made without __init__): no workings to ask
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __reduce_ex__(self, protocol):
        """Refuse copy, deepcopy and pickle, which would otherwise recurse without end."""
        raise TypeError(
            "a RolloutScheduler cannot be copied or pickled: it owns the rollouts in flight on "
            "its source; build another from the same arguments"
        )

    def __setattr__(self, name: str, value) -> None:
        """Set `pool` or `long_wait`, checked; refuse any other name, which nothing reads."""
        if name not in _SETTINGS:
            raise AttributeError(
                f"RolloutScheduler has no setting {name!r}: the settings assigned after "
                f"construction are {', '.join(_SETTINGS)}; the rest are constructor arguments"
            )
        _SETTINGS[name](value)
        setattr(self._inner, name, value)

    def tasks(self, dataset: Dataset) -> Dataset:
        """dataset with a training stream that registers each task batch ahead of the step.

        Opening the stream again, as a resume does, cancels every rollout the previous stream
        left in flight.
        """
        return self._inner.tasks(dataset)

    def __call__(self, batch: Batch, variables: Variables, updates: int) -> dict[str, np.ndarray]:
        """Hand batch over from the trainer's thread; return its packed, rescored rows."""
        return self._inner(batch, variables, updates)

    async def step(self, batch: Batch, variables: Variables, updates: int) -> dict[str, np.ndarray]:
        """The same call as `scheduler(batch, variables, updates)`, inside `async with`."""
        return await self._inner.step(batch, variables, updates)

    def status(self) -> SchedulerStatus:
        """Which groups are in play, which batch the trainer waits on, how old each rollout is
        and what it is doing, and the most frequent errors of failed sessions."""
        return self._inner.status()

    def checkpoint_state(self) -> dict:
        """What a trainer's checkpoint keeps for this scheduler: the id its next group takes
        (the least of the groups of batches not yet handed over, which a resumed stream reads
        again), and under carry_over the carried groups' tasks as [stream position, index in
        its batch], and the stale cycles each has run (`{"carried": [...], "stale": [...],
        "next_group": n}`, JSON values)."""
        return self._inner.checkpoint_state()

    def restore_state(self, state: dict) -> None:
        """Take a checkpoint's `checkpoint_state` before the stream is opened again: the
        reopened stream's groups are numbered from its `next_group` on (so a `Sampling(seed=)`
        source draws the keys the checkpointed run would have: each call's is a function of its
        label), and its first call submits the carried groups' tasks again, read from the
        dataset at their positions, as carried groups whose stale cycles count on from the
        checkpoint's. A state without `next_group` numbers from 0.

        Raises:
            ValueError: when state is not what checkpoint_state writes.
        """
        self._inner.restore_state(state)

    def close(self) -> None:
        """Cancel every rollout in flight; the source belongs to the caller."""
        self._finalizer.detach()
        self._inner.close()

    def __enter__(self) -> RolloutScheduler:
        """`with scheduler:` around the synchronous facade's calls closes it at the block's
        end: its trio thread runs until close(), holding the source and what is in flight.

        Raises:
            RuntimeError: when the scheduler is closed already.
        """
        self._inner.check_open()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    async def __aenter__(self) -> RolloutScheduler:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info) -> bool | None:
        self._finalizer.detach()  # the block's end closes the workings
        return await self._inner.__aexit__(*exc_info)
