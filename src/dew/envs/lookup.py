"""A built-in multi-turn, tool-using agent harness, written with the official `openai` client.

The task: say the value a key holds in a table the model cannot see. The agent offers the model
one tool, `lookup(key)`; when the model calls it the agent answers with the table's value (or
"unknown key"), and the model's first reply without a tool call is the agent's answer. The agent
knows nothing of dew: it is an ordinary OpenAI-API program, trained through the recording
gateway by `HarnessSource`.

The verifier's reward is half for the answer (exactly the value) and half for how much of the
canonical first tool call, `<tool_call>{"name": "lookup", "arguments": {"key": ...}}</tool_call>`,
the model's first reply writes in order (their longest common subsequence, as a fraction): a
dense signal, one character at a time, that a small model trained from scratch can climb before
it can finish the task.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from dew.data import ArrayDataset, Task
from dew.envs.environment import Score
from dew.envs.harness import HarnessResult, HarnessSource

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The value of a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    },
}


@attrs.frozen
class LookupTable:
    """The keys and values of the lookup task: task id i asks for key `k<i>`.

    Args:
        size: how many keys.
        seed: draws each key's two-digit value.
    """

    size: int = 16
    seed: int = 0

    def key(self, task: Task) -> str:
        """The key a task asks the agent to look up."""
        return f"k{int(task.name)}"

    def value(self, key: str) -> str | None:
        """The value `key` holds, or None for a key outside the table."""
        if not key.startswith("k") or not key[1:].isdigit() or int(key[1:]) >= self.size:
            return None
        values = np.random.default_rng(self.seed).integers(10, 100, self.size)
        return str(values[int(key[1:])])

    def canonical_call(self, task: Task) -> str:
        """The first reply a perfect agent's model writes, in the gateway's tool-call format."""
        call = {"name": "lookup", "arguments": {"key": self.key(task)}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"


@attrs.frozen
class LookupAgent:
    """The agent: an async harness `(base_url, api_key, task) -> answer` over `AsyncOpenAI`.

    Args:
        table: the table its tool reads.
        max_turns: the most model calls before it gives up (raising, an AGENT_ERROR).
        max_tokens: the most tokens per reply.
    """

    table: LookupTable = LookupTable()
    max_turns: int = 3
    max_tokens: int = 96

    async def __call__(self, base_url: str, api_key: str, task: Task) -> str:
        import openai

        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as api:
            messages: list[Any] = [
                {"role": "user", "content": f"What is the value of {self.table.key(task)}?"}
            ]
            for _ in range(self.max_turns):
                answer = await api.chat.completions.create(
                    model="policy",
                    messages=messages,
                    tools=[LOOKUP_TOOL],
                    max_completion_tokens=self.max_tokens,
                )
                message = answer.choices[0].message
                if not message.tool_calls:
                    return message.content or ""
                messages.append(message)
                for call in message.tool_calls:
                    messages.append(
                        {"role": "tool", "tool_call_id": call.id, "content": self._run(call)}
                    )
        raise RuntimeError(f"no answer after {self.max_turns} turns")

    def _run(self, call) -> str:
        """The tool's answer to one call (a malformed call gets a message, as real tools do)."""
        if call.function.name != "lookup":
            return f"unknown tool {call.function.name!r}"
        try:
            key = json.loads(call.function.arguments).get("key")
        except (json.JSONDecodeError, AttributeError):
            return "the arguments must be a JSON object with a 'key'"
        value = self.table.value(key) if isinstance(key, str) else None
        return "unknown key" if value is None else value


def _in_order(text: str, target: str) -> int:
    """How many of `target`'s characters `text` holds in order (their longest common
    subsequence): a score that grows by one character at a time, wherever it is written."""
    row = [0] * (len(target) + 1)
    for char in text:
        diagonal = 0
        for j, wanted in enumerate(target, 1):
            diagonal, row[j] = row[j], diagonal + 1 if char == wanted else max(row[j], row[j - 1])
    return row[-1]


@attrs.frozen
class LookupVerifier:
    """Scores a lookup run: half the answer, half how much of the canonical tool call the first
    reply writes in order (see the module)."""

    table: LookupTable = LookupTable()

    def __call__(self, result: HarnessResult) -> Score:
        from dew.serve import tokenizer

        canonical = self.table.canonical_call(result.task)
        first = ""
        if result.calls:
            first = tokenizer.decode(result.calls[0].completion, skip_special=True)
        form = _in_order(first, canonical) / len(canonical)
        value = self.table.value(self.table.key(result.task))
        answered = float(isinstance(result.output, str) and result.output.strip() == value)
        return Score(0.5 * form + 0.5 * answered, {"format": form, "answer": answered})


def lookup_source(gateway: Any, *, size: int = 16, seed: int = 0) -> HarnessSource:
    """The lookup agent as a source over a serving `dew.gateway.Gateway` (at most 3 calls per
    rollout), scored by `LookupVerifier`."""
    table = LookupTable(size, seed)
    return HarnessSource(gateway, LookupAgent(table), LookupVerifier(table), max_calls=3)


def lookup_dataset(
    *, size: int = 16, seed: int = 0, batch_size: int = 4, epochs: int = 1000
) -> ArrayDataset:
    """The lookup task's `task_id`s, 0..size-1, in a seeded order, epoch after epoch."""
    return ArrayDataset({"task_id": np.arange(size)}, batch_size, shuffle_seed=seed, epochs=epochs)


def lookup_harness(
    gateway: Any, *, size: int = 16, seed: int = 0, batch_size: int = 4, epochs: int = 1000
) -> tuple[HarnessSource, ArrayDataset]:
    """The built-in lookup harness as a source over `gateway`, and its task dataset.

    Args:
        gateway: a serving `dew.gateway.Gateway` in the rollouts' trio run.
        size: keys in the table (task ids 0..size-1).
        seed: the table's values and the task order.
        batch_size: tasks per batch.
        epochs: passes over the tasks.
    """
    source = lookup_source(gateway, size=size, seed=seed)
    return source, lookup_dataset(size=size, seed=seed, batch_size=batch_size, epochs=epochs)


@attrs.frozen
class BuiltinHarness:
    """A built-in harness, as `dew train --harness NAME` needs it.

    For the scheduler's synchronous facade, serve it with
    `dew.gateway.ServedGateway(server, harness.source, {"max_context": harness.max_len})`.

    Args:
        source: builds the source over a serving gateway.
        dataset: builds the task dataset (keyword arguments `seed`, `batch_size`, `epochs`).
        max_len: the longest prompt and completion a rollout needs (the engine's `max_len`).
        max_tokens: the most tokens per reply (the gateway's `max_tokens`).
    """

    source: Callable[[Any], HarnessSource]
    dataset: Callable[..., ArrayDataset]
    max_len: int
    max_tokens: int


HARNESSES = {
    # The tools turn and question take 363 tokens; two replies, the tool's answer and the
    # template's turns fit in 512.
    "lookup": BuiltinHarness(lookup_source, lookup_dataset, max_len=512, max_tokens=96),
}
"""Built-in harnesses by name (what `dew train --harness NAME` picks)."""
