"""reasoning-gym's procedural datasets as dew tasks, scored by reasoning-gym's own scorers.

`ReasoningGym.parse("leg_counting,max_animals=1")` names a dataset of the optional
`reasoning-gym` package (`pip install 'dew[reasoning-gym]'`) and its configuration. Each of its
tasks is a `Task` named by its index whose payload is the dataset's entry (`question`, `answer`,
`metadata`); the prompt is the entry's question as one user message, and the verifier hands the
reply and the entry to the dataset's `score_answer`, so every task's own entry reaches the
scorer.

`shots=K` in the spec (dew's, not reasoning-gym's) opens each prompt with K solved examples: the
question and answer of K entries of the same dataset drawn with the next seed, as earlier chat
turns, never one that asks the task's own question (the next entry drawn stands in for it:
`ReasoningGym.prompt`). It shows a model the answer's form, as reasoning-gym's own system
prompts assume ("When an example is provided, you should strictly follow the format of the
output/answer in that example"): a small instruct model that writes "6 + 5 = 11" when asked
"Calculate 6 + 5." (0.2, the answer's share of the reply's characters) almost never writes the
bare "11" (1.0), however its instruction is worded, but does after one example (a wrong number
more often than not: `benchmarks/learning.py`'s NOTES). The default, 0, is the question alone,
as reasoning-gym's quickstart feeds it; the scorer is the same either way.

The reply is the answer: the whole decoded reply, exactly as the model wrote it, without
reasoning-gym's `<answer>` tags (a model trained from scratch never learns to write them first).
Nothing is stripped: `str.strip` also drops separators such as `\x1e`, so a reply wrapped in them
would score as the bare answer, and a policy learns such loopholes. reasoning-gym's scorer sees
the very text the model wrote and gives a padded answer its own partial credit.

A scorer that raises on a reply (boxnet's, on a reply that is a JSON number), or scores it with
no finite number, makes the rollout an INFRA_ERROR (`PromptSource`'s verifier failing) whose
error names the dataset and the exception.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from dew._checks import int_at_least
from dew.data import ArrayDataset, Batch, Task
from dew.envs.environment import Sampling, Score, describe
from dew.envs.prompts import PromptSource
from dew.envs.tasks import task_id
from dew.envs.verifiers import parse_spec
from dew.serve.tokenizer import BYTES, Tokenizer

PREFIX = "reasoning-gym:"
"""How `dew train --task` names a reasoning-gym dataset: `reasoning-gym:NAME[,key=value...]`."""


# dew's own settings of a dataset, which reasoning-gym takes beside its options, and how to
# give each instead (reasoning-gym said "got multiple values for keyword argument 'size'").
_OWN = {
    "size": "ReasoningGym's size= (dew train: --tasks and --eval-tasks)",
    "seed": "ReasoningGym's seed= (dew train: --seed)",
}


def _options(instance, attribute, value):
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{attribute.name} must be a mapping of str keys, got {value!r}")
    for key, instead in _OWN.items():
        if key in value:
            raise ValueError(
                f"option {key}={value[key]!r} is dew's, not an option of reasoning-gym's "
                f"{instance.name}: give it as {instead}"
            )


# Examples drawn beyond `shots`, to stand in for those that ask a task's own question.
_SPARE_EXAMPLES = 16


@attrs.frozen
class ReasoningGym:
    """One reasoning-gym dataset: its tasks, their prompts and reasoning-gym's scorer.

    Args:
        name: the dataset's name in reasoning-gym's registry (e.g. `leg_counting`).
        options: its configuration (reasoning-gym's config fields, e.g. `max_animals`).
        size: entries in the dataset; task ids are 0 .. size-1.
        seed: the dataset's seed; its entries are a function of it and the index.
        shots: solved examples each prompt opens with (entries drawn with `seed + 1`, none
            asking the task's own question).

    Raises:
        ImportError: naming the extra to install when reasoning-gym is missing.
        ValueError: naming the dataset or the option reasoning-gym refuses, dew's own
            `size` or `seed` given among the options, or `shots` not a count.
    """

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=dict, validator=_options)
    size: int = attrs.field(default=1000, kw_only=True, validator=int_at_least(1))
    seed: int = attrs.field(default=0, kw_only=True, validator=int_at_least(0))
    shots: int = attrs.field(default=0, kw_only=True, validator=int_at_least(0))
    _dataset: Any = attrs.field(init=False, repr=False, eq=False)
    _examples: tuple[dict[str, Any], ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self):
        object.__setattr__(self, "_dataset", self._create(self.size, self.seed))
        # The examples are another seed's entries, so that they do not change with `size`, and
        # `_SPARE_EXAMPLES` more stand in for those that ask a task's own question.
        examples = self._create(self.shots + _SPARE_EXAMPLES, self.seed + 1) if self.shots else ()
        object.__setattr__(self, "_examples", tuple(examples))

    def _create(self, size: int, seed: int):
        """reasoning-gym's dataset of this name and options, `size` entries drawn with `seed`."""
        try:
            import reasoning_gym
            from reasoning_gym.factory import DATASETS
        except ImportError as error:
            raise ImportError(
                "reasoning-gym tasks need the reasoning-gym package: "
                "pip install 'dew[reasoning-gym]'"
            ) from error
        if self.name not in DATASETS:
            raise ValueError(
                f"reasoning-gym has no dataset {self.name!r}; it has {', '.join(sorted(DATASETS))}"
            )
        try:
            return reasoning_gym.create_dataset(self.name, size=size, seed=seed, **self.options)
        except (TypeError, ValueError, AssertionError) as error:
            raise ValueError(
                f"reasoning-gym refuses {self.name} with options {self.options}: {error}"
            ) from error

    @classmethod
    def parse(cls, spec: str, *, size: int = 1000, seed: int = 0) -> ReasoningGym:
        """The dataset `spec` names: `NAME[,key=value...]`, with or without the
        `reasoning-gym:` prefix; values are JSON where they parse (`3`, `true`, `["+","-"]`),
        else strings (`dew.envs.verifiers.parse_spec`). `shots=K` is dew's (the class's
        `shots`); every other key is reasoning-gym's.

        Raises:
            ValueError: naming the part of `spec` that is not `key=value`, a repeated key, or
                `shots` that is not a count.
        """
        name, options = parse_spec(spec, PREFIX)
        shots = options.pop("shots", 0)
        return cls(name, options, size=size, seed=seed, shots=shots)

    def entry(self, index: int) -> dict[str, Any]:
        """The dataset's entry `index`: `question`, `answer` and `metadata`.

        Raises:
            ValueError: for an index outside 0 .. size-1.
        """
        if not 0 <= index < self.size:
            raise ValueError(f"{self.name}: task id {index} is outside 0 .. {self.size - 1}")
        return self._dataset[index]

    def tasks(self, batch: Batch) -> list[Task]:
        """One task per `task_id` row, named by its id, carrying its entry as its payload (the
        scheduler's `tasks=`)."""
        return [self.task(int(index)) for index in np.asarray(batch["task_id"])]

    def task(self, index: int) -> Task:
        """Task `index`, with its entry as the payload."""
        return Task(str(index), payload=self.entry(index))

    def dataset(
        self,
        rows: int,
        batch_size: int,
        *,
        start: int = 0,
        shuffle_seed: int | None = 0,
        epochs: int = 1,
    ) -> ArrayDataset:
        """Task ids `start` .. `start + rows - 1` in batches of `batch_size`, shuffled per epoch
        as `dew.envs.tasks.task_dataset` shuffles them.

        Raises:
            ValueError: when the ids run past the dataset's size.
        """
        if start + rows > self.size:
            raise ValueError(
                f"{self.name}: task ids {start} .. {start + rows - 1} run past size {self.size}"
            )
        return ArrayDataset(
            {"task_id": np.arange(start, start + rows, dtype=np.int64)},
            batch_size,
            shuffle_seed=shuffle_seed,
            epochs=epochs,
        )

    def _entry_of(self, task: Task) -> Mapping[str, Any]:
        return task.payload if task.payload is not None else self.entry(task_id(task))

    def prompt(self, task: Task) -> str | list[dict[str, str]]:
        """The user message of `task`: its entry's question, after `shots` solved examples
        (each a user turn, its question, and an assistant turn, its answer) where there are any,
        none asking the task's own question.

        Raises:
            ValueError: naming the dataset and the task when its entry has no question (a
                payload of another shape: `PromptSource` lets it propagate, a broken source),
                or when fewer than `shots` of the examples drawn ask another question.
        """
        entry = self._entry_of(task)
        if not isinstance(entry, Mapping) or not isinstance(entry.get("question"), str):
            raise ValueError(
                f"reasoning-gym {self.name} task {task.name!r}: its entry has no question "
                f"(a str under 'question'): {entry!r:.200}"
            )
        if not self.shots:
            return entry["question"]
        turns = []
        for example in self._examples_for(task, entry["question"]):
            turns.append({"role": "user", "content": example["question"]})
            turns.append({"role": "assistant", "content": str(example["answer"])})
        return [*turns, {"role": "user", "content": entry["question"]}]

    def _examples_for(self, task: Task, question: str) -> list[Mapping[str, Any]]:
        """The first `shots` examples drawn whose question is not `question`: an example asking
        the task's own question would hand it its answer. Most of reasoning-gym's datasets draw
        entry i with Random(seed + i), so the examples' entry j is this dataset's entry j + 1
        (task 1 opened with its own solution), and a small dataset repeats its questions (the
        one-digit sums have 100: 8 of the README's 1,000 training tasks, at seed 1 one of its
        64 held-out ones, asked the example's question).

        Raises:
            ValueError: naming the dataset and the task when fewer than `shots` of the examples
                drawn ask another question.
        """
        examples = [e for e in self._examples if e["question"] != question][: self.shots]
        if len(examples) < self.shots:
            raise ValueError(
                f"reasoning-gym {self.name} task {task.name!r}: only {len(examples)} of the "
                f"{len(self._examples)} examples drawn for shots={self.shots} ask another "
                "question than the task's; ask for fewer shots"
            )
        return examples

    def verify(self, task: Task, reply: str) -> Score:
        """reasoning-gym's score of `reply`, verbatim, against `task`'s entry; `exact` is 1 when
        the reply is the entry's answer, character for character.

        Raises:
            ValueError: naming the dataset when its `score_answer` raises (its exception's type
                and text) or gives something other than a finite number: `PromptSource` makes
                the rollout an INFRA_ERROR with this text.
        """
        entry = self._entry_of(task)
        try:
            score = self._dataset.score_answer(reply, entry)
        except Exception as error:
            raise ValueError(
                f"reasoning-gym {self.name}: score_answer raised {describe(error)}"
            ) from error
        if not isinstance(score, numbers.Real) or not math.isfinite(score):
            raise ValueError(
                f"reasoning-gym {self.name}: score_answer gave {score!r}, not a finite number"
            )
        return Score(float(score), {"exact": float(reply == entry.get("answer"))})

    def source(
        self,
        engine,
        *,
        max_tokens: int,
        sampling: Sampling | None = None,
        tokenizer: Tokenizer = BYTES,
    ) -> PromptSource:
        """A `PromptSource` of these tasks on `engine`."""
        return PromptSource(
            engine,
            self.prompt,
            self.verify,
            max_tokens=max_tokens,
            sampling=Sampling() if sampling is None else sampling,
            tokenizer=tokenizer,
        )
