"""Built-in tasks: datasets, prompts, verifiers, every ending, and a random policy's reward."""

from __future__ import annotations

import functools

import attrs
import jax
import numpy as np
import pytest
import trio

from dew import models
from dew.data import Task
from dew.envs.environment import Environment, Episode, MalformedAction, Sampling
from dew.envs.tasks import (
    CopyDigits,
    EchoDigits,
    GuessDigit,
    GuessDigitEnv,
    task_dataset,
    task_id,
)
from dew.objectives.rl.scheduler import task_ids
from dew.objectives.rl.sessions import Call, Label, Status, chains, check_session
from dew.serve import RolloutServer, tokenizer

# The engine tests' shape, so the engine compiles once for the whole run.
CONFIG = models.TransformerConfig(d_model=32, heads=2, layers=2, d_ff=64, max_len=64)
SLOTS = 4


@functools.cache
def params() -> dict:
    return models.init(jax.random.key(0), CONFIG)


@attrs.define(eq=False)
class Replies:
    """An engine answering call i with replies[i] (cut at max_tokens and after a stop)."""

    replies: list[str]
    calls: int = 0

    async def generate(self, prompt, *, max_tokens, stop=(), **sampling) -> Call:
        completion = tokenizer.encode(self.replies[self.calls])[:max_tokens]
        self.calls += 1
        return Call(
            np.asarray(prompt, np.int32),
            completion,
            np.full(len(completion), -1.0, np.float32),
            version=0,
        )


@attrs.define(eq=False)
class UniformPolicy:
    """An engine drawing every token uniformly from the vocabulary, seeded by the call's key."""

    async def generate(self, prompt, *, max_tokens, stop=(), key=None, **sampling) -> Call:
        drawn = np.random.default_rng(key).integers(0, tokenizer.VOCAB, max_tokens)
        ends = np.flatnonzero(np.isin(drawn, list(stop)))
        completion = drawn[: ends[0] + 1] if len(ends) else drawn
        return Call(
            np.asarray(prompt, np.int32),
            completion.astype(np.int32),
            np.full(len(completion), -np.log(tokenizer.VOCAB), np.float32),
            version=0,
        )


async def run_all(source, tasks: list[Task], samples: int) -> list:
    """Every (task, sample) rollout of `source`, concurrently, checked."""
    found = {}

    async def one(group: int, sample: int, task: Task):
        session = await source.run(task, Label(group, sample, 0))
        found[group, sample] = check_session(attrs.evolve(session, task=task))

    async with trio.open_nursery() as nursery:
        for group, task in enumerate(tasks):
            for sample in range(samples):
                nursery.start_soon(one, group, sample, task)
    return [found[key] for key in sorted(found)]


def test_task_dataset_streams_task_ids():
    dataset = CopyDigits().dataset(12, 4, shuffle_seed=None)
    batches = list(dataset.stream())
    assert len(batches) == 3
    assert [task.name for task in task_ids(batches[1])] == ["4", "5", "6", "7"]
    shuffled = np.concatenate([b["task_id"] for b in task_dataset(12, 4, shuffle_seed=1).stream()])
    assert sorted(shuffled) == list(range(12))
    assert list(shuffled) != list(range(12))


def test_task_id_names_a_bad_task():
    assert task_id(Task("12")) == 12
    with pytest.raises(ValueError, match="'x1'"):
        task_id(Task("x1"))


def test_copy_digits_prompts_are_seeded_digit_strings():
    task = CopyDigits(length=5, repeat=2, seed=2)
    answers = {task.answer(Task(str(i))) for i in range(50)}
    assert all(len(a) == 5 and a.isdecimal() for a in answers)
    assert len(answers) > 40
    assert task.answer(Task("3")) == CopyDigits(5, 2, 2).answer(Task("3"))
    assert task.answer(Task("3")) != CopyDigits(5, 2, 3).answer(Task("3"))
    assert task.prompt(Task("3")) == "".join(d + d for d in task.answer(Task("3")))
    assert CopyDigits().prompt(Task("3")) == CopyDigits().answer(Task("3")) * 8


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        ("381", 1.0),
        ("", 0.0),
        ("3", 1 / 3),
        ("999", 0.0),
        ("3x1", 2 / 3),
        ("3810", 3 / 4),
        ("183", 1 / 3),
        ("<|im_end|>", 0.0),
    ],
)
def test_copy_digits_verifier(reply, match):
    task = CopyDigits(length=3)
    known = next(Task(str(i)) for i in range(1000) if task.answer(Task(str(i))) == "381")
    score = task.verify(known, reply)
    assert score.reward == pytest.approx(match)
    assert score.components == pytest.approx({"match": match})


def test_guess_digit_env_hints_and_rejects():
    game = GuessDigit()
    assert len({secret_of(Task(str(i)), game) for i in range(40)}) == 10
    task = next(Task(str(i)) for i in range(100) if secret_of(Task(str(i)), game) == 4)
    env = game.env()
    assert isinstance(env, Environment)
    assert env.reset(task) == "guess 0-9"
    assert env.secret == 4
    assert env.step("5") == ("lower", False)
    assert env.step("3 or so") == ("higher", False)
    for bad in ("", "x", " 4", "<eos>"):
        with pytest.raises(MalformedAction, match="digit in 0-9"):
            env.step(bad)
    assert env.step("4") == (None, True)
    assert env.guesses == [5, 3, 4]
    small = GuessDigitEnv(high=3, seed=0)
    small.reset(Task("1"))
    with pytest.raises(MalformedAction, match="0-3"):
        small.step("7")


def secret_of(task: Task, game: GuessDigit) -> int:
    env = game.env()
    env.reset(task)
    return env.secret


def episode(task: Task) -> Episode:
    return Episode(task, (), (), Status.COMPLETED)


@pytest.mark.parametrize(
    ("guesses", "closeness", "speed"),
    [
        ("s", 1.0, 1.0),
        ("fs", 1.0, 0.75),
        ("ffff", None, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_guess_digit_verifier(guesses, closeness, speed):
    game = GuessDigit()
    task = Task("5")
    secret = secret_of(task, game)
    far = 0 if secret > 4 else 9
    env = game.env()
    env.reset(task)
    env.guesses = [secret if g == "s" else far for g in guesses]
    score = game.verify(env, episode(task))
    expected_closeness = 1 - abs(far - secret) / 9 if closeness is None else closeness
    assert score.components == pytest.approx(
        {"closeness": expected_closeness, "speed": speed, "solved": float("s" in guesses)}
    )
    assert score.reward == pytest.approx(0.5 * expected_closeness + 0.5 * speed)


async def test_guess_digit_reaches_every_ending():
    game = GuessDigit(max_turns=3)
    task = Task("4")
    secret = str(secret_of(task, game))
    wrong = "0" if secret != "0" else "1"

    solved = await run_all(game.source(Replies([wrong, secret])), [task], 1)
    assert solved[0].status is Status.COMPLETED
    assert solved[0].components["solved"] == 1.0
    assert len(chains(solved[0])) == 1

    malformed = await run_all(game.source(Replies([wrong, "?"])), [task], 1)
    assert malformed[0].status is Status.AGENT_ERROR
    assert malformed[0].reward == pytest.approx(0.5 * (1 - abs(int(wrong) - int(secret)) / 9))

    turns = await run_all(game.source(Replies([wrong] * 3)), [task], 1)
    assert (turns[0].status, turns[0].truncation) == (Status.TRUNCATED, "turns")
    assert len(turns[0].calls) == 3

    cramped = attrs.evolve(game, max_context=40)
    context = await run_all(cramped.source(Replies([wrong] * 3)), [task], 1)
    assert (context[0].status, context[0].truncation) == (Status.TRUNCATED, "context")


def test_echo_digits_says_a_digit_a_turn_for_the_tasks_turns_whatever_the_reply():
    game = EchoDigits(max_turns=6, repeat=3, seed=1)
    tasks = [Task(str(i)) for i in range(200)]
    turns = [game.turns(task) for task in tasks]
    assert set(turns) == set(range(1, 7))
    assert turns == [EchoDigits(6, 3, 1).turns(task) for task in tasks]
    assert turns != [EchoDigits(6, 3, 2).turns(task) for task in tasks]
    task = next(task for task, n in zip(tasks, turns, strict=True) if n == 3)
    env = game.env()
    assert isinstance(env, Environment)
    first = env.reset(task)
    assert len(first) == 3 and len(set(first)) == 1 and first[0] in "0123456789"
    said = [first[0]]
    for reply in ("", "<|im_end|>"):
        observation, done = env.step(reply)
        assert not done
        said.append(observation[0])
    assert env.step("no digit at all") == (None, True)
    assert "".join(said) == "".join(str(digit) for digit in env.digits)


@pytest.mark.parametrize(
    ("replies", "match"), [("sss", 1.0), ("sxs", 2 / 3), ("xxx", 0.0), ("s", 1 / 3)]
)
def test_echo_digits_verifier(replies, match):
    game = EchoDigits()
    task = next(Task(str(i)) for i in range(100) if game.turns(Task(str(i))) == 3)
    env = game.env()
    env.reset(task)
    env.replies = [
        f"{digit}{digit}" if r == "s" else f"{(digit + 1) % 10}"
        for digit, r in zip(env.digits, replies, strict=False)
    ]
    score = game.verify(env, episode(task))
    assert score.components == pytest.approx({"match": match})
    assert score.reward == pytest.approx(match)


async def test_echo_digits_episodes_take_their_tasks_calls_whatever_the_policy_replies():
    game = EchoDigits()
    tasks = [Task(str(i)) for i in range(16)]
    for policy in (Replies(["7"] * 16 * 2 * 6), UniformPolicy()):
        sessions = await run_all(game.source(policy, sampling=Sampling(seed=0)), tasks, 2)
        assert {s.status for s in sessions} == {Status.COMPLETED}
        assert [len(s.calls) for s in sessions] == [game.turns(t) for t in tasks for _ in "ab"]
        assert all(len(c.completion) == 1 for s in sessions for c in s.calls)
        assert all(len(chains(s)) == 1 for s in sessions)
    longest = max(len(s.calls[-1].prompt) + 1 for s in sessions)
    assert longest <= game.max_context()
    six = next(task for task in tasks if game.turns(task) == game.max_turns)
    (replied,) = await run_all(game.source(Replies(["77"] * 6)), [six], 1)
    assert len(replied.calls[-1].prompt) + 1 == game.max_context()


async def test_copy_digits_reaches_every_ending():
    game = CopyDigits(length=3)
    task = Task("9")
    answer = game.answer(task)
    completed = await run_all(game.source(PromptStop(answer)), [task], 1)
    assert (completed[0].status, completed[0].reward) == (Status.COMPLETED, 1.0)
    long = await run_all(game.source(Replies([answer + "77"])), [task], 1)
    assert (long[0].status, long[0].truncation) == (Status.TRUNCATED, "length")
    assert long[0].reward == pytest.approx(3 / 4)


@attrs.define(eq=False)
class PromptStop:
    """An engine answering `text` and <|im_end|>."""

    text: str

    async def generate(self, prompt, *, max_tokens, stop=(), **sampling) -> Call:
        completion = np.append(tokenizer.encode(self.text), tokenizer.IM_END).astype(np.int32)
        return Call(
            np.asarray(prompt, np.int32),
            completion[:max_tokens],
            np.zeros(len(completion[:max_tokens]), np.float32),
            version=0,
        )


@pytest.mark.parametrize(
    "game", [CopyDigits(), GuessDigit(), EchoDigits()], ids=["copy", "guess", "echo"]
)
async def test_uniform_random_policy_earns_some_reward(game):
    source = game.source(UniformPolicy(), sampling=Sampling(seed=0))
    sessions = await run_all(source, [Task(str(i)) for i in range(64)], 16)
    rewards = np.array([s.reward for s in sessions], float)
    assert 0 < rewards.mean() < 0.1
    assert (rewards > 0).mean() < 0.5, "a random policy mostly earns nothing"


@pytest.mark.medium
async def test_tasks_run_on_the_real_engine():
    copy, guess = CopyDigits(), GuessDigit(max_context=CONFIG.max_len)
    echo = EchoDigits(max_turns=2)
    assert echo.max_context() <= CONFIG.max_len
    tasks = [Task(str(i)) for i in range(8)]
    async with RolloutServer(CONFIG, params(), slots=SLOTS) as server:
        copied = await run_all(copy.source(server, sampling=Sampling(seed=0)), tasks, 4)
        guessed = await run_all(guess.source(server, sampling=Sampling(seed=0)), tasks, 4)
        echoed = await run_all(echo.source(server, sampling=Sampling(seed=0)), tasks, 4)
    assert {s.status for s in copied} <= {Status.COMPLETED, Status.TRUNCATED}
    assert all(len(s.calls) == 1 and len(s.calls[0].completion) <= 2 for s in copied)
    assert {s.status for s in guessed} <= {Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED}
    assert all(len(chains(s)) == 1 for s in guessed + echoed)
    assert {s.status for s in echoed} == {Status.COMPLETED}
    turns = [echo.turns(task) for task in tasks for _ in range(4)]
    assert [len(s.calls) for s in echoed] == turns
    assert set(turns) == {1, 2}
    rewards = [s.reward for s in copied + guessed + echoed]
    assert all(0 <= reward <= 1 for reward in rewards)
