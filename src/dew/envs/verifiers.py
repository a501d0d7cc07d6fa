"""`verifiers` environments as dew tasks: each rollout plays one episode of the environment, its
model calls recorded by dew's gateway, and trains on the environment's own rewards.

`Verifiers.parse("NAME,key=value...")` loads an environment of the optional `verifiers`
package (`pip install 'dew[verifiers]'`) the way verifiers itself does (`verifiers.v1`): NAME is
an installed taskset package (`EnvConfig.taskset.id`), the options are its taskset config, and
the `Env` is the taskset's own or verifiers' single-agent one. `Verifiers(env)` takes an `Env` a
user built. Each dew task is one of the taskset's tasks, by index.

A rollout (`VerifiersSource`) opens a session on a `dew.gateway.Gateway` and runs the
environment's own episode (`Env.run_episode`: its setup, its protocol between agents, user turns
and tools, its rewards) with a `ModelContext` whose client is the session's private URL, so
every model call the environment's agents make reaches dew's engine through the gateway and is
recorded token in / token out. verifiers is asyncio and dew runs trio: episodes run on an
asyncio loop in a thread of their own, one per trio run (`_verifiers_loop`).

Offline and in-process. verifiers' own harnesses install their program with `uv` (from the
network) into a sandbox; dew runs each agent with `ChatHarness` instead (harness id
`dew-chat`, built in `_verifiers_harness`): the same chat loop, in-process, offering the task's
MCP tools. An environment is
refused at load, naming what it needs, when it pins a harness other than `dew-chat`, runs an
agent or a tool server outside a local subprocess runtime (docker, prime, modal: a sandbox
service), needs a container for its tasks, or keeps taskset-wide tool servers or resources of
its own (`Env.start`); a taskset whose tasks cannot load offline (a dataset to download) is
refused naming the error. Tasks load, and episodes run, inside `dew.envs._offline`'s
`no_downloads`: Hugging Face datasets and hub offline, nltk's downloader answering from the
data in place or refusing by name.

How an episode's outcome becomes a dew status:

- COMPLETED: the episode finished without error (a `@vf.stop` that ended it is the
  environment's own end, not a truncation); reward the sum of its traces' weighted rewards.
- TRUNCATED: a trace hit one of verifiers' limits: `turns` (`max_turns`), `length`
  (`max_output_tokens`, or the last reply cut by its token budget), `context`
  (`max_input_tokens`, `max_total_tokens`, a failed compaction), `wall_clock` (a stage's
  timeout, the episode's or `wall_clock`): scored as verifiers scored it. Or dew cut the
  episode at once: its gateway (`turns` past `max_calls`, `context` for a prompt past the
  gateway's context) or `wall_clock`: reward 0, which verifiers never gave (resubmitting the
  same overflowing episode would only cut it again).
- AGENT_ERROR: the environment raised, in its protocol, its hooks, its harness or its tools (an
  `Error` on the episode or a trace): `error` is its type and message (the first failure), the
  reward what verifiers recorded (0 where scoring did not run). So is an episode that raised
  past verifiers' own boundaries (asyncio's CancelledError, which cancels the episode from
  inside, a SystemExit: reward 0), and a trace whose reward is not a finite number (a reward
  function that returned nan or inf): that trace counts 0, and `error` names the reward.
- INFRA_ERROR: dew's engine failed a call, or the environment's rubric raised (a `@reward` or
  `@metric` of its task: verifiers' `TaskError: task T scoring: ...`): the environment's own
  failure, not the agent's, so its reply is not trained on a reward of 0 it did not earn (the
  scheduler resubmits the rollout, and abandons a group whose attempts keep failing).

An environment's errors are counted by kind, their exception's type (`VerifiersSource.errors`,
each kind kept with its first full text), and reported as a warning of this module's logger at
their kind's 1st, 10th, 100th ... time, the way the scheduler reports its sessions' errors: a
broken environment shows in the log, not only as rewards of 0, and an error that quotes each
reply is one line, not one a rollout.

Each trace's rewards (their unweighted scores, by name) and metrics (`metric/NAME`) are the
session's reward components, prefixed with the agent's name when the episode has several
traces, numbered where agents share a name (best-of-n's attempts: `agent.0/`, `agent.1/`).

An episode of several traces gives each agent its own reward. Each trace is a seat named by
that prefix; verifiers sends each model call with its trace's id (`X-Session-ID`), which the
gateway records, so each call is tagged with its trace's seat (`Call.seat`), and the session's
`seats` hold the reward of each trace that recorded rewards: `pack` trains a seat's calls on
its reward against the same seat of the group's other rollouts, and a seat with no reward (a
judge, a simulated user) on nothing.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from dew._checks import int_at_least
from dew._errors import ErrorCounts, error_kind
from dew.data import ArrayDataset, Batch, Task
from dew.envs._offline import no_downloads
from dew.envs._verifiers_harness import _chat_harness_classes
from dew.envs._verifiers_loading import _import_verifiers
from dew.envs._verifiers_loop import _run_loop
from dew.envs._verifiers_outcome import SCORING, Outcome, outcome
from dew.envs.environment import describe
from dew.envs.harness import _gateway, _optional_count, _optional_seconds, play_in_session
from dew.objectives.rl.sessions import Call, Label, Session, Status

# In the order the API page shows them (`members_order: __all__`).
__all__ = [
    "PREFIX",
    "HARNESS_ID",
    "Verifiers",
    "Outcome",
    "VerifiersSource",
    "parse_spec",
    "load_env",
    "check_offline",
    "outcome",
]

logger = logging.getLogger(__name__)

PREFIX = "verifiers:"
"""How `dew train --env` names a verifiers environment: `verifiers:NAME[,key=value...]`."""

HARNESS_ID = "dew-chat"
"""The verifiers harness id of `ChatHarness` (its plugin module is `dew_chat`)."""


def _value(text: str) -> Any:
    """An option's value: JSON where it parses (numbers, booleans, lists), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _spec_parts(body: str) -> list[str]:
    """`body` split at its commas, except those inside a JSON value's brackets, braces or
    strings: `operators=["+","-"]` is one part."""
    parts, start, depth, quoted, escaped = [], 0, 0, False, False
    for at, char in enumerate(body):
        if escaped:
            escaped = False
        elif quoted:
            escaped, quoted = char == "\\", char != '"'
        elif char == '"':
            quoted = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            parts.append(body[start:at])
            start = at + 1
    return [*parts, body[start:]]


def parse_spec(spec: str, prefix: str) -> tuple[str, dict[str, Any]]:
    """`NAME[,key=value...]` (with or without `prefix`) as the name and its options; a value
    is JSON where it parses, and may hold commas inside its brackets, braces or strings
    (`operators=["+","-"]`, `task={"a": 1, "b": 2}`).

    Raises:
        ValueError: naming the part that is not `key=value`, or a repeated key.
    """
    name, *parts = _spec_parts(spec.removeprefix(prefix))
    options: dict[str, Any] = {}
    for part in parts:
        key, equals, value = part.partition("=")
        if not (equals and key.strip()):
            raise ValueError(f"{spec!r}: {part!r} is not key=value")
        if key.strip() in options:
            raise ValueError(f"{spec!r}: {key.strip()!r} is given twice")
        options[key.strip()] = _value(value.strip())
    return name.strip(), options


def _roles(config_type: type) -> list[str]:
    vf = _import_verifiers()
    return [
        name
        for name, field in config_type.model_fields.items()
        if isinstance(field.default, vf.AgentConfig)
    ]


def load_env(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """The verifiers `Env` of the taskset package `name` with taskset config `options`, each
    agent played by `ChatHarness` in a local subprocess runtime unless the taskset ships its
    own harness.

    Raises:
        ImportError: naming the package to install (verifiers, or the taskset), or the module
            the taskset's own import misses (`taskset_class`).
        ValueError: naming an option the taskset's config refuses, or a package of another
            verifiers API.
    """
    vf = _import_verifiers()
    from verifiers.v1.utils.loaders import default_harness_id, env_config_type

    from dew.envs._verifiers_loading import taskset_class

    taskset_class(name)  # verifiers' loader hides why a package does not load
    try:
        config_type = env_config_type(name)
        harness = None if default_harness_id(name) == name else {"id": HARNESS_ID}
        agent = {"runtime": {"type": "subprocess"}} | ({"harness": harness} if harness else {})
        data = {"taskset": {"id": name, **dict(options or {})}}
        data |= {role: agent for role in _roles(config_type)}
        config = vf.resolve_env_config(data)
        return vf.load_environment(config)
    except ModuleNotFoundError as error:
        raise ImportError(
            f"verifiers environment {name!r} is not installed: install its taskset package "
            f"(a package named {name.replace('-', '_')!r} exporting a vf.Taskset): {error}"
        ) from error
    except ValueError as error:  # pydantic's ValidationError is one
        raise ValueError(
            f"verifiers environment {name!r} refuses {dict(options or {})}: {error}"
        ) from None


def check_offline(env: Any) -> None:
    """Refuse an environment dew cannot run offline and in-process, naming what it needs.

    Raises:
        ValueError: see the module.
    """
    vf = _import_verifiers()
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import harness_class

    if not isinstance(env, vf.Env):
        raise ValueError(f"a verifiers environment must be a verifiers.v1.Env, got {env!r}")
    name = env.config.env_id or type(env).__name__
    taskset = env.taskset
    default_harness = vf.default_harness_id(env.config.taskset.id)
    for role, agent in agent_config_fields(env.config).items():
        harness = agent.harness.id if agent.harness is not None else default_harness
        own = harness == env.config.taskset.id
        if own and harness_class(harness).NEEDS_CONTAINER:
            raise ValueError(
                f"verifiers environment {name!r}: agent {role!r} runs the taskset's harness "
                f"{harness!r}, which needs a container"
            )
        if harness != HARNESS_ID and not own:
            raise ValueError(
                f"verifiers environment {name!r}: agent {role!r} runs harness {harness!r}, a "
                "program verifiers installs with uv from the network (into a sandbox); dew runs "
                f"agents in-process with harness {HARNESS_ID!r}"
            )
        if agent.runtime.type != "subprocess":
            raise ValueError(
                f"verifiers environment {name!r}: agent {role!r} runs in a "
                f"{agent.runtime.type!r} runtime, a sandbox service; dew runs agents in a local "
                "subprocess runtime"
            )
    task_type = type(taskset).task_type()
    if task_type.NEEDS_CONTAINER:
        raise ValueError(
            f"verifiers environment {name!r}: its tasks ({task_type.__name__}) need a container"
        )
    for toolset in task_type.toolsets(taskset.config.task):
        if toolset.config.url or toolset.config.runtime.type != "subprocess":
            where = toolset.config.url or f"a {toolset.config.runtime.type!r} runtime"
            raise ValueError(
                f"verifiers environment {name!r}: tool server {type(toolset).__name__} runs at "
                f"{where}, outside this machine; dew serves tools in local subprocesses"
            )
    if taskset.toolsets(taskset.config):
        raise ValueError(
            f"verifiers environment {name!r} keeps taskset-wide tool servers "
            f"({', '.join(type(t).__name__ for t in taskset.toolsets(taskset.config))}), which "
            "dew does not serve; give each task its own (Task.toolsets)"
        )
    if type(env).start is not vf.Env.start or type(env).stop is not vf.Env.stop:
        raise ValueError(
            f"verifiers environment {name!r} ({type(env).__name__}) serves resources of its own "
            "(Env.start/stop), which dew does not start"
        )


def _load_tasks(env: Any, size: int) -> list[Any]:
    """The first `size` tasks of the environment's taskset, loaded offline.

    Raises:
        ValueError: naming the taskset and the error when its tasks cannot load offline, or
            when it has fewer than `size`.
    """
    name = env.config.env_id
    try:
        with no_downloads():
            tasks = list(env.taskset.take(size))
    except ImportError as error:
        raise ValueError(
            f"verifiers environment {name!r} cannot load its tasks: {describe(error)} (a "
            "package its load() imports: install it)"
        ) from error
    except Exception as error:
        raise ValueError(
            f"verifiers environment {name!r} cannot load its tasks here: {describe(error)} "
            "(dew loads them offline: a dataset it would download must be in the Hugging Face "
            "cache first)"
        ) from error
    if len(tasks) < size:
        raise ValueError(
            f"verifiers environment {name!r} has {len(tasks)} tasks, fewer than the {size} "
            "asked for (training and held-out tasks together)"
        )
    return tasks


@attrs.frozen
class Verifiers:
    """A verifiers environment's tasks, their dataset, and its source.

    Args:
        env: a `verifiers.v1.Env` (`load_env`, or one a user built); checked by `check_offline`.
        size: tasks taken from its taskset; task ids are 0 .. size-1.

    Raises:
        ValueError: as `check_offline`, or when the tasks cannot load (`_load_tasks`).
    """

    env: Any = attrs.field()
    size: int = attrs.field(default=1000, kw_only=True, validator=int_at_least(1))
    _tasks: tuple[Any, ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self):
        check_offline(self.env)
        object.__setattr__(self, "_tasks", tuple(_load_tasks(self.env, self.size)))

    @classmethod
    def parse(cls, spec: str, *, size: int = 1000) -> Verifiers:
        """The environment `spec` names: `NAME[,key=value...]`, with or without `verifiers:`;
        values are JSON where they parse, else strings (`load_env`)."""
        name, options = parse_spec(spec, PREFIX)
        if not name:
            raise ValueError(f"{spec!r} names no verifiers environment")
        return cls(load_env(name, options), size=size)

    def task(self, index: int) -> Task:
        """Task `index`, with the taskset's task as its payload.

        Raises:
            ValueError: for an index outside 0 .. size-1.
        """
        if not 0 <= index < self.size:
            raise ValueError(
                f"{self.env.config.env_id}: task id {index} is outside 0 .. {self.size - 1}"
            )
        return Task(str(index), payload=self._tasks[index])

    def prompt(self, task: Task) -> list[dict[str, Any]]:
        """The first messages an agent sends for `task`: its system prompt and prompt (what
        sizes a run's context)."""
        from verifiers.v1.dialects.chat import message_to_wire

        data = task.payload.data
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            return [*messages, {"role": "user", "content": data.prompt}]
        return [*messages, *(message_to_wire(message) for message in data.prompt or [])]

    def tasks(self, batch: Batch) -> list[Task]:
        """One task per `task_id` row (the scheduler's `tasks=`)."""
        return [self.task(int(index)) for index in np.asarray(batch["task_id"])]

    def dataset(
        self, rows: int, batch_size: int, *, shuffle_seed: int | None = 0, epochs: int = 1
    ) -> ArrayDataset:
        """Task ids 0 .. rows-1 in batches of `batch_size`, shuffled per epoch."""
        if rows > self.size:
            raise ValueError(f"{self.env.config.env_id}: {rows} task ids run past size {self.size}")
        return ArrayDataset(
            {"task_id": np.arange(rows, dtype=np.int64)},
            batch_size,
            shuffle_seed=shuffle_seed,
            epochs=epochs,
        )

    def source(self, gateway: Any, **options: Any) -> VerifiersSource:
        """A `VerifiersSource` of this environment over a serving gateway, which takes a
        task that carries no verifiers task (a scheduler's plain task ids, given no `tasks=`)
        by its id from these tasks."""
        return VerifiersSource(gateway, self.env, taskset=self, **options)


# --- the source ---------------------------------------------------------------------------------


@attrs.frozen
class VerifiersSource:
    """Runs one episode of a verifiers environment per rollout, through a recording gateway
    (a `SessionSource`); see the module for the outcomes.

    Args:
        gateway: a serving `dew.gateway.Gateway` (in the rollouts' trio run).
        env: the `verifiers.v1.Env` (checked by `check_offline`).
        model: the model name the environment's agents ask for.
        max_calls: the most model calls per episode; None for no limit.
        wall_clock: seconds of trio's clock an episode may run; None for no limit.
        taskset: the `Verifiers` whose task a plain task id names (a task whose payload is not
            a verifiers task); None to take only tasks that carry their verifiers task.

    Attributes:
        errors: the AGENT_ERROR texts so far and how often each came.
    """

    gateway: Any = attrs.field(validator=_gateway)
    env: Any = attrs.field()
    model: str = attrs.field(default="dew", kw_only=True)
    max_calls: int | None = attrs.field(default=None, kw_only=True, validator=_optional_count)
    wall_clock: float | None = attrs.field(default=None, kw_only=True, validator=_optional_seconds)
    taskset: Verifiers | None = attrs.field(default=None, kw_only=True)
    errors: ErrorCounts = attrs.field(factory=lambda: ErrorCounts(64), init=False, eq=False)

    def __attrs_post_init__(self):
        check_offline(self.env)

    async def run(self, task: Task, label: Label) -> Session:
        """Play one episode of `task` (its payload a verifiers task, or its name an id of
        `taskset`'s) in a fresh gateway session.

        Raises:
            ValueError: naming a task that carries no verifiers task and names none of
                `taskset`'s (a scheduler needs `tasks=Verifiers.tasks` for such a source).
        """
        task = self._with_payload(task)
        session = self.gateway.open(label, max_calls=self.max_calls)
        played = False
        try:
            result = await self._play(session, task)
            played = True
        finally:
            session.close("finished" if played else "cancelled")
        ended = _session(session, result)
        if ended.status is Status.AGENT_ERROR or SCORING.match(ended.error or ""):
            self._count(ended.error)
        return ended

    def _with_payload(self, task: Task) -> Task:
        if task.payload is not None:
            return task
        if self.taskset is None or not task.name.isdigit():
            raise ValueError(
                f"task {task.name!r} carries no verifiers task and names none by its id: give "
                "the scheduler tasks=Verifiers.tasks, or build the source with Verifiers.source"
            )
        return self.taskset.task(int(task.name))

    def _count(self, error: str) -> None:
        count = self.errors.add(error)  # by kind: a text quoting the reply varies every time
        if math.log10(count).is_integer():
            logger.warning(
                "verifiers environment %r: %d rollouts so far ended with %s (this time: %r)",
                self.env.config.env_id,
                count,
                error_kind(error),
                error,
            )

    async def _play(self, session, task: Task) -> Outcome | None:
        """The episode's outcome; None when it was cut (a limit, a fault, time)."""
        vf = _import_verifiers()
        context = vf.ModelContext(
            model=self.model,
            client=vf.EvalClientConfig(base_url=session.base_url, api_key_var="DEW_GATEWAY_KEY"),
        )

        async def episode() -> Outcome:
            try:
                played = await _run_loop().run(self.env.run_episode(task.payload, context))
            except Exception as error:
                # Past verifiers' own boundaries, which record an environment's errors on the
                # episode: still the environment's, not a broken source's.
                return Outcome(Status.AGENT_ERROR, 0.0, {}, error=describe(error))
            return outcome(played)

        played, timed_out = await play_in_session(session, self.wall_clock, episode)
        if timed_out and played is None:
            session.truncate("wall_clock")
        return played


def _session(session, result: Outcome | None) -> Session:
    calls: tuple[Call, ...] = session.calls
    if result is not None and result.seats is not None:
        # Each call to its trace's seat, by the trace id verifiers sent with it.
        calls = tuple(
            call
            if thread not in result.seat_of
            else attrs.evolve(call, seat=result.seat_of[thread])
            for call, thread in zip(calls, session.threads, strict=True)
        )
    if session.infra_error is not None:
        return Session(Status.INFRA_ERROR, calls, error=session.infra_error)
    if session.truncation is not None:
        # The episode was cut before verifiers scored it: 0, which a resubmission of the same
        # overflowing episode would only repeat.
        reward = 0.0 if result is None else result.reward
        components = {} if result is None else dict(result.components)
        seats = None if result is None else result.seats
        return Session(
            Status.TRUNCATED,
            calls,
            reward,
            components,
            truncation=session.truncation,
            seats=seats,
        )
    if result is None:
        return Session(Status.INFRA_ERROR, calls, error="the episode ended without an outcome")
    return Session(
        result.status,
        calls,
        result.reward,
        dict(result.components),
        truncation=result.truncation,
        error=result.error,
        seats=result.seats,
    )


def __getattr__(name: str) -> Any:
    # ChatHarness subclasses verifiers' Harness: built when first asked for, so importing this
    # module needs no verifiers. It stays out of the module's namespace, so what the module
    # defines (its API page) does not depend on whether something asked for it first.
    if name in ("ChatHarness", "ChatHarnessConfig"):
        harness, config = _chat_harness_classes(HARNESS_ID)
        return harness if name == "ChatHarness" else config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
