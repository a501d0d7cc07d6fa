"""The short path: sizes measured from the data, mismatches refused, and `fit` training."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import optax
import pytest

from _bpe import train_bpe
from _nnx_model import NnxModel
from dew import models
from dew.data import Task
from dew.envs import GuessDigit, Score
from dew.serve.tokenizer import BYTES, HuggingFaceTokenizer
from dew.train import Sizes, fit, measure, task_list

ANSWERS = {f"{a}+{b}": str(a + b) for a in range(3) for b in range(3)}
TASKS = [Task(question) for question in ANSWERS]


def question(task: Task) -> str:
    return f"What is {task.name}?"


def verify(task: Task, reply: str) -> Score:
    return Score(float(reply.strip() == ANSWERS[task.name]))


def templated(text: str) -> int:
    return len(BYTES.encode_chat([{"role": "user", "content": text}]))


def test_measure_derives_context_width_and_rows_from_the_longest_prompt():
    tasks = [Task("a"), Task("a much longer prompt"), Task("b")]
    sizes = measure(tasks, lambda task: task.name, max_tokens=5, rollouts=16)
    longest = templated("a much longer prompt")
    chain = longest + 5
    assert sizes == Sizes(prompt=longest, chain=chain, context=chain, width=chain, rows=16)
    wide = measure(tasks, lambda task: task.name, max_tokens=5, rollouts=16, width=3 * chain)
    assert (wide.width, wide.rows) == (3 * chain, 6)
    episode = measure(tasks, lambda task: task.name, max_tokens=2, rollouts=4, max_context=100)
    assert (episode.chain, episode.context, episode.width, episode.rows) == (100, 100, 100, 4)


def test_measure_refuses_sizes_the_data_does_not_fit():
    tasks = [Task("short"), Task("the longest one")]
    chain = templated("the longest one") + 4
    options = {"max_tokens": 4, "rollouts": 8}
    why = rf"the longest prompt \({chain - 4} tokens, task 'the longest one'\) \+ max_tokens 4"
    with pytest.raises(ValueError, match=rf"context {chain - 1} is shorter than {why}"):
        measure(tasks, lambda task: task.name, context=chain - 1, **options)
    with pytest.raises(ValueError, match=rf"width {chain - 1} is below the longest chain"):
        measure(tasks, lambda task: task.name, width=chain - 1, **options)
    with pytest.raises(ValueError, match="task 'the longest one'.s first prompt has .* no room"):
        measure(tasks, lambda task: task.name, max_context=chain - 4, **options)
    with pytest.raises(ValueError, match="at least one task"):
        measure([], lambda task: task.name, **options)


def test_fit_refuses_mismatches_before_anything_runs():
    options = {"prompt": question, "max_tokens": 2, "steps": 1, "batch_size": 2}
    small = models.Transformer(models.TransformerConfig(vocab=200, max_len=64))
    with pytest.raises(ValueError, match=r"tokenizer's vocabulary \(260 ids\) exceeds the model"):
        fit(TASKS, verify, model=small, **options)
    short = models.Transformer(models.TransformerConfig(max_len=20))
    with pytest.raises(ValueError, match="the model's max_len 20 is shorter than the context"):
        fit(TASKS, verify, model=short, **options)
    with pytest.raises(ValueError, match="width 10 is below the longest chain"):
        fit(TASKS, verify, width=10, **options)
    with pytest.raises(ValueError, match="exactly one of prompt= .* and environment="):
        fit(TASKS, verify, max_tokens=2, steps=1)
    with pytest.raises(ValueError, match="batch_size 20 exceeds the 9 tasks"):
        fit(TASKS, verify, **{**options, "batch_size": 20})


def test_task_list_names_each_row_by_index():
    lookup = task_list(TASKS)
    assert lookup({"task_id": np.array([3, 0])}) == [TASKS[3], TASKS[0]]


@pytest.mark.medium
def test_fit_trains_a_model_and_tokenizer_of_ones_own_in_a_few_lines(tmp_path):
    lines = []
    bpe = HuggingFaceTokenizer.from_file(train_bpe(tmp_path / "tokenizer.json"))
    model = NnxModel(vocab=bpe.vocab_size, width=32, heads=2, max_len=64)
    trainer = fit(
        TASKS,
        verify,
        prompt=question,
        max_tokens=2,
        model=model,
        tokenizer=bpe,
        optimizer=optax.sgd(1e-2),
        steps=2,
        batch_size=2,
        groups=4,
        run=tmp_path / "run",
        on_step=lines.append,
    )
    assert trainer.updates == 2 and [line["updates"] for line in lines] == [1, 2]
    assert all(math.isfinite(line["loss"]) for line in lines)
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2
    assert jax.tree.structure(trainer.variables) == jax.tree.structure(
        model.init(jax.random.key(0))
    )


class Repeat:
    """An in-process environment of the test's own: it names a digit and asks for it twice; an
    action is one reply, and the episode ends after the second. Each one made is kept in
    `made`, for the test to read."""

    def __init__(self, made: list[Repeat]):
        self.digit: str | None = None
        self.actions: list[str] = []
        made.append(self)

    def reset(self, task: Task) -> str:
        self.digit = ANSWERS[task.name]
        return f"say {self.digit}"

    def step(self, action: str) -> tuple[str | None, bool]:
        self.actions.append(action)
        if len(self.actions) == 2:
            return None, True
        return "again", False


def repeated(env: Repeat, episode) -> Score:
    """How close the episode's actions came to the digit asked for, by character code: a dense
    reward, so that even a fresh model's groups differ and train."""

    def closeness(action: str) -> float:
        return max(0.0, 1.0 - abs(ord(action[:1] or "\0") - ord(env.digit)) / 256)

    return Score(sum(map(closeness, episode.actions)) / 2)


@pytest.mark.medium
def test_fit_trains_a_policy_on_an_environment():
    """fit(environment=...) plays real two-turn episodes on the engine, scores them with the
    verifier, and moves the parameters: each step trains its batch's episodes."""
    made: list[Repeat] = []
    verified = []

    def verify_and_keep(env, episode):
        verified.append((env, episode))
        return repeated(env, episode)

    model = models.Transformer(models.TransformerConfig(d_model=16, heads=2, layers=1, d_ff=32))
    params = model.init(jax.random.key(1))
    initial = jax.device_get(params)
    lines = []
    steps, batch_size, groups = 3, 2, 4
    trainer = fit(
        TASKS,
        verify_and_keep,
        environment=functools.partial(Repeat, made),
        first_prompt=lambda task: f"say {ANSWERS[task.name]}",  # what reset says
        max_turns=2,
        max_context=96,
        max_tokens=1,
        require_stop=False,  # a one-token reply is the action
        model=model,
        params=params,
        steps=steps,
        batch_size=batch_size,
        groups=groups,
        optimizer=optax.sgd(0.1),  # clean under strict promotion, as Adam is not
        on_step=lines.append,
    )
    assert trainer.updates == steps and [line["updates"] for line in lines] == [1, 2, 3]
    assert all(math.isfinite(line["loss"]) and line["loss"] != 0 for line in lines), lines
    assert all(line["groups"] == batch_size for line in lines)
    # Every episode ran both turns in an environment of its own, and reached the verifier.
    assert len(made) >= steps * batch_size * groups
    assert len(verified) >= steps * batch_size * groups
    for env, episode in verified:
        assert len(env.actions) == 2 and episode.actions == tuple(env.actions)
        assert episode.task.name in ANSWERS and episode.status.value == "completed"
    moved = [
        not np.array_equal(after, before)
        for after, before in zip(
            jax.tree.leaves(jax.device_get(trainer.variables)),
            jax.tree.leaves(initial),
            strict=True,
        )
    ]
    assert all(moved), "a step left some parameters where they started"


def test_fit_names_what_an_environment_lacks():
    game = GuessDigit()
    options = {"environment": game.env, "max_tokens": 1, "steps": 1, "batch_size": 2}
    with pytest.raises(ValueError, match="environment= needs max_turns and max_context"):
        fit(TASKS, game.verify, **options)
    options |= {"max_turns": 4, "max_context": 64}
    with pytest.raises(ValueError, match="environment= needs first_prompt="):
        fit(TASKS, game.verify, **options)
    with pytest.raises(ValueError, match="max_turns, max_context and require_stop are an envi"):
        fit(TASKS, verify, prompt=question, max_tokens=1, max_turns=2)
    with pytest.raises(ValueError, match="max_turns, max_context and require_stop are an envi"):
        fit(TASKS, verify, prompt=question, max_tokens=1, require_stop=False)
    with pytest.raises(ValueError, match="first prompt has .* no room .* max_context 20"):
        fit(
            TASKS, game.verify, first_prompt=lambda task: "x" * 30, **{**options, "max_context": 20}
        )
