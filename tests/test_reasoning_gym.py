"""reasoning-gym datasets as tasks: specs, entries as payloads, and reasoning-gym's own scorer."""

from __future__ import annotations

import numpy as np
import pytest

from dew.data import Task
from dew.envs.reasoning_gym import ReasoningGym

LEGS = "reasoning-gym:leg_counting,min_animals=1,max_animals=1,max_instances=1"


@pytest.fixture(scope="module")
def legs() -> ReasoningGym:
    return ReasoningGym.parse(LEGS, size=40, seed=3)


def test_parse_reads_name_and_json_options(legs):
    assert (legs.name, legs.options, legs.size, legs.seed) == (
        "leg_counting",
        {"min_animals": 1, "max_animals": 1, "max_instances": 1},
        40,
        3,
    )
    spec = 'basic_arithmetic,operators=["+"],allow_negation=false,format_style=simple'
    options = ReasoningGym.parse(spec, size=4).options
    assert options == {"operators": ["+"], "allow_negation": False, "format_style": "simple"}


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("reasoning-gym:no_such_set", ValueError, "reasoning-gym has no dataset 'no_such_set'"),
        ("leg_counting,max_animals", ValueError, "'max_animals' is not key=value"),
        ("leg_counting,=3", ValueError, "'=3' is not key=value"),
        ("leg_counting,seed=1,seed=2", ValueError, "'seed' is given twice"),
        ("leg_counting,wings=2", ValueError, r"refuses leg_counting with options \{'wings': 2\}"),
        ("leg_counting,shots=-1", ValueError, "shots must be an int >= 0, got -1"),
        ("leg_counting,shots=one", ValueError, "shots must be an int >= 0, got 'one'"),
    ],
)
def test_parse_names_what_is_wrong(spec, error, match):
    with pytest.raises(error, match=match):
        ReasoningGym.parse(spec, size=4)


def test_tasks_carry_their_entries_and_prompts_are_the_questions(legs):
    tasks = legs.tasks({"task_id": np.array([5, 2])})
    assert [task.name for task in tasks] == ["5", "2"]
    assert tasks[0].payload == legs.entry(5)
    assert legs.prompt(tasks[1]) == legs.entry(2)["question"]
    assert "legs" in legs.prompt(tasks[1])
    with pytest.raises(ValueError, match=r"task id 40 is outside 0 \.\. 39"):
        legs.entry(40)


def test_shots_open_each_prompt_with_solved_examples_drawn_with_the_next_seed():
    """`shots=2` is dew's: reasoning-gym never sees it; each prompt is two solved entries of
    the same dataset drawn with seed + 1, as chat turns, then the task's own question, and the
    scorer is the one the question alone gets."""
    gym = ReasoningGym.parse(LEGS + ",shots=2", size=40, seed=3)
    plain = ReasoningGym.parse(LEGS, size=40, seed=3)
    assert (gym.options, gym.shots, plain.shots) == (plain.options, 2, 0)
    examples = ReasoningGym.parse(LEGS, size=2, seed=4)
    task = gym.task(7)
    assert task.payload == plain.entry(7)
    assert gym.prompt(task) == [
        {"role": "user", "content": examples.entry(0)["question"]},
        {"role": "assistant", "content": examples.entry(0)["answer"]},
        {"role": "user", "content": examples.entry(1)["question"]},
        {"role": "assistant", "content": examples.entry(1)["answer"]},
        {"role": "user", "content": plain.prompt(task)},
    ]
    assert examples.entry(0)["question"] != plain.entry(0)["question"]
    for reply in (task.payload["answer"], task.payload["answer"] + " legs", "no idea"):
        assert gym.verify(task, reply) == plain.verify(task, reply)


# The README's real-model task: one-digit sums, 100 distinct questions among its entries.
SUMS = (
    "reasoning-gym:basic_arithmetic,min_terms=2,max_terms=2,min_digits=1,max_digits=1,"
    'operators=["+"],allow_negation=false,allow_parentheses=false'
)


@pytest.mark.parametrize("seed", [0, 1])
def test_no_example_asks_the_tasks_own_question(seed):
    """The examples' entry j is the task set's entry j + 1 (reasoning-gym draws entry i with
    Random(seed + i)), and the sums repeat their questions: tasks asked an example's question
    (task 1 among them) and were handed its answer just before, at seed 1 a held-out task of
    the README's too. Such a task is shown the next entry drawn instead; every other task opens
    with the first entries, as before."""
    gym = ReasoningGym.parse(SUMS + ",shots=2", size=1064, seed=seed)
    drawn = ReasoningGym.parse(SUMS, size=8, seed=seed + 1)
    first = [drawn.entry(0), drawn.entry(1)]
    asked = {entry["question"] for entry in first}
    assert gym.entry(1)["question"] == first[0]["question"]
    replaced = 0
    for index in range(gym.size):
        *turns, question = gym.prompt(gym.task(index))
        shown = [turns[i]["content"] for i in range(0, len(turns), 2)]
        assert len(shown) == 2 and question["content"] not in shown, index
        if question["content"] in asked:
            replaced += 1
            rest = [e["question"] for e in map(drawn.entry, range(8))]
            assert shown == [q for q in rest if q != question["content"]][:2], index
        else:
            assert turns == [
                turn
                for entry in first
                for turn in (
                    {"role": "user", "content": entry["question"]},
                    {"role": "assistant", "content": entry["answer"]},
                )
            ], index
    assert replaced >= 8


def test_too_few_examples_of_another_question_are_refused_naming_the_task():
    gym = ReasoningGym.parse(SUMS + ",shots=1", size=4, seed=0)
    task = gym.task(1)
    # Every example drawn asking task 1's question: as a dataset of one question would draw.
    same = {"question": task.payload["question"], "answer": task.payload["answer"]}
    object.__setattr__(gym, "_examples", (same,) * 17)
    with pytest.raises(ValueError, match=r"basic_arithmetic task '1': only 0 of the 17 examples"):
        gym.prompt(task)


def test_the_verifier_is_reasoning_gyms_scorer_on_the_tasks_entry(legs):
    task = legs.task(7)
    answer = task.payload["answer"]
    assert legs.verify(task, answer).reward == 1.0
    assert legs.verify(task, answer).components == {"exact": 1.0}
    assert legs.verify(task, answer + "xyz").reward == pytest.approx(
        len(answer) / (len(answer) + 3)
    )
    assert legs.verify(task, "no idea").reward == 0.0
    # The entry in the task's payload is what is scored, not a lookup by name.
    forged = {**task.payload, "answer": "9999"}
    assert legs.verify(Task("7", payload=forged), "9999").reward == 1.0
    assert legs.verify(Task("7"), answer).reward == 1.0


# Every one is whitespace to str.strip.
SEPARATORS = [" ", "\n", "\t", "\x1c", "\x1d", "\x1e", "\x1f", "\x85", "\u2028"]


@pytest.mark.parametrize("separator", SEPARATORS)
def test_a_reply_padded_with_separators_scores_as_reasoning_gym_scores_it(legs, separator):
    """str.strip drops every one of these: a reply padded with them must not pass for the bare
    answer, but get exactly what reasoning-gym's own scorer gives the text the model wrote."""
    task = legs.task(7)
    answer = task.payload["answer"]
    for reply in (separator + answer, answer + separator, separator + answer + separator):
        score = legs.verify(task, reply)
        assert score.reward == legs._dataset.score_answer(reply, task.payload) < 1.0
        assert score.components == {"exact": 0.0}


def test_datasets_hold_out_a_range_of_ids(legs):
    train = legs.dataset(30, 10)
    held_out = legs.dataset(10, 10, start=30, shuffle_seed=None)
    assert sorted(np.concatenate([b["task_id"] for b in train.stream()])) == list(range(30))
    assert [list(b["task_id"]) for b in held_out.stream()] == [list(range(30, 40))]
    with pytest.raises(ValueError, match=r"task ids 30 \.\. 40 run past size 40"):
        legs.dataset(11, 1, start=30)
