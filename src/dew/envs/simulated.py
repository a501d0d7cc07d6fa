"""Simulated rollouts: seeded sessions on trio's clock, served by a simulated engine.

For notebooks, benchmarks and replay tests of the scheduler, which need realistic load (heavy-tailed
durations, a status mix, multi-turn calls that mostly merge into chains, weight pushes landing
mid-rollout) without a model. Everything a session is — status, call count, token arrays, reward,
how long each call decodes — is a pure function of (config seed, task name, label); only the
versions its calls are served under and the time it finishes depend on the engine, and those are
a pure function of trio's clock, never of the order in which trio runs ready tasks.

The engine decodes at most `slots` calls at once. A call that arrives waits until the instant it
arrived in has settled (every trio task blocked, `trio.testing.wait_all_tasks_blocked`), so that
every call arriving and every weight push landing at that instant is known; free slots then go to
the waiting calls in order of (arrival time, caller's key), and each starts under the version
served at that moment.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import itertools
import math
import numbers

import attrs
import numpy as np
import trio
from trio.testing import wait_all_tasks_blocked

from dew._checks import as_tuple, at_least, check_int, int_at_least, positive, probability
from dew.data import Task
from dew.objectives.rl._session import waiting_on
from dew.objectives.rl.sessions import (
    TRUNCATION_REASONS,
    Call,
    Label,
    Session,
    Status,
    note_progress,
)

# The reward's named parts: a correct answer is worth CORRECT, a well-formed one up to FORMAT.
CORRECT = 0.8
FORMAT = 0.2
# Mean of the exponential that behaviour log-probs are drawn from (minus), in nats per token.
LOGPROB_SCALE = 0.5


def stable_hash(text: str) -> int:
    """A 64-bit hash of `text` that is the same in every process and run.

    Python's own `hash` of a string is salted per process, so it cannot seed anything replayable.
    """
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _span(low: int):
    def span(instance, attribute, value):
        if (
            not isinstance(value, tuple)
            or len(value) != 2
            or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value)
        ):
            raise ValueError(f"{attribute.name} must be two ints (low, high), got {value!r}")
        if value[0] < low:
            raise ValueError(f"{attribute.name} low must be >= {low}, got {value!r}")
        if value[0] > value[1]:
            raise ValueError(f"{attribute.name} low must be <= high, got {value!r}")

    return span


def _observed_weight(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


def _seconds(instance, attribute, value):
    if not all(isinstance(s, int | float) and 0 <= s < math.inf for s in value):
        raise ValueError(f"{attribute.name} must be finite numbers >= 0, got {value!r}")


def _pool(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


@attrs.frozen
class ObservedRollout:
    """One rollout as a trace saw it, for a simulation that resamples observed rollouts.

    Args:
        seconds: the seconds each of its calls decoded, in order (at least one, unless it
            failed in its first call).
        status: how it ended; CANCELLED is not a way a rollout ends by itself.
        truncation: why a TRUNCATED rollout stopped (one of TRUNCATION_REASONS), else None.
        failing: for an INFRA_ERROR, the seconds its failing call ran before it failed.
        weight: its share of the resampling, relative to the others' of its pool (a censored
            sample's weight is spread over the longer ones: see `dew.calibrate`).
        pool: which pool it is resampled from (see SimulatedConfig.observed).
        run: which recorded run it comes from: a pool holding several runs' rollouts gives each
            task the rollouts of one run, so that a task's rollouts stay one recorded group's.

    Raises:
        ValueError: naming the field and the value that breaks it.
    """

    seconds: tuple[float, ...] = attrs.field(converter=tuple, validator=_seconds)
    status: Status = attrs.field(converter=Status)
    truncation: str | None = None
    failing: float | None = None
    weight: float = attrs.field(default=1.0, validator=_observed_weight)
    pool: int = attrs.field(default=0, validator=_pool)
    run: int = attrs.field(default=0, validator=_pool)

    def __attrs_post_init__(self):
        if self.status is Status.CANCELLED:
            raise ValueError("status must be how a rollout ends by itself, got CANCELLED")
        if (self.truncation is not None) != (self.status is Status.TRUNCATED):
            raise ValueError(
                f"truncation must be given exactly for a TRUNCATED rollout, got "
                f"{self.truncation!r} for {self.status.name}"
            )
        if self.truncation is not None and self.truncation not in TRUNCATION_REASONS:
            raise ValueError(
                f"truncation must be one of {TRUNCATION_REASONS}, got {self.truncation!r}"
            )
        if (self.failing is not None) != (self.status is Status.INFRA_ERROR):
            raise ValueError(
                f"failing must be given exactly for an INFRA_ERROR rollout, got "
                f"{self.failing!r} for {self.status.name}"
            )
        if not self.seconds and self.status is not Status.INFRA_ERROR:
            raise ValueError(f"a {self.status.name} rollout makes at least one call")

    @property
    def duration(self) -> float:
        """Its model time: every call's seconds, the failing one's included."""
        return sum(self.seconds) + (self.failing or 0.0)


# Its hash is kept: `_draft`, cached, hashes it at every call, and `observed` may be long.
@attrs.frozen(cache_hash=True)
class SimulatedConfig:
    """How simulated sessions are drawn.

    Ranges are inclusive `(low, high)` and drawn uniformly. A later call's prompt either extends
    the previous call's prompt and completion by a few environment tokens (so the calls merge into
    one chain) or is a fresh prompt. The status is drawn from the given probabilities; the rest is
    COMPLETED. Each task has a difficulty, drawn from (seed, task name) alone and shared by all its
    rollouts, that is its chance of a correct answer: groups of one task agree more than groups of
    different tasks, as real ones do. The reward is the sum of its components, `correct`
    (0 or 0.8; always 0 for AGENT_ERROR) and `format` (uniform in [0, 0.2]).

    Args:
        seed: seeds every draw, together with the task name and the label.
        duration_mean: mean seconds of a whole rollout's model time (lognormal); an INFRA_ERROR
            rollout stops partway through it.
        duration_sigma: sigma of the duration's log: the tail's weight.
        calls: model calls per session; a `turns` truncation makes the most.
        prompt_tokens: length of a fresh prompt.
        completion_tokens: length of a completion; a `length` truncation's last one is the longest.
        env_tokens: environment tokens a merging call's prompt adds after the previous completion.
        merge_share: chance that a later call's prompt extends the previous call's tokens.
        vocab: token ids are drawn from [0, vocab).
        infra_error: share of INFRA_ERROR sessions: they end partway through a call, unscored.
        agent_error: share of AGENT_ERROR sessions: scored, never correct.
        truncated: share of TRUNCATED sessions, with a uniformly drawn reason.
        truncated_unscored: share of truncations that carry no reward.
        support_k: when set, each completion token carries a top-k support of k ids, the sampled
            one among them.
        observed: when given, each session resamples one of these rollouts (by its weight) for
            its status, truncation, calls and their seconds, instead of drawing them from
            duration_mean, duration_sigma, calls and the status shares; its tokens and reward
            are drawn as ever. A task draws from one pool: with pools numbered below P (the
            largest number + 1), the task named by integer id n draws from pool n mod P, any
            other from the one its name's stable hash picks; a pool with no rollout draws from
            them all. A pool holding the rollouts of several runs (`ObservedRollout.run`) gives
            each task one run's, that run picked by the seed and the task. Consecutive tasks
            thus draw from consecutive pools, and `dew.calibrate` makes each recorded group a
            pool, numbered as the run's batches held them (the n-th group of each of several
            runs in pool n): a simulated run then meets the recorded runs' drift over training,
            the kinship of one task's rollouts, and each run in turn.

    Raises:
        ValueError: naming the field, its bound and the value that broke it.
    """

    seed: int = attrs.field(default=0, validator=int_at_least(0))
    duration_mean: float = attrs.field(default=10.0, validator=positive)
    duration_sigma: float = attrs.field(default=1.0, validator=at_least(0.0))
    calls: tuple[int, int] = attrs.field(default=(1, 4), converter=as_tuple, validator=_span(1))
    prompt_tokens: tuple[int, int] = attrs.field(
        default=(8, 32), converter=as_tuple, validator=_span(1)
    )
    completion_tokens: tuple[int, int] = attrs.field(
        default=(4, 64), converter=as_tuple, validator=_span(1)
    )
    env_tokens: tuple[int, int] = attrs.field(
        default=(0, 8), converter=as_tuple, validator=_span(0)
    )
    merge_share: float = attrs.field(default=0.8, validator=probability)
    vocab: int = attrs.field(default=64, validator=int_at_least(1))
    infra_error: float = attrs.field(default=0.0, validator=probability)
    agent_error: float = attrs.field(default=0.0, validator=probability)
    truncated: float = attrs.field(default=0.0, validator=probability)
    truncated_unscored: float = attrs.field(default=0.0, validator=probability)
    support_k: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(int_at_least(1))
    )
    observed: tuple[ObservedRollout, ...] = attrs.field(default=(), converter=tuple)
    # Per pool in order, its rollouts' indices and cumulative weights, which resampling searches.
    _pools: tuple = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self):
        failing = self.infra_error + self.agent_error + self.truncated
        if failing > 1.0:
            raise ValueError(
                f"infra_error + agent_error + truncated must be <= 1, got {failing!r} "
                f"({self.infra_error} + {self.agent_error} + {self.truncated})"
            )
        if self.support_k is not None and self.support_k > self.vocab:
            raise ValueError(f"support_k must be <= vocab {self.vocab}, got {self.support_k}")
        for i, rollout in enumerate(self.observed):
            if not isinstance(rollout, ObservedRollout):
                raise ValueError(
                    f"observed[{i}] must be an ObservedRollout, got {type(rollout).__name__}"
                )
        count = max((rollout.pool for rollout in self.observed), default=-1) + 1
        members: list[dict[int, list[int]]] = [{} for _ in range(count)]
        for i, rollout in enumerate(self.observed):
            members[rollout.pool].setdefault(rollout.run, []).append(i)
        every = {0: list(range(len(self.observed)))}
        # Per pool, per run found in it (in the runs' order): indices and cumulative weights.
        pools = tuple(
            tuple(
                (indices, np.cumsum([self.observed[i].weight for i in indices]))
                for _, indices in sorted((m or every).items())
            )
            for m in members
        )
        object.__setattr__(self, "_pools", pools)


# A rollout's draft is asked for twice (its run and its `model_time`), and `dew simulate` and
# `dew tune` simulate one workload under several settings, whose rollouts are mostly the same
# (task, label): drawn once, they are a third of the default table's time less. Drafts are
# pure functions of their arguments and never changed (runs evolve their calls' versions).
@functools.lru_cache(maxsize=2**14)
def _draft(
    config: SimulatedConfig, task: Task, label: Label
) -> tuple[Session, tuple[float, ...], float | None]:
    """Draw a session from (seed, task, label) alone: everything but its calls' versions.

    Its scalars are drawn first, in a fixed order, so changing the status mix leaves each
    rollout's total duration and (but for a `turns` truncation) call count as they were: common
    random numbers across configs.

    Returns:
        the session with every call's version 0; the seconds each of its calls decodes; and, for
        an INFRA_ERROR, the seconds the failing call decodes before it fails (else None).
    """
    rng = np.random.default_rng(
        [config.seed, stable_hash(task.name), label.group, label.sample, label.attempt]
    )
    status_u, unscored_u, reason_u, fail_at, fail_frac, correct_u, format_u = rng.random(7)
    if config.observed:
        status, truncation, seconds, failing = _resample(config, task, rng.random())
        made = len(seconds)
        n = made + (failing is not None)
    else:
        status, truncation, n, seconds = _parametric(config, rng, status_u, reason_u)
        made = int(fail_at * n) if status is Status.INFRA_ERROR else n
        failing = seconds[made] * float(fail_frac) if status is Status.INFRA_ERROR else None
        seconds = seconds[:made]

    calls = []
    for i in range(made):
        if i > 0 and rng.random() < config.merge_share:
            previous = calls[-1]
            size = int(rng.integers(*config.env_tokens, endpoint=True))
            env = rng.integers(0, config.vocab, size, dtype=np.int32)
            prompt = np.concatenate([previous.prompt, previous.completion, env])
        else:
            size = int(rng.integers(*config.prompt_tokens, endpoint=True))
            prompt = rng.integers(0, config.vocab, size, dtype=np.int32)
        longest = truncation == "length" and i == n - 1
        size = (
            config.completion_tokens[1]
            if longest
            else int(rng.integers(*config.completion_tokens, endpoint=True))
        )
        completion = rng.integers(0, config.vocab, size, dtype=np.int32)
        logprobs = (-rng.exponential(LOGPROB_SCALE, size)).astype(np.float32)
        support = None
        if config.support_k is not None:
            # k - 1 distinct ids from the vocab less the sampled token, shifted past it.
            others = rng.random((size, config.vocab - 1)).argsort(axis=1)[:, : config.support_k - 1]
            others = others + (others >= completion[:, None])
            kept = np.sort(np.concatenate([completion[:, None], others], axis=1), axis=1)
            support = tuple(row.astype(np.int32) for row in kept)
        calls.append(Call(prompt, completion, logprobs, version=0, support=support))

    if status is Status.INFRA_ERROR:
        session = Session(
            status,
            calls,
            error=f"simulated infrastructure error in call {made} of {n}",
            task=task,
            label=label,
        )
        return session, seconds, failing

    difficulty = np.random.default_rng([config.seed, stable_hash(task.name)]).random()
    correct = CORRECT if status is not Status.AGENT_ERROR and correct_u < difficulty else 0.0
    components = {"correct": correct, "format": FORMAT * float(format_u)}
    scored = not (status is Status.TRUNCATED and unscored_u < config.truncated_unscored)
    session = Session(
        status,
        calls,
        reward=sum(components.values()) if scored else None,
        components=components if scored else {},
        truncation=truncation,
        error="simulated agent error" if status is Status.AGENT_ERROR else None,
        task=task,
        label=label,
    )
    return session, seconds, None


def _parametric(
    config: SimulatedConfig, rng: np.random.Generator, status_u: float, reason_u: float
) -> tuple[Status, str | None, int, tuple[float, ...]]:
    """A rollout's status, truncation, planned call count and each planned call's seconds,
    drawn from the config's lognormal duration, call range and status shares."""
    mu = math.log(config.duration_mean) - config.duration_sigma**2 / 2
    total = rng.lognormal(mu, config.duration_sigma)
    n = int(rng.integers(config.calls[0], config.calls[1] + 1))
    infra = config.infra_error
    agent = infra + config.agent_error
    if status_u < infra:
        status = Status.INFRA_ERROR
    elif status_u < agent:
        status = Status.AGENT_ERROR
    elif status_u < agent + config.truncated:
        status = Status.TRUNCATED
    else:
        status = Status.COMPLETED
    truncation = (
        TRUNCATION_REASONS[int(reason_u * len(TRUNCATION_REASONS))]
        if status is Status.TRUNCATED
        else None
    )
    if truncation == "turns":
        n = config.calls[1]
    return status, truncation, n, tuple(float(s) for s in total * rng.dirichlet(np.ones(n)))


def _resample(
    config: SimulatedConfig, task: Task, u: float
) -> tuple[Status, str | None, tuple[float, ...], float | None]:
    """The observed rollout of the task's pool that uniform draw `u` picks by weight: its
    status, truncation, call seconds and failing seconds."""
    key = int(task.name) if task.name.isdigit() else stable_hash(task.name)
    runs = config._pools[key % len(config._pools)]
    pick = 0 if len(runs) == 1 else np.random.default_rng([config.seed, key]).integers(len(runs))
    indices, weights = runs[pick]
    index = int(np.searchsorted(weights, u * weights[-1], side="right"))
    picked = config.observed[indices[min(index, len(indices) - 1)]]
    return picked.status, picked.truncation, picked.seconds, picked.failing


def _slots(instance, attribute, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"slots must be None or an int >= 1, got {value!r}")


@attrs.define(eq=False)
class _Waiter:
    """A call waiting for a slot: granted with the version it starts under, or gone (cancelled)."""

    wake: trio.Event = attrs.Factory(trio.Event)
    granted: bool = False
    gone: bool = False
    version: int = 0


@attrs.define(eq=False)
class SimulatedEngine:
    """A simulated inference engine: a Publisher whose calls occupy decode slots on trio's clock.

    It serves a weights version (0 until the first push) and decodes at most `slots` calls at
    once; the others queue. Slots are granted deterministically: once the instant a call arrived
    in has settled (all trio tasks blocked), free slots go to waiting calls in order of (arrival
    time, key), and a call starts under the version served at that moment. A caller that itself
    waits with `wait_all_tasks_blocked` may therefore see calls of that instant not yet started.

    Args:
        slots: how many calls decode at once; None for no limit.

    Attributes:
        version: the weights version served now.
        pushes: every `load` as (trio time, version); the time is None outside a trio run.
        busy: calls holding a slot now.
        granted: calls that have got a slot so far.
        queued: the seconds those calls waited for their slots, summed.
    """

    slots: int | None = attrs.field(default=None, kw_only=True, validator=_slots)
    version: int = attrs.field(default=0, init=False)
    pushes: list[tuple[float | None, int]] = attrs.field(factory=list, init=False)
    busy: int = attrs.field(default=0, init=False)
    granted: int = attrs.field(default=0, init=False)
    queued: float = attrs.field(default=0.0, init=False)
    # A heap of (arrival time, key, arrival count, waiter); the count only keeps equal keys from
    # comparing waiters, so keys must be unique among calls waiting at once to stay deterministic.
    _queue: list = attrs.field(factory=list, init=False)
    _arrivals: itertools.count = attrs.field(factory=itertools.count, init=False)

    @property
    def waiting(self) -> int:
        """Calls queued for a slot now."""
        return sum(not entry[-1].gone for entry in self._queue)

    def load(self, variables, version: int) -> None:
        """Serve weights `variables` (ignored) under `version` from now on.

        Raises:
            ValueError: if version is not an int >= 0.
        """
        check_int("version", version, low=0)
        try:
            now = trio.current_time()
        except RuntimeError:
            now = None
        self.version = int(version)
        self.pushes.append((now, int(version)))

    async def call(self, seconds: float, key) -> int:
        """Decode one call: wait for a slot, then hold it for `seconds` of trio time.

        Args:
            seconds: how long the call decodes once it has a slot.
            key: orders calls that arrive at the same instant, e.g. (task name, group, sample,
                attempt); keys must compare with each other and be unique among waiting calls.

        Returns:
            the version served when the call started, after it got its slot.

        Raises:
            ValueError: if seconds is negative or not finite.
            trio.Cancelled: when the caller's scope is cancelled; its slot (or its place in the
                queue) is freed first.
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        waiter = _Waiter()
        heapq.heappush(self._queue, (trio.current_time(), key, next(self._arrivals), waiter))
        try:
            while not waiter.granted:
                await wait_all_tasks_blocked()
                self._dispatch()
                if not waiter.granted:
                    waiter.wake = trio.Event()
                    await waiter.wake.wait()
        except BaseException:
            if waiter.granted:
                self._release()
            else:
                waiter.gone = True
                # It may have been woken to dispatch for a freed slot; hand that on.
                self._wake_first()
            raise
        # The rollout's lag counts from here while it runs (note_progress), not its submission.
        note_progress(version=waiter.version)
        try:
            await self._decode(seconds)
        finally:
            self._release()
        return waiter.version

    async def _decode(self, seconds: float) -> None:
        """Hold a slot for `seconds` of decoding: trio's clock alone here; an engine that shares
        a CPU with the trainer (`dew.simulate`) stretches them while the trainer works."""
        await trio.sleep(seconds)

    def _dispatch(self) -> None:
        while self._queue and (self.slots is None or self.busy < self.slots):
            arrival, *_, waiter = heapq.heappop(self._queue)
            if waiter.gone:
                continue
            self.busy += 1
            self.granted += 1
            self.queued += trio.current_time() - arrival
            waiter.granted = True
            waiter.version = self.version
            waiter.wake.set()

    def _release(self) -> None:
        self.busy -= 1
        self._wake_first()

    def _wake_first(self) -> None:
        """Wake the first waiting call, to dispatch once the instant settles: a slot may be free."""
        while self._queue and self._queue[0][-1].gone:
            heapq.heappop(self._queue)
        if self._queue:
            self._queue[0][-1].wake.set()


def _simulated_config(instance, attribute, value):
    if not isinstance(value, SimulatedConfig):
        raise TypeError(
            f"config must be a SimulatedConfig (e.g. SimulatedConfig(seed=1)), "
            f"got {type(value).__name__}"
        )


@attrs.frozen(eq=False)
class SimulatedSource:
    """A SessionSource of simulated sessions, decoded on a SimulatedEngine.

    A session is drawn from (config seed, task name, label) alone; its calls then decode one
    after another on the engine, each waiting for a slot and stamped with the version the engine
    served when it started, so a weight push mid-rollout gives its later calls a newer version.
    The engine's key for its calls is (task name, group, sample, attempt).

    Args:
        engine: decodes the calls and serves their versions.
        config: how sessions are drawn.

    Raises:
        TypeError: when config is not a SimulatedConfig.
    """

    engine: SimulatedEngine
    config: SimulatedConfig = attrs.field(default=SimulatedConfig(), validator=_simulated_config)

    async def run(self, task: Task, label: Label) -> Session:
        """Run one rollout of `task` on trio's clock and return its session.

        Raises:
            ValueError: if a label field is negative.
            trio.Cancelled: when the caller's scope is cancelled; the engine slot is freed.
        """
        for field in ("group", "sample", "attempt"):
            if getattr(label, field) < 0:
                raise ValueError(f"label {field} must be >= 0, got {label}")
        session, seconds, failing = _draft(self.config, task, label)
        key = (task.name, label.group, label.sample, label.attempt)
        calls = []
        for call, decode in zip(session.calls, seconds, strict=True):
            note_progress(0, calls=1)  # a call begun counts as a turn, finished or not
            with waiting_on("the engine"):
                version = await self.engine.call(decode, key)
            note_progress(len(call.completion))
            calls.append(attrs.evolve(call, version=version))
        if failing is not None:
            await self.engine.call(failing, key)
        return attrs.evolve(session, calls=calls)

    def model_time(self, task: Task, label: Label) -> float:
        """The seconds the rollout of (task, label) decodes on the engine, slot queueing left
        out: drawn from (config seed, task name, label) alone, like the rest of its session."""
        _, seconds, failing = _draft(self.config, task, label)
        return sum(seconds) + (failing or 0.0)
