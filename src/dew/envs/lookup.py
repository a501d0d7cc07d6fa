"""Built-in multi-turn, tool-using agent harnesses, written with the official `openai` client.

The task: answer the value a key holds in a table the model cannot see. Each task has a key
(a digit) and a table of its own (a digit per key), so the value cannot be learnt from the
question: the model must call the lookup tool on the right key, read its result and answer
with it. Two agents do that; neither knows anything of dew (they are ordinary OpenAI-API
programs, trained through the recording gateway by `HarnessSource`):

- `LookupAgent` (`dew train --harness lookup`) talks in plain text, in two turns: the model's
  first reply is the key to look up (the agent calls its tool on it, as a harness does that
  forces a tool call with `tool_choice`), and the agent sends the tool's result back as the next
  user message; the model's second reply is the answer. The question is the key written 8 times
  and the tool's result the value written 16 times, so a byte-level transformer trained from
  scratch (whose near-uniform attention already carries a digit written many times) learns the
  whole loop on the CPU in minutes.
- `ToolLookupAgent` (`dew train --harness lookup-tools`) offers the tool through the OpenAI
  tools API (`tools=[LOOKUP_TOOL]`, answered as `tool_calls` by the gateway's template) and asks
  in English: the agent for a model that already writes the gateway's tool-call blocks. A
  model trained from scratch must first spell a 60-byte block exactly, which takes far longer
  than minutes.

Both report a `LookupOutcome`: the keys they looked up and their answer. `LookupVerifier` gives
half the reward for looking the task's key up first and half for the answer, each as the share
of positions that hold the right character, whitespace around a reply aside (so extra
characters dilute it, and only the bare key then the bare value earn 1). The answer earns
nothing unless the agent looked the task's key up: a guess is right one time in ten whatever
the question, and under GRPO's per-group normalisation crediting guesses collapses the policy
onto guessing before it learns to look up.

Why not a free choice between calling the tool and answering, marked by a fixed character (a
reply `?K` calls it)? Trained from scratch, the policy learns the marker first, writes it
everywhere (`???`) and loses the variety that GRPO needs to learn the key: the reward stalls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import trio

from dew._checks import int_at_least
from dew.data import ArrayDataset, Task
from dew.envs.environment import Score
from dew.envs.harness import HarnessResult, HarnessSource
from dew.envs.tasks import DIGITS, task_dataset, task_id

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The value a key holds.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    },
}
"""The lookup tool in the OpenAI tools schema (what `ToolLookupAgent` offers)."""

UNKNOWN = "unknown key"


@attrs.frozen
class LookupTask:
    """The lookup task's keys, tables and messages: a function of the seed and the task id.

    Args:
        seed: draws each task's key and table.
        repeat: how many times the question writes the key.
        result_repeat: how many times the tool's result writes the value: more than the
            question's key, so that near-uniform attention already favours the value when the
            model answers.
    """

    seed: int = attrs.field(default=0, validator=int_at_least(0))
    repeat: int = attrs.field(default=8, validator=int_at_least(1))
    result_repeat: int = attrs.field(default=16, validator=int_at_least(1))

    def _draw(self, task: Task) -> np.ndarray:
        """The task's key, then its table's value for each key 0..9."""
        return np.random.default_rng([self.seed, task_id(task)]).integers(0, 10, 11)

    def key(self, task: Task) -> str:
        """The key `task` asks for: one digit."""
        return DIGITS[self._draw(task)[0]]

    def value(self, task: Task, key: str) -> str | None:
        """The value `key` holds in `task`'s table, or None for a key outside it."""
        if len(key) != 1 or key not in DIGITS:
            return None
        return DIGITS[self._draw(task)[1 + int(key)]]

    def question(self, task: Task) -> str:
        """The text agent's question: the key, `repeat` times."""
        return self.key(task) * self.repeat

    def observation(self, task: Task, key: str) -> str:
        """The text agent's tool result: the value, `result_repeat` times, or `unknown key`."""
        value = self.value(task, key)
        return UNKNOWN if value is None else value * self.result_repeat

    def dataset(
        self, rows: int, batch_size: int, *, shuffle_seed: int | None = 0, epochs: int = 1
    ) -> ArrayDataset:
        """`rows` task ids in batches of `batch_size` (`dew.envs.tasks.task_dataset`)."""
        return task_dataset(rows, batch_size, shuffle_seed=shuffle_seed, epochs=epochs)


@attrs.frozen
class LookupOutcome:
    """What a lookup agent did, as its verifier reads it.

    Args:
        lookups: the keys it looked up, in order (as the model wrote them).
        answer: its answer, or None when it gave none within its turns.
    """

    lookups: tuple[str, ...]
    answer: str | None


_CLIENT = trio.lowlevel.RunVar("dew.envs.lookup.client")


async def session_client(base_url: str, api_key: str) -> Any:
    """An `openai.AsyncOpenAI` for one session: a copy (`with_options`) of one client per trio
    run, with the session's base URL and key.

    Opening a client builds its HTTP client and TLS context (10 to 100 ms of CPU), which would
    dominate a small model's rollouts; the copies share one connection pool, closed when the
    trio run ends. Do not close a copy: that closes the pool.
    """
    import openai

    try:
        client = _CLIENT.get()
    except LookupError:
        client = openai.AsyncOpenAI(api_key="per-session", max_retries=0)
        _CLIENT.set(client)
        trio.lowlevel.spawn_system_task(_close_when_the_run_ends, client)
    return client.with_options(base_url=base_url, api_key=api_key)


async def _close_when_the_run_ends(client: Any) -> None:
    try:
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            await client.close()


@attrs.frozen
class LookupAgent:
    """The plain-text agent: an async harness `(base_url, api_key, task) -> LookupOutcome`.

    Args:
        task: the lookup task (its questions and its tool).
        max_tokens: the most tokens per reply (a digit and the stop token take 2).
    """

    task: LookupTask = LookupTask()
    max_tokens: int = attrs.field(default=2, validator=int_at_least(1))

    async def __call__(self, base_url: str, api_key: str, task: Task) -> LookupOutcome:
        api = await session_client(base_url, api_key)
        messages = [{"role": "user", "content": self.task.question(task)}]
        key = await self._reply(api, messages)
        messages += [
            {"role": "assistant", "content": key},
            {"role": "user", "content": self.task.observation(task, key.strip())},
        ]
        answer = await self._reply(api, messages)
        return LookupOutcome((key.strip(),), answer.strip())

    async def _reply(self, api, messages) -> str:
        answer = await api.chat.completions.create(
            model="policy", messages=messages, max_completion_tokens=self.max_tokens
        )
        return answer.choices[0].message.content or ""


@attrs.frozen
class ToolLookupAgent:
    """The OpenAI-tools agent: an async harness `(base_url, api_key, task) -> LookupOutcome`.

    It offers `LOOKUP_TOOL`, runs each call the model makes and sends its result back as a
    `tool` message; the first reply without a tool call is the answer.

    Args:
        task: the lookup task (its tool).
        max_turns: the most model calls; without an answer by then the outcome has none.
        max_tokens: the most tokens per reply.
    """

    task: LookupTask = LookupTask()
    max_turns: int = attrs.field(default=3, validator=int_at_least(1))
    max_tokens: int = attrs.field(default=96, validator=int_at_least(1))

    async def __call__(self, base_url: str, api_key: str, task: Task) -> LookupOutcome:
        api = await session_client(base_url, api_key)
        question = f"What is the value of key {self.task.key(task)}?"
        messages: list[Any] = [{"role": "user", "content": question}]
        lookups = []
        for _ in range(self.max_turns):
            answer = await api.chat.completions.create(
                model="policy",
                messages=messages,
                tools=[LOOKUP_TOOL],
                max_completion_tokens=self.max_tokens,
            )
            message = answer.choices[0].message
            if not message.tool_calls:
                return LookupOutcome(tuple(lookups), (message.content or "").strip())
            results = [self._run(task, call) for call in message.tool_calls]
            lookups += [key for key, _ in results]
            messages.append(message)
            messages += [
                {"role": "tool", "tool_call_id": call.id, "content": result}
                for call, (_, result) in zip(message.tool_calls, results, strict=True)
            ]
        return LookupOutcome(tuple(lookups), None)

    def _run(self, task: Task, call) -> tuple[str, str]:
        """The key a tool call asked for and the tool's answer (a malformed call gets a
        message, as real tools answer)."""
        if call.function.name != "lookup":
            return "", f"unknown tool {call.function.name!r}"
        try:
            key = json.loads(call.function.arguments).get("key")
        except (json.JSONDecodeError, AttributeError):
            return "", "the arguments must be a JSON object with a 'key'"
        key = key if isinstance(key, str) else ""
        value = self.task.value(task, key)
        return key, UNKNOWN if value is None else value


def _share(target: str, text: str) -> float:
    """The share of the positions of `target` and `text` (the longer's) where they agree."""
    return sum(a == b for a, b in zip(target, text, strict=False)) / max(len(target), len(text))


@attrs.frozen
class LookupVerifier:
    """Scores a lookup run: half for looking the task's key up first, half for answering its
    value once looked up (see the module); an outcome that is not a `LookupOutcome` (the agent
    raised) scores 0."""

    task: LookupTask = LookupTask()

    def __call__(self, result: HarnessResult) -> Score:
        outcome = result.output
        if not isinstance(outcome, LookupOutcome):
            outcome = LookupOutcome((), None)
        key = self.task.key(result.task)
        lookup = _share(key, outcome.lookups[0]) if outcome.lookups else 0.0
        answer = 0.0
        if outcome.answer is not None and key in outcome.lookups:
            answer = _share(self.task.value(result.task, key), outcome.answer)
        return Score(0.5 * lookup + 0.5 * answer, {"lookup": lookup, "answer": answer})


@attrs.frozen
class BuiltinHarness:
    """A built-in harness, what `dew train --harness NAME` needs of it.

    Serve it under the scheduler's synchronous facade with
    `dew.gateway.ServedGateway(server, lambda gateway: harness.source(gateway, seed=0),
    {"max_context": harness.max_len, "max_tokens": harness.max_tokens})`.

    Args:
        summary: one line on what it is, for `dew train --help`.
        source: builds the `HarnessSource` over a serving gateway; keyword `seed` draws the tasks.
        dataset: the task ids' dataset, `(rows, batch_size, *, shuffle_seed, epochs)`.
        max_len: the longest prompt and completion a rollout needs (the engine's `max_len`).
        max_tokens: the most tokens per reply (the gateway's `max_tokens`).
    """

    summary: str
    source: Callable[..., HarnessSource]
    dataset: Callable[..., ArrayDataset]
    max_len: int
    max_tokens: int


def lookup_source(gateway: Any, *, seed: int = 0) -> HarnessSource:
    """The text-action lookup agent as a source over a serving `dew.gateway.Gateway`."""
    task = LookupTask(seed)
    return HarnessSource(gateway, LookupAgent(task), LookupVerifier(task), max_calls=2)


def tool_lookup_source(gateway: Any, *, seed: int = 0) -> HarnessSource:
    """The OpenAI-tools lookup agent as a source over a serving `dew.gateway.Gateway`."""
    task = LookupTask(seed)
    return HarnessSource(gateway, ToolLookupAgent(task), LookupVerifier(task), max_calls=3)


HARNESSES = {
    # The question, two replies of two tokens and the tool's result (the value 16 times) under
    # the template: at most 69 tokens.
    "lookup": BuiltinHarness(
        "name the key to look up, then answer with its value, in plain text (learnt from "
        "scratch in minutes)",
        lookup_source,
        LookupTask().dataset,
        max_len=72,
        max_tokens=LookupAgent().max_tokens,
    ),
    # The tools turn and the question take about 360 tokens; two replies, the tool's answer
    # and the template's turns fit in 512.
    "lookup-tools": BuiltinHarness(
        "the same through the OpenAI tools API (for a model that writes tool-call blocks)",
        tool_lookup_source,
        LookupTask().dataset,
        max_len=512,
        max_tokens=ToolLookupAgent().max_tokens,
    ),
}
"""Built-in harnesses by name (what `dew train --harness NAME` picks)."""
