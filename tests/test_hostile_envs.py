"""dew's adapters under real environments of reasoning-gym, TextArena and verifiers, driven by a
scripted engine: rewards are the library's own, tokens are what was sampled, and what goes wrong
in the library reaches the session with its text, classified as the environments page says.

The verifiers tests plug reward functions of this module into real tasksets (verifiers' own
`task.rewards` config, `fn` = `test_hostile_envs:NAME`), and load `HostileTaskset` of this
module as the taskset `test_hostile_envs` (it is exported through `__all__`, as verifiers reads
a taskset package). On trio's real clock: the gateway's sockets and verifiers' asyncio thread
are real.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest
import trio
import verifiers.v1 as vf

from _gateway import ScriptedEngine, tool_call
from _vf_lookup import TABLE
from dew.data import Task
from dew.envs.reasoning_gym import ReasoningGym
from dew.envs.textarena import TextArena
from dew.envs.verifiers import HARNESS_ID, Verifiers, parse_spec
from dew.gateway import Gateway
from dew.objectives.rl.sessions import Call, Label, Status, chains, check_session
from dew.serve import tokenizer
from test_envs_verifiers import WORDS, unload_words, use_nltk_data

# verifiers' MCP client retries with tenacity's deprecated `initial=` (as in
# tests/test_envs_verifiers.py).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The 'initial' parameter is deprecated:DeprecationWarning"
)
__all__ = ["HostileTaskset"]
LABEL = Label(0, 0, 0)
TESTS = str(Path(__file__).parent)


@attrs.define(eq=False)
class Replier:
    """An engine whose reply to call i is `reply(prompt text, i)`, closed by <|im_end|> and cut
    at `max_tokens`; it keeps each call it served."""

    reply: Callable[[str, int], str]
    served: list[Call] = attrs.field(factory=list)

    async def generate(self, prompt, *, max_tokens, stop=(), key=None, **sampling) -> Call:
        text = self.reply(tokenizer.BYTES.decode(np.asarray(prompt)), len(self.served))
        ids = np.append(tokenizer.BYTES.encode(text), tokenizer.BYTES.eos_id)[:max_tokens]
        logprobs = -np.linspace(0.1, 1.0, len(ids), dtype=np.float32)
        call = Call(np.asarray(prompt, np.int32), ids.astype(np.int32), logprobs, 0)
        self.served.append(call)
        return call


def scripted(*replies: str) -> Replier:
    """Replies in order, the last one repeating."""
    return Replier(lambda prompt, i: replies[min(i, len(replies) - 1)])


def as_served(session, engine) -> bool:
    """Whether the session's calls are the engine's, token for token."""
    served = engine.served
    return len(session.calls) == len(served) and all(
        np.array_equal(c.prompt, s.prompt)
        and np.array_equal(c.completion, s.completion)
        and np.array_equal(c.logprobs, s.logprobs)
        for c, s in zip(session.calls, served, strict=True)
    )


def moves(session) -> list[str]:
    return [
        tokenizer.BYTES.decode(call.completion).removesuffix("<|im_end|>") for call in session.calls
    ]


# --- reasoning-gym ------------------------------------------------------------------------------


def test_specs_take_json_values_that_hold_commas():
    """A list of two operators is `["+","-"]`: its comma is not the next option's."""
    spec = 'reasoning-gym:basic_arithmetic,operators=["+","-"],min_terms=2,max_terms=3'
    arithmetic = ReasoningGym.parse(spec, size=4)
    assert arithmetic.options == {"operators": ["+", "-"], "min_terms": 2, "max_terms": 3}
    assert set(re.findall(r"[+\-*/]", arithmetic.entry(0)["question"])) <= {"+", "-"}
    task = 'verifiers:_vf_copy,task={"broken": true, "judges": []},note="a, b",digits=3'
    assert parse_spec(task, "verifiers:") == (
        "_vf_copy",
        {"task": {"broken": True, "judges": []}, "note": "a, b", "digits": 3},
    )
    with pytest.raises(ValueError, match="'max_terms' is given twice"):
        ReasoningGym.parse("chain_sum,max_terms=[2,3],max_terms=3", size=2)


RG_SETS = [
    "basic_arithmetic,min_terms=2,max_terms=3",
    "chain_sum",
    "leg_counting,max_animals=3",
    "mini_sudoku",
    "n_queens",
]


@pytest.mark.parametrize("spec", RG_SETS)
async def test_a_reasoning_gym_reward_is_the_datasets_own_score(spec):
    data = ReasoningGym.parse(spec, size=3, seed=5)
    for index in range(3):
        task = data.task(index)
        answer = task.payload["answer"]
        for reply in (answer, answer[:-1] + "?", "no idea"):
            engine = scripted(reply)
            session = check_session(await data.source(engine, max_tokens=400).run(task, LABEL))
            assert session.status is Status.COMPLETED
            assert session.reward == data._dataset.score_answer(reply, task.payload)
            assert session.components == {"exact": float(reply == answer)}
            assert as_served(session, engine)
        assert session.reward < 1.0  # "no idea"


async def test_a_scorer_that_raises_is_an_infra_error_naming_the_dataset():
    """reasoning-gym's boxnet scorer raises on a reply that is a JSON number: the rollout is
    an INFRA_ERROR (PromptSource's verifier failing) whose error names the dataset."""
    boxes = ReasoningGym.parse("boxnet", size=1, seed=0)
    engine = scripted("1")
    session = check_session(await boxes.source(engine, max_tokens=8).run(boxes.task(0), LABEL))
    assert session.status is Status.INFRA_ERROR and as_served(session, engine)
    assert "reasoning-gym boxnet: score_answer raised TypeError" in session.error


def test_an_entry_without_question_or_a_score_that_is_no_number_is_named(monkeypatch):
    legs = ReasoningGym.parse("leg_counting", size=2)
    with pytest.raises(ValueError, match="reasoning-gym leg_counting task '1': its entry has no q"):
        legs.prompt(Task("1", payload={"answer": "4"}))
    # An entry without its answer reaches the scorer, which names what it missed.
    with pytest.raises(ValueError, match=r"leg_counting: score_answer raised KeyError: 'answer'"):
        legs.verify(Task("1", payload={"question": "?"}), "4")
    monkeypatch.setattr(legs._dataset, "score_answer", lambda answer, entry: math.nan)
    with pytest.raises(ValueError, match="leg_counting: score_answer gave nan, not a finite"):
        legs.verify(legs.task(0), "4")


# --- TextArena ----------------------------------------------------------------------------------


@pytest.fixture
def nltk_data(tmp_path, monkeypatch):
    """What Wordle reads, as tests/test_envs_verifiers.py writes it: nltk's `words` corpus of
    WORDS and a tagger that tags each a noun."""
    use_nltk_data(tmp_path, monkeypatch)
    unload_words()
    yield
    unload_words()


def replayed(game: TextArena, task: Task, actions: list[str]):
    """The game of `task` played again with `actions` (the opponent is seeded by the task)."""
    env = game.environment()
    env.reset(task)
    for action in actions:
        _, done = env.step(action)
    assert done
    return env


def free_cell(prompt: str) -> str:
    """The first cell of the latest "Available Moves" a TicTacToe prompt lists."""
    return re.findall(r"'\[(\d)\]'", prompt.rsplit("Available Moves:", 1)[-1])[0]


async def test_tictactoe_invalid_moves_are_retried_as_textarena_allows_to_the_games_end():
    """textarena lets a player retry one invalid move before each valid one: a game of 5 moves
    takes the agent up to 10, and dew's default limit lets it end by the game's own rules (the
    byte tokenizer's conversation of 10 moves is 3.7k tokens: a context to hold it)."""
    game = TextArena.parse("textarena:TicTacToe-v0", seed=0)
    task = game.tasks({"task_id": [4]})[0]  # the seeded opponent lets the agent play 5 moves
    engine = Replier(lambda prompt, i: "no move" if i % 2 == 0 else f"[{free_cell(prompt)}]")
    source = game.source(engine, max_tokens=16, max_context=4096)
    session = check_session(await source.run(task, LABEL))
    assert session.status is Status.COMPLETED and as_served(session, engine)
    assert len(session.calls) == game.max_turns == 10  # dew's old limit: 6
    assert session.reward == replayed(game, task, moves(session)).reward == 1.0
    assert session.components["invalid_move"] == 0.0


async def test_tictactoe_self_play_with_retried_moves_ends_in_the_games_draw():
    game = TextArena.parse("textarena:TicTacToe-v0,self_play=true")
    task = game.tasks({"task_id": [0]})[0]
    draw = ["[0]", "[1]", "[2]", "[4]", "[3]", "[5]", "[7]", "[6]", "[8]"]
    engine = scripted(*(move for cell in draw for move in ("no move", cell)))
    source = game.source(engine, max_tokens=16, max_context=8192)
    session = check_session(await source.run(task, LABEL))
    assert (session.status, session.reward, len(session.calls)) == (Status.COMPLETED, 0.0, 18)
    assert session.seats == {"player0": 0.0, "player1": 0.0}
    # The refused move and its retry are the same player's.
    assert [call.seat for call in session.calls] == [
        f"player{i % 2}" for i in range(9) for _ in "ab"
    ]
    assert len(chains(session)) == 2 and as_served(session, engine)


async def test_two_invalid_moves_in_a_row_lose_the_game_for_that_seat_only():
    game = TextArena.parse("textarena:TicTacToe-v0,self_play=true")
    task = game.tasks({"task_id": [0]})[0]
    engine = scripted("[4]", "no move", "[4]")  # player 1: no cell, then a taken one
    session = check_session(await game.source(engine, max_tokens=16).run(task, LABEL))
    assert session.status is Status.COMPLETED and len(session.calls) == 3
    assert session.seats == {"player0": 1.0, "player1": -1.0}  # textarena's invalid-move end
    assert [call.seat for call in session.calls] == ["player0", "player1", "player1"]
    assert session.components["invalid_move"] == 1.0 and session.reward == 0.0


@pytest.mark.parametrize("guesses", [6, 7])
async def test_wordle_plays_as_many_guesses_as_its_options_give(nltk_data, guesses):
    """Each guess after a refused one: 2 moves a guess, past dew's old limit of 8, and
    `num_guesses` sets how many; the reward is Wordle's own for the last guess."""
    game = TextArena.parse(f"textarena:Wordle-v0,num_guesses={guesses}", seed=2)
    task = game.tasks({"task_id": [3]})[0]
    secret = game.environment()
    secret.reset(task)
    wrong = [w for w in WORDS if w != secret.env.state.game_state["secret_word"]]
    engine = scripted(*(move for word in wrong[:guesses] for move in ("[zz]", f"[{word}]")))
    source = game.source(engine, max_tokens=16, max_context=4096)
    session = check_session(await source.run(task, LABEL))
    assert session.status is Status.COMPLETED and len(session.calls) == 2 * guesses
    env = replayed(game, task, moves(session))
    assert session.reward == env.reward == env.env._get_percentage_completion()
    assert game.max_turns == 2 * guesses and as_served(session, engine)


@pytest.mark.medium
def test_options_that_leave_no_game_to_play_are_refused_at_load(nltk_data):
    """A Wordle of 4 letters over a word list of 5-letter words has no word to draw: each
    rollout's reset would raise (an INFRA_ERROR, resubmitted until its group is abandoned)."""
    with pytest.raises(ValueError, match=r"Wordle-v0 with options \{'word_length': 4\} cannot st"):
        TextArena.parse("textarena:Wordle-v0,word_length=4")
    assert TextArena.parse("textarena:Wordle-v0,word_length=5").max_turns == 12


@pytest.mark.parametrize(
    "spec", ["ConnectFour-v0,num_rows=0,self_play=true", "Wordle-v0,num_guesses=0"]
)
def test_options_that_leave_no_move_are_refused_naming_them(nltk_data, spec):
    """A board of no cells, or no guesses, starts a game the player has no move in."""
    with pytest.raises(ValueError, match=r"with options \{'num_.*': 0\} leaves the player no"):
        TextArena.parse(spec)


@pytest.mark.parametrize("self_play", [False, True])
async def test_a_move_the_game_raises_on_is_the_agents_error_scored_as_a_loss(self_play):
    """TicTacToe reads a cell with `int`, which refuses 5000 digits: the game raises on the
    move. It is the policy's move: AGENT_ERROR naming the game, scored as its loss."""
    game = TextArena("TicTacToe-v0", seed=0, self_play=self_play)
    task = game.tasks({"task_id": [0]})[0]
    engine = scripted("[" + "9" * 5000 + "]")
    source = game.source(engine, max_tokens=6000, max_context=8192)
    session = check_session(await source.run(task, LABEL))
    assert session.status is Status.AGENT_ERROR and as_served(session, engine)
    assert session.error.startswith("textarena TicTacToeEnv raised on the move of player 0: ")
    assert "ValueError: Exceeds the limit (4300 digits)" in session.error
    if self_play:
        assert session.seats == {"player0": -1.0, "player1": -1.0}
    else:
        assert session.reward == -1.0


# --- verifiers ----------------------------------------------------------------------------------


async def nan_reward(trace) -> float:
    return math.nan


async def nan_for_nines(trace) -> float:
    return math.nan if trace.last_reply.startswith("9") else 1.0


async def brevity(trace) -> float:
    return 1.0 / len(trace.last_reply)


async def divides(trace) -> float:
    return 1 / (len(trace.last_reply) - 3)


async def cancels(trace) -> float:
    raise asyncio.CancelledError


async def exits(trace) -> float:
    raise SystemExit(3)


def plugged(name: str, weight: float | None = None) -> dict:
    """A reward of this module, as verifiers' task config plugs one."""
    return {
        name: {"fn": f"test_hostile_envs:{name}"} | ({} if weight is None else {"weight": weight})
    }


def copy_env(*rewards: dict, size: int = 2) -> Verifiers:
    """`_vf_copy` (3 digits) with `rewards` plugged into its rubric, from a `dew train` spec."""
    task = {"rewards": {k: v for reward in rewards for k, v in reward.items()}}
    return Verifiers.parse(f"verifiers:_vf_copy,digits=3,task={json.dumps(task)}", size=size)


async def play(env: Verifiers, replies: list[str], tasks=(0,), max_context=256):
    """Each task's rollout on a scripted engine behind a gateway, the source and the engine."""
    engine = ScriptedEngine(replies)
    async with Gateway(engine, max_context=max_context, max_tokens=96, announce=False) as gateway:
        source = env.source(gateway)
        with trio.fail_after(60):
            sessions = [await source.run(env.task(i), Label(i, 0, 0)) for i in tasks]
    return [check_session(s) for s in sessions], source, engine


async def test_a_weighted_rubric_of_several_rewards_is_verifiers_own_sum():
    """`_vf_copy`'s two rewards, `length` re-weighted to 2, and a plugged third at -0.5."""
    env = copy_env({"length": {"weight": 2.0}}, plugged("brevity", -0.5))
    digits = env.task(0).payload.data.digits
    (session,), _, engine = await play(env, [digits + "7"])
    copied = 1.0
    assert session.status is Status.COMPLETED
    assert session.components == {
        "copied": copied,
        "length": 0.0,
        "brevity": 0.25,
        "metric/reply_length": 4.0,
    }
    assert session.reward == copied + 2.0 * 0.0 - 0.5 * 0.25
    assert as_served(session, engine)


@pytest.mark.medium
async def test_a_reward_that_raises_is_the_environments_failure_with_its_text_counted():
    """The rubric's own exception is the environment's failure (INFRA_ERROR, trained on
    nothing), not the agent's (AGENT_ERROR trained the reply on a reward of 0)."""
    env = copy_env(plugged("divides"))
    sessions, source, _ = await play(env, ["123"], tasks=(0, 1))
    error = "TaskError: task CopyTask scoring: ZeroDivisionError: division by zero"
    assert [(s.status, s.error) for s in sessions] == [(Status.INFRA_ERROR, error)] * 2
    assert sessions[0].components == {"metric/reply_length": 3.0}  # scored before the rewards
    assert source.errors.most_common(1) == ((error, 2),)


async def test_a_reward_that_is_not_finite_is_an_agent_error_naming_it():
    """A reward function that returns nan: verifiers records it, and dew, rather than a reward
    of 0 nothing reports, makes the rollout an AGENT_ERROR naming the reward, counted."""
    env = copy_env(plugged("nan_reward", 0.5))
    sessions, source, _ = await play(env, ["123"], tasks=(0, 1))
    for session in sessions:
        assert session.status is Status.AGENT_ERROR and session.reward == 0.0
        assert "reward 'nan_reward' scored nan at weight 0.5, not a finite number" in session.error
        assert "copied" in session.components and "nan_reward" not in session.components
    assert source.errors.most_common(1) == ((sessions[0].error, 2),)


async def test_a_seat_whose_reward_is_not_finite_scores_0_beside_the_others_own():
    agent = {"runtime": {"type": "subprocess"}, "harness": {"id": HARNESS_ID}}
    taskset = {"id": "_vf_copy", "digits": 3, "task": {"rewards": plugged("nan_for_nines")}}
    config = vf.resolve_env_config({"id": "best-of-n", "n": 2, "taskset": taskset, "agent": agent})
    env = Verifiers(vf.load_environment(config), size=1)
    digits = env.task(0).payload.data.digits
    (session,), _, _ = await play(env, [digits, "999"])
    assert session.status is Status.AGENT_ERROR
    assert "reward 'agent.1/nan_for_nines' scored nan" in session.error
    copied = sum(a == b for a, b in zip("999", digits, strict=True)) / 3
    assert session.seats == {"agent.0": pytest.approx(2.1), "agent.1": 0.0}
    assert session.components["agent.1/copied"] == copied
    assert session.reward == pytest.approx(2.1)


@pytest.mark.parametrize(
    ("reward", "error"),
    [
        (
            "cancels",
            "CancelledError: the episode was cancelled inside the environment (it raised "
            "asyncio's CancelledError), not by dew",
        ),
        ("exits", "RuntimeError: the environment raised SystemExit: 3"),
    ],
    ids=["cancels", "exits"],
)
async def test_an_environment_that_cancels_or_exits_ends_its_episode_not_the_run(reward, error):
    """Both escape verifiers' own error boundaries. A CancelledError made the source raise
    (a bare CancelledError ending the run); a SystemExit ended the asyncio loop's thread, and
    every later episode waited on it for good. Each is now its rollout's AGENT_ERROR."""
    env = copy_env(plugged(reward))
    sessions, source, _ = await play(env, ["123"], tasks=(0, 1))
    assert [(s.status, s.reward, s.error) for s in sessions] == [
        (Status.AGENT_ERROR, 0.0, error)
    ] * 2
    assert source.errors.most_common(1) == ((error, 2),)


@pytest.mark.medium
async def test_a_tool_environment_scores_its_weighted_rubric(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    task = {"rewards": {"answered": {"weight": 2.0}} | plugged("brevity", 0.5)}
    env = Verifiers.parse(f"_vf_lookup,task={json.dumps(task)}", size=1)
    key = env.task(0).payload.data.key
    replies = [tool_call("lookup", {"key": key}), TABLE[key]]
    (session,), _, engine = await play(env, replies, max_context=1024)
    assert session.status is Status.COMPLETED, session.error
    assert session.components == {"answered": 1.0, "brevity": 1.0, "metric/lookups": 1.0}
    assert session.reward == 2.0 * 1.0 + 0.5 * 1.0
    assert len(chains(session)) == 1 and as_served(session, engine)


class GuessConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    fail_on_turn: int = -1


class Guess(vf.Env[GuessConfig]):
    """A multi-turn environment: its user answers "higher" or "lower" until the player names
    the task's digits, three replies at most, and records a reward of its own per turn."""

    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for turn in range(3):
                if turn == self.config.fail_on_turn:
                    raise KeyError("the referee lost the score sheet")
                if segment.terminated or segment.last_reply == task.data.digits:
                    break
                hint = "higher" if segment.last_reply < task.data.digits else "lower"
                segment = await interaction.turn(hint)
        interaction.trace.record_reward("turns", float(turn), -0.25)


def guess(**options) -> Verifiers:
    agent = {"runtime": {"type": "subprocess"}, "harness": {"id": HARNESS_ID}}
    data = {"taskset": {"id": "_vf_copy", "digits": 3}, "player": agent, **options}
    return Verifiers(Guess(GuessConfig.model_validate(data)), size=1)


@pytest.mark.medium
async def test_a_multi_turn_environment_trains_one_chain_on_its_rewards():
    env = guess()
    digits = env.task(0).payload.data.digits
    (session,), _, engine = await play(env, ["000", "999", digits], max_context=512)
    assert session.status is Status.COMPLETED and len(session.calls) == 3
    assert session.components == {
        "copied": 1.0,
        "length": 1.0,
        "turns": 2.0,
        "metric/reply_length": 3.0,
    }
    assert session.reward == pytest.approx(1.0 + 0.1 - 0.25 * 2.0)
    # The user's turns continue the conversation: one chain, each call as the engine served it.
    assert len(chains(session)) == 1 and as_served(session, engine)
    hints = tokenizer.BYTES.decode(session.calls[2].prompt)
    assert "higher" in hints and "lower" in hints


@pytest.mark.medium
async def test_a_multi_turn_environment_that_raises_is_an_agent_error_with_its_text():
    (session,), source, _ = await play(guess(fail_on_turn=1), ["000", "999"], max_context=512)
    assert session.status is Status.AGENT_ERROR and session.reward == 0.0
    assert session.error == "EnvError: Guess.run(): KeyError: 'the referee lost the score sheet'"
    assert len(session.calls) == 2 and source.errors.most_common(1)[0][1] == 1


class HostileData(vf.TaskData):
    answer: str
    difficulty: int
    tags: list[str] = []


class HostileConfig(vf.TasksetConfig):
    missing_at: int = -1


class HostileTask(vf.Task[HostileData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def right(self, trace) -> float:
        return float(trace.last_reply == self.data.answer) * self.data.difficulty


class HostileTaskset(vf.Taskset[HostileTask, HostileConfig]):
    """Rows with columns the rollout does not show the agent (`difficulty`, `tags`); the row
    `missing_at` lacks its answer."""

    def load(self) -> Iterator[HostileTask]:
        for i in range(4):
            row = {"prompt": f"say {i}", "answer": str(i), "difficulty": i, "tags": ["x", "y"]}
            if i == self.config.missing_at:
                del row["answer"]
            yield HostileTask(HostileData(**row), self.config.task)


@pytest.mark.medium
async def test_a_dataset_with_extra_columns_scores_on_them_and_a_row_missing_one_is_named():
    env = Verifiers.parse("test_hostile_envs", size=4)
    assert env.prompt(env.task(3)) == [{"role": "user", "content": "say 3"}]
    sessions, _, _ = await play(env, ["3"], tasks=(3, 2))
    assert [(s.status, s.reward) for s in sessions] == [
        (Status.COMPLETED, 3.0),
        (Status.COMPLETED, 0.0),
    ]
    with pytest.raises(
        ValueError, match=r"(?s)'test_hostile_envs' cannot load.*answer\n  Field required"
    ):
        Verifiers.parse("test_hostile_envs,missing_at=2", size=4)
