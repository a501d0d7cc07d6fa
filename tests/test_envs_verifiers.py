"""verifiers environments and TextArena games as session sources, offline.

Two verifiers environments built here (`_vf_copy`: single turn, a rubric of two rewards and a
metric; `_vf_lookup`: an MCP tool the agent calls, then its answer) and TextArena's Wordle each
train a few steps through `RolloutScheduler` with dew's engine (behind the gateway for
verifiers); the statuses and rewards are the environments' own. Wordle reads nltk data that is
not on this machine: the tests write a small `words` corpus and a tagger that tags each of its
words a noun into a folder of their own, and point nltk at it.

On trio's real clock: the gateway's sockets, verifiers' asyncio thread and the tool servers'
processes are real.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import attrs
import jax
import numpy as np
import optax
import pytest
import verifiers.v1 as vf

from _gateway import CONFIG, ScriptedEngine, params, tiny_server, tool_call
from _vf_lookup import TABLE
from dew import models
from dew.data import ArrayDataset
from dew.envs.environment import Episode, Seated
from dew.envs.textarena import TextArena, verify
from dew.envs.verifiers import HARNESS_ID, Verifiers, load_env
from dew.gateway import Gateway, ServedGateway
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import Label, Status, chains
from dew.serve import RolloutServer, ServedSource, tokenizer
from dew.train import Trainer

# verifiers' MCP client retries with tenacity's deprecated `initial=` (a DeprecationWarning that
# pytest's filterwarnings=error would make the tool calls' error).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The 'initial' parameter is deprecated:DeprecationWarning"
)
TESTS = str(Path(__file__).parent)
WORDS = ["crane", "slate", "apple", "house", "plant", "bread", "chair", "stone"]


@pytest.fixture
def tool_servers(monkeypatch):
    """verifiers starts each task's tool server as `python -m _vf_lookup`: it must import."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))


@pytest.fixture
def nltk_data(tmp_path, monkeypatch):
    """A small nltk data folder with what Wordle reads: the `words` corpus and the tagger."""
    return use_nltk_data(tmp_path, monkeypatch)


def use_nltk_data(tmp_path, monkeypatch):
    """Write nltk's `words` corpus of WORDS and a tagger that tags each a noun under
    `tmp_path`, point nltk at it (forgetting a corpus an earlier test loaded from its own
    folder), and return the folder."""
    import nltk

    root = tmp_path / "nltk_data"
    (root / "corpora" / "words").mkdir(parents=True)
    for name in ("en", "en-basic"):
        (root / "corpora" / "words" / name).write_text("\n".join(WORDS) + "\n")
    tagger = root / "taggers" / "averaged_perceptron_tagger_eng"
    tagger.mkdir(parents=True)
    parts = {"weights": {}, "tagdict": dict.fromkeys(WORDS, "NN"), "classes": ["NN"]}
    for part, value in parts.items():
        (tagger / f"averaged_perceptron_tagger_eng.{part}.json").write_text(json.dumps(value))
    monkeypatch.setattr(nltk.data, "path", [str(root)])
    unload_words()
    return root


def unload_words() -> None:
    """Forget the `words` corpus nltk loaded, and the folder it read: nltk refuses to read a
    folder no longer on its path, such as another test's."""
    from nltk.corpus import words
    from nltk.corpus.util import LazyCorpusLoader

    if not isinstance(words, LazyCorpusLoader):
        words._unload()


class Recording:
    """A source that keeps every session it returned."""

    def __init__(self, source):
        self.source = source
        self.sessions = []

    async def run(self, task, label):
        session = await self.source.run(task, label)
        self.sessions.append((task, session))
        return session


def engine(max_len: int) -> tuple[models.TransformerConfig, RolloutServer]:
    """The tiny test model with `max_len` positions, and a server of it."""
    config = attrs.evolve(CONFIG, max_len=max_len)
    return config, RolloutServer(config, models.init(jax.random.key(0), config), slots=4)


def train(source, server, config, tmp_path, *, tasks, steps=2, batch=2, groups=2):
    """Train `steps` steps of `batch` tasks in groups of `groups` on `server`'s model."""
    objective = GRPOObjective(models.model(config))
    scheduler = RolloutScheduler(
        objective, source, server, width=config.max_len, rows=batch * groups, tasks=tasks,
        groups=groups, ahead=0, truncation="score",
    )  # fmt: skip
    variables = params() if config == CONFIG else models.init(jax.random.key(0), config)
    trainer = Trainer(objective, optax.sgd(1e-3), variables, directory=tmp_path)
    dataset = ArrayDataset({"task_id": np.arange(batch * steps)}, batch_size=batch)
    try:
        trainer.run(scheduler, scheduler.tasks(dataset), steps=steps, ahead=0)
    finally:
        scheduler.close()
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


# --- verifiers: a single-turn environment with a rubric -----------------------------------------


@pytest.mark.medium
def test_a_single_turn_environment_trains_on_its_own_rubric(tmp_path):
    env = Verifiers.parse("verifiers:_vf_copy,digits=3", size=4)
    server = tiny_server()
    recording = []

    def make(gateway):
        source = Recording(env.source(gateway))
        recording.append(source)
        return source

    served = ServedGateway(
        server, make, {"max_context": CONFIG.max_len, "max_tokens": 4, "announce": False}
    )
    lines = train(served, server, CONFIG, tmp_path, tasks=env.tasks)
    assert [line["updates"] for line in lines] == [1, 2]
    sessions = recording[0].sessions
    assert len(sessions) == 8
    for task, session in sessions:
        assert session.status in (Status.COMPLETED, Status.TRUNCATED)
        reply = tokenizer.BYTES.decode(session.calls[0].completion)
        reply = reply.removesuffix("<|im_end|>").strip()
        digits = task.payload.data.digits
        copied = sum(a == b for a, b in zip(reply, digits, strict=False)) / 3
        length = float(len(reply) == 3)
        # The environment's own rubric: its rewards' weighted sum, each score a component.
        assert session.reward == pytest.approx(copied + 0.1 * length)
        assert session.components == {
            "copied": copied,
            "length": length,
            "metric/reply_length": len(reply),
        }
        if session.status is Status.TRUNCATED:
            assert session.truncation == "length"  # 4 tokens without the end of the reply
    assert served.gateway.open_sessions == 0


# --- verifiers: a multi-turn environment with a tool --------------------------------------------


@pytest.mark.medium
async def test_a_tool_environment_looks_up_then_answers_in_one_chain(tool_servers):
    env = Verifiers.parse("_vf_lookup", size=3)
    engine = ScriptedEngine([tool_call("lookup", {"key": "a"}), TABLE["a"]])
    async with Gateway(engine, max_context=1024, max_tokens=96, announce=False) as gateway:
        session = await env.source(gateway).run(env.task(0), Label(0, 0, 0))
    assert session.status is Status.COMPLETED, session.error
    assert session.reward == 1.0
    assert session.components == {"answered": 1.0, "metric/lookups": 1.0}
    # The tool's result came back in the second call's prompt, which extends the first call.
    assert len(session.calls) == 2 and len(chains(session)) == 1
    assert "7" in tokenizer.BYTES.decode(session.calls[1].prompt[len(session.calls[0].prompt) :])


@pytest.mark.medium
def test_a_tool_environment_trains_end_to_end(tmp_path, tool_servers):
    env = Verifiers.parse("_vf_lookup", size=2)
    config, server = engine(512)  # the tools turn (the tool's schema) takes about 400 tokens
    recording = []

    def make(gateway):
        recording.append(Recording(env.source(gateway)))
        return recording[-1]

    served = ServedGateway(server, make, {"max_context": 512, "max_tokens": 4, "announce": False})
    lines = train(served, server, config, tmp_path, tasks=env.tasks, batch=1)
    assert [line["updates"] for line in lines] == [1, 2]
    for task, session in recording[0].sessions:
        # The untrained model writes no tool call: its reply ends the episode, scored 0 but
        # where it wrote the value itself.
        assert session.status in (Status.COMPLETED, Status.TRUNCATED), session.error
        reply = tokenizer.BYTES.decode(session.calls[-1].completion).removesuffix("<|im_end|>")
        answered = float(reply.strip() == TABLE[task.payload.data.key])
        assert session.components["answered"] == answered == session.reward


def _best_of_two():
    """verifiers' best-of-n env over `_vf_copy`: one agent, two attempts an episode."""
    agent = {"runtime": {"type": "subprocess"}, "harness": {"id": HARNESS_ID}}
    config = vf.resolve_env_config(
        {"id": "best-of-n", "n": 2, "taskset": {"id": "_vf_copy", "digits": 3}, "agent": agent}
    )
    return Verifiers(vf.load_environment(config), size=4)


@pytest.mark.medium
async def test_an_episode_of_several_traces_gives_each_its_own_reward_and_calls():
    """Best-of-n runs one agent twice: each attempt is a seat (`agent.0`, `agent.1`) with its
    own reward, its calls tagged by the trace id verifiers sends with them, and its rewards
    components of their own; the session's reward is their sum."""
    env = _best_of_two()
    digits = env.task(0).payload.data.digits
    replies = [digits, "9" * 3]  # one attempt copies the digits, the other does not
    async with Gateway(ScriptedEngine(replies), max_context=128, max_tokens=8, announce=False) as g:
        session = await env.source(g).run(env.task(0), Label(0, 0, 0))
    assert session.status is Status.COMPLETED and len(session.calls) == 2
    assert sorted(call.seat for call in session.calls) == ["agent.0", "agent.1"]
    parts = session.components
    assert {k.split("/", 1)[0] for k in parts} == {"agent.0", "agent.1"}
    for seat in ("agent.0", "agent.1"):
        own = parts[f"{seat}/copied"] + 0.1 * parts[f"{seat}/length"]
        assert session.seats[seat] == pytest.approx(own)
    # Each call trains on the reward of the attempt that made it.
    copied = {
        call.seat: tokenizer.BYTES.decode(call.completion).startswith(digits)
        for call in session.calls
    }
    for seat, did in copied.items():
        assert (session.seats[seat] > 1.0) == did
    assert session.reward == pytest.approx(sum(session.seats.values()))


@pytest.mark.medium
def test_an_environment_of_several_traces_trains_each_on_its_own_reward(tmp_path):
    env = _best_of_two()
    server = tiny_server()
    recording = []

    def make(gateway):
        recording.append(Recording(env.source(gateway)))
        return recording[-1]

    served = ServedGateway(
        server, make, {"max_context": CONFIG.max_len, "max_tokens": 4, "announce": False}
    )
    lines = train(served, server, CONFIG, tmp_path, tasks=env.tasks)
    assert [line["updates"] for line in lines] == [1, 2]
    sessions = [session for _, session in recording[0].sessions]
    assert len(sessions) == 8
    for session in sessions:
        assert set(session.seats) == {"agent.0", "agent.1"}
        assert {call.seat for call in session.calls} == {"agent.0", "agent.1"}


# --- verifiers: errors and refusals -------------------------------------------------------------


async def test_an_environment_that_raises_is_an_agent_error_counted_and_reported(caplog):
    env = Verifiers.parse('_vf_copy,task={"broken": true}', size=2)
    engine = ScriptedEngine(["123"])
    caplog.set_level(logging.WARNING, "dew.envs.verifiers")
    async with Gateway(engine, max_context=128, max_tokens=8, announce=False) as gateway:
        source = env.source(gateway)
        sessions = [await source.run(env.task(i % 2), Label(i, 0, 0)) for i in range(10)]
    assert {s.status for s in sessions} == {Status.AGENT_ERROR}
    error = sessions[0].error
    assert "the copy task broke" in error and error.startswith("TaskError")
    assert all(s.reward == 0.0 and s.calls == () for s in sessions)
    assert source.errors.most_common(1) == ((error, 10),)
    reported = [r.getMessage() for r in caplog.records]
    assert len(reported) == 2 and "1 rollouts" in reported[0] and "10 rollouts" in reported[1]


def test_an_environment_not_installed_names_the_package_to_install():
    with pytest.raises(ImportError, match="'no-such-env' is not installed.*'no_such_env'"):
        Verifiers.parse("verifiers:no-such-env")


def pinned(agent):
    config = vf.resolve_env_config({"taskset": {"id": "_vf_copy"}, "agent": agent})
    return vf.load_environment(config)


@pytest.mark.parametrize(
    "agent, culprit",
    [
        ({"harness": {"id": "bash"}, "runtime": {"type": "subprocess"}}, "harness 'bash'"),
        ({"harness": {"id": "dew-chat"}, "runtime": {"type": "prime"}}, "'prime' runtime"),
        ({"harness": {"id": "dew-chat"}, "runtime": {"type": "docker"}}, "'docker' runtime"),
    ],
)
def test_an_environment_needing_the_network_or_a_sandbox_is_refused_naming_it(agent, culprit):
    with pytest.raises(ValueError, match=culprit):
        Verifiers(pinned(agent), size=2)


def test_a_dataset_that_would_download_is_refused_naming_the_environment():
    with pytest.raises(
        ValueError, match="'_vf_copy' cannot load its tasks here: .* .dew loads them offline"
    ):
        Verifiers.parse("_vf_copy,hub_file=openai/gsm8k", size=2)


def test_bad_options_name_the_culprit():
    with pytest.raises(ValueError, match="refuses.*digitz"):
        load_env("_vf_copy", {"digitz": 3})
    with pytest.raises(ValueError, match="'digits' is given twice"):
        Verifiers.parse("_vf_copy,digits=3,digits=4")
    with pytest.raises(ValueError, match="fewer than the 13"):
        Verifiers(load_env("_vf_lookup"), size=13)


# --- TextArena ----------------------------------------------------------------------------------


@pytest.mark.medium
def test_wordle_trains_end_to_end_with_the_games_own_rewards(tmp_path, nltk_data):
    game = TextArena.parse("textarena:Wordle-v0")
    config, server = engine(1024)
    source = Recording(game.source(server, max_tokens=8, max_turns=2, max_context=1024))
    lines = train(ServedSource(source, server), server, config, tmp_path, tasks=game.tasks)
    assert [line["updates"] for line in lines] == [1, 2]
    for task, session in source.sessions:
        env = game.environment()
        env.reset(task)
        for call in session.calls[:-1]:  # replay the agent's moves in the game
            assert not env.step(tokenizer.BYTES.decode(call.completion))[1]
        if session.status is Status.COMPLETED:
            done = env.step(tokenizer.BYTES.decode(session.calls[-1].completion))[1]
            assert done and session.reward == env.reward
        else:
            # Two moves and the game goes on: dew cut it, scored as Wordle scores a loss.
            assert (session.status, session.truncation, session.reward) == (
                Status.TRUNCATED, "turns", 0.0,
            )  # fmt: skip


def test_tictactoe_plays_a_fixed_seeded_opponent():
    game = TextArena.parse("TicTacToe-v0", seed=3)
    first, again = game.environment(), game.environment()
    task = game.tasks({"task_id": [5]})[0]
    assert first.reset(task) == again.reset(task)
    moves = [first.step(f"[{cell}]") for cell in (4, 0, 8, 2, 6)]
    assert moves == [again.step(f"[{cell}]") for cell in (4, 0, 8, 2, 6)][: len(moves)]
    assert "Player 1: [" in moves[0][0]  # the opponent answered at once


def test_tictactoe_self_play_seats_both_players_each_seeing_the_others_moves():
    game = TextArena.parse("textarena:TicTacToe-v0,self_play=true", seed=3)
    env = game.environment()
    task = game.tasks({"task_id": [5]})[0]
    seen = [env.reset(task)]
    for cell in (0, 3, 1, 4, 2):  # player 0 takes the top row
        observation, done = env.step(f"[{cell}]")
        seen.append(observation)
    assert done and seen[-1] is None
    assert [s.seat for s in seen[:-1]] == ["player0", "player1"] * 2 + ["player0"]
    assert all(isinstance(s, Seated) for s in seen[:-1])
    # Each sees the other's move named, and not its own.
    assert "Player 0: [0]" in seen[1].observation and "Player 1: [3]" in seen[2].observation
    assert "Player 0: [0]" not in seen[2].observation
    actions = ("[0]", "[3]", "[1]", "[4]", "[2]")
    score = verify(env, Episode(task, (), actions, Status.COMPLETED))
    assert score.seats == {"player0": 1.0, "player1": -1.0} and score.reward == 0.0
    assert (score.components["player0/win"], score.components["player1/win"]) == (1.0, 0.0)


@pytest.mark.medium
def test_tictactoe_self_play_trains_each_player_on_its_own_reward(tmp_path):
    game = TextArena.parse("textarena:TicTacToe-v0,self_play=true")
    config, server = engine(1024)
    source = Recording(game.source(server, max_tokens=4, max_turns=4, max_context=1024))
    lines = train(ServedSource(source, server), server, config, tmp_path, tasks=game.tasks)
    assert [line["updates"] for line in lines] == [1, 2]
    for _, session in source.sessions:
        assert session.calls and set(session.seats) == {"player0", "player1"}
        # Player 0 moves first (and again after a move the game refused).
        played = [call.seat for call in session.calls]
        assert played[0] == "player0" and set(played) <= {"player0", "player1"}
        assert session.reward == sum(session.seats.values())
        # Each player's conversation is one chain, however their calls interleave.
        assert len(chains(session)) == len(set(played))


def test_connect_four_is_played_against_itself_only():
    game = TextArena.parse("textarena:ConnectFour-v0,self_play=true")
    env = game.environment()
    task = game.tasks({"task_id": [0]})[0]
    seats = [env.reset(task).seat]
    for column in (0, 1, 0, 1, 0, 1, 0):  # player 0 stacks four in column 0
        observation, done = env.step(f"[col {column}]")
        seats.append(None if done else observation.seat)
    assert seats == ["player0", "player1"] * 3 + ["player0", None]
    score = verify(env, Episode(task, (), ("[col 0]",) * 7, Status.COMPLETED))
    assert score.seats == {"player0": 1.0, "player1": -1.0}
    with pytest.raises(ValueError, match="ConnectFour-v0 has no fixed opponent.*self_play=true"):
        TextArena.parse("textarena:ConnectFour-v0")


def test_self_play_is_refused_for_a_game_of_one_player(nltk_data):
    with pytest.raises(ValueError, match="Wordle-v0 has one player: self_play needs two"):
        TextArena.parse("textarena:Wordle-v0,self_play=true")
    with pytest.raises(ValueError, match="self_play must be true or false"):
        TextArena.parse("textarena:TicTacToe-v0,self_play=yes")


@pytest.mark.medium
def test_wordle_without_its_nltk_data_is_refused_naming_it(monkeypatch, tmp_path):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    with pytest.raises(ValueError, match="words, averaged_perceptron_tagger_eng.*nltk.downloader"):
        TextArena.parse("textarena:Wordle-v0")
    with pytest.raises(ValueError, match="dew plays TextArena games Wordle-v0.*not 'Chess-v0'"):
        TextArena.parse("Chess-v0")
