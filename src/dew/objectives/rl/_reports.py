"""What the scheduler says when a run goes wrong without failing: the errors its sessions fail
with, a streak of calls that trained on nothing, groups cut for room, and a chain too long for
any row.

Each reporter keeps only what its report needs, and logs under the scheduler's public module.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Sequence

from dew.objectives.rl._admission import LogEvent
from dew.objectives.rl._records import SchedulerRecord
from dew.objectives.rl.sessions import Session, chains

logger = logging.getLogger("dew.objectives.rl.scheduler")


class EmptyStreak:
    """Warns once per streak of `length` calls in a row that trained on nothing, with what
    happened to their groups and the errors most often behind it; `length` None never warns.

    A call trains on nothing when no group reaches the gradient (every group cut, abandoned or
    failed, or discarded as uniform), or when every group it trained scored alike: each
    advantage is then 0, and the rewards teach the policy nothing (a verifier that gives every
    rollout the same score, or a zero-sum game's summed reward, trains for good this way).
    """

    def __init__(self, length: int | None, truncation: str = "mask"):
        self.length, self.truncation = length, truncation
        self._streak: list[tuple[SchedulerRecord, tuple[LogEvent, ...]]] = []

    def observe(self, record: SchedulerRecord, events: tuple[LogEvent, ...]) -> None:
        """Take one call's record and event log; warn when they complete a streak."""
        if self.length is None:
            return
        if record.groups and not _all_uniform(record):
            self._streak.clear()
            return
        if len(self._streak) == self.length:
            return  # this streak was reported
        self._streak.append((record, events))
        if len(self._streak) == self.length:
            logger.warning(self._describe())

    def _describe(self) -> str:
        records = [r for r, _ in self._streak]
        alike = [r for r in records if r.groups]
        truncated = [r.metrics.get("status/truncated", 0.0) for r in alike]
        if (
            alike == records
            and min(truncated) > 0
            and not any(r.metrics.get("tokens/trained") for r in alike)
        ):
            masked = (
                "truncation='mask' trains none of them, and " if self.truncation == "mask" else ""
            )
            return (
                f"{len(records)} calls in a row trained on nothing (updates "
                f"{records[0].updates}..{records[-1].updates}): no token of theirs trained, and "
                f"{sum(truncated) / len(truncated):.0%} of the rollouts they delivered ended "
                f"TRUNCATED: {masked}one cut before its first call has no token to train. A "
                "context or max_tokens too small for the task, or episodes past their turn "
                "limit, do this (status/truncated and masked/<reason> in the record)"
            )
        if len(alike) == len(records):
            means = ", ".join(f"{r.metrics.get('reward/mean', math.nan):.3g}" for r in alike)
            return (
                f"{len(records)} calls in a row trained on nothing (updates "
                f"{records[0].updates}..{records[-1].updates}): every group they trained "
                f"({sum(r.groups for r in alike)}) had rewards all equal, so every advantage "
                f"was 0 (mean reward per call: {means}). A verifier that gives every rollout "
                "the same score, tasks all too easy or too hard for the policy, or a zero-sum "
                "game's summed reward does this"
            )
        resubmitted = collections.Counter()
        for r in records:
            resubmitted.update(r.resubmitted)
        logged = [e for _, log in self._streak for e in log]
        cuts = collections.Counter(e.reason for e in logged if e.kind == "cut")
        errors = collections.Counter(
            e.error for e in logged if e.kind == "failed" and e.error is not None
        )
        counted = ", ".join(f"{cause} {n}" for cause, n in resubmitted.items() if n) or "none"
        text = (
            f"{len(records)} calls in a row trained on nothing (updates {records[0].updates}.."
            f"{records[-1].updates}): cut {sum(cuts.values())}"
            + "".join(f" ({reason} {n})" for reason, n in sorted(cuts.items()))
            + f", abandoned {sum(r.abandoned for r in records)}, resubmitted: {counted}"
        )
        uniform = sum(
            r.metrics.get("groups/uniform", 0) - r.metrics.get("groups/uniform_trained", 0)
            for r in records
        )
        if uniform:
            text += (
                f"; filter_uniform discarded {uniform:.0f} groups whose rewards were all equal "
                "(every rollout of a task scored alike: the tasks are too easy or too hard "
                "for the policy)"
            )
        if alike:
            text += (
                f"; {len(alike)} of the calls trained only groups whose rewards were all equal "
                "(advantage 0)"
            )
        if errors:
            text += "; most frequent errors: " + ", ".join(
                f"{error!r} x{n}" for error, n in errors.most_common(3)
            )
        return text


def _all_uniform(record: SchedulerRecord) -> bool:
    """Whether every group a call trained had rewards all equal (advantage 0)."""
    return record.metrics.get("groups/uniform_trained", 0.0) >= record.groups


class OverBudget:
    """Under admit="auto": warns once per streak of `length` calls in a row at which no cut kept
    the run within its waste budget, with the share the run has thrown away. Such calls take
    the cut estimated to waste least (without carry_over, none), so what is still wasted is
    not the cut's: rollouts still running when `max_lag` passes (the staleness window's cost
    on a heavy tail), hedges, failures. The budget then
    cannot hold at this `max_lag`, and the user should hear it rather than read it off
    `auto/over_budget`."""

    def __init__(self, budget: float, max_lag: int, length: int = 10):
        self.budget, self.max_lag, self.length = budget, max_lag, length
        self._streak = 0

    def observe(self, record: SchedulerRecord) -> None:
        """Take one call's record; warn when it completes a streak."""
        if not record.metrics.get("auto/over_budget"):
            self._streak = 0
            return
        self._streak += 1
        if self._streak == self.length:
            logger.warning(
                "admit='auto': %d calls in a row, through updates %d, found no cut within "
                "waste_budget %.3g and took the least wasteful; the run has thrown away %.1f%% "
                "of its slot-seconds so far. What is still wasted is not the cut's but the "
                "staleness window's (rollouts still running when max_lag %d passes), hedges' "
                "and failures': raise max_lag or waste_budget, or expect the run to stay over "
                "its budget",
                self.length,
                record.updates,
                self.budget,
                100 * record.metrics.get("auto/slot_wasted", math.nan),
                self.max_lag,
            )


class NoRoom:
    """Warns at the 1st, 10th, 100th ... group cut for room (`no_room`: its chains do not fit
    the step's `rows` beside the groups before it), naming the first one's task and chains: a
    group left out is lost work, and a source whose rollouts make more chains than its run was
    sized for (an episode's several agents, a game's players) has one cut every step."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        self._cut = 0

    def observe(self, groups: Sequence[Sequence[Session]], cuts) -> None:
        """Take one call's delivered groups and pack's cuts; warn where the count is a power
        of ten."""
        for cut in cuts:
            if cut.reason != "no_room":
                continue
            self._cut += 1
            if not math.log10(self._cut).is_integer():
                continue
            group = groups[cut.group]
            logger.warning(
                "task %r group %d: its %d rollouts' %d chains did not fit the step's %d rows "
                "(width %d) beside the groups before it, so it is cut (%d groups so far, the "
                "record's `cut`); rollouts of more chains than the run's rows were sized for "
                "(several agents or players an episode) do this: give the run more rows",
                group[0].task.name,
                group[0].label.group,
                len(group),
                sum(len(chains(s)) for s in group),
                self.rows,
                self.width,
                self._cut,
            )


class TooLongChain:
    """Warns, once, of the first chain longer than a row of `width`: its group can never be
    packed, nor can any like it, so `width` is likely too small for the task."""

    def __init__(self, width: int):
        self.width = width
        self._reported = False

    def observe(self, groups: Sequence[Sequence[Session]], cuts) -> None:
        """Take one call's delivered groups and pack's cuts; warn at the first too-long one."""
        if self._reported:
            return
        for cut in cuts:
            if cut.reason != "too_long":
                continue
            longest, session = max(
                ((len(chain), s) for s in groups[cut.group] for chain in chains(s)),
                key=lambda found: found[0],
            )
            self._reported = True
            logger.warning(
                "task %r %s: a chain of %d tokens is longer than a row (width %d), so its group "
                "is cut; raise width, or bound the task's length",
                session.task.name,
                session.label,
                longest,
                self.width,
            )
            return
