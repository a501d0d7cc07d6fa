"""Hostile tests of episodes of several agents (`Seated`, `Score.seats`)."""

from __future__ import annotations

import attrs
import numpy as np

from dew.data import Task
from dew.envs.environment import EnvironmentSource, Episode, Score, Seated
from dew.objectives.rl.sessions import Call, Label, Status, chains, check_session, pack
from dew.serve import tokenizer

LABEL = Label(group=0, sample=0, attempt=0)


def reply(text: str) -> np.ndarray:
    return np.append(tokenizer.encode(text), tokenizer.IM_END).astype(np.int32)


@attrs.define(eq=False)
class Scripted:
    """Answers call i with replies[i] (cut after a stop token), recording each prompt."""

    replies: list[np.ndarray]
    prompts: list[np.ndarray] = attrs.Factory(list)

    async def generate(self, prompt, *, max_tokens, stop=(), **sampling) -> Call:
        completion = self.replies[len(self.prompts)][:max_tokens]
        self.prompts.append(np.asarray(prompt, np.int32))
        return Call(
            np.asarray(prompt, np.int32),
            completion,
            np.full(len(completion), -0.5, np.float32),
            version=0,
        )


@attrs.define(eq=False)
class Mirror:
    """Two seats, `a` then `b`, each told the same thing each round ("go", then "round 1",
    ...): `rounds` rounds."""

    rounds: int
    actions: list[str] = attrs.Factory(list)

    def reset(self, task: Task) -> Seated:
        return Seated("a", "go")

    def step(self, action: str):
        self.actions.append(action)
        if len(self.actions) == 2 * self.rounds:
            return None, True
        told = "go" if len(self.actions) < 2 else f"round {len(self.actions) // 2}"
        return Seated("ab"[len(self.actions) % 2], told), False


def zero_sum(env: Mirror, episode: Episode) -> Score:
    """Seat a wins task "0" and b task "1"."""
    a = 1.0 if episode.task.name == "0" else -1.0
    return Score(0.0, seats={"a": a, "b": -a})


def mirror_source(engine, rounds: int) -> EnvironmentSource:
    return EnvironmentSource(
        engine, lambda: Mirror(rounds), zero_sum, max_turns=8, max_tokens=8, max_context=512
    )


def advantage_of(packed, text: str) -> float:
    """The advantage a packed batch gives the one trained token `text` encodes to."""
    (token,) = tokenizer.encode(text)
    batch = packed.batch
    at = (batch["tokens"] == token) & (batch["loss_mask"] > 0)
    assert at.sum() == 1, f"{text!r} trained at {at.sum()} positions"
    return float(batch["advantages"][at][0])


async def test_two_seats_told_alike_and_replying_alike_keep_chains_of_their_own():
    """Seats whose conversations run token for token alike (the same observations, the same
    first reply) are still a chain each: a call never merges into another seat's chain, whose
    reward it would train on (here the other player's, the opposite of its own)."""
    group = []
    for task, later in (("0", "yz"), ("1", "vw")):
        engine = Scripted([reply("x"), reply("x"), reply(later[0]), reply(later[1])])
        session = await mirror_source(engine, 2).run(Task(task), LABEL)
        stamped = session.stamped(Task(task), Label(0, len(group), 0), 0.0, 0.0)
        group.append(check_session(stamped))
    assert [call.seat for call in group[0].calls] == ["a", "b", "a", "b"]
    assert all(len(chains(session)) == 2 for session in group)
    packed = pack([group], width=64, rows=4, estimator="mean")
    # a won task 0 and b task 1: each seat's second reply trains on its own seat's result.
    assert advantage_of(packed, "y") == 1.0 and advantage_of(packed, "z") == -1.0
    assert advantage_of(packed, "v") == -1.0 and advantage_of(packed, "w") == 1.0


async def test_a_verifier_may_give_seats_numpy_rewards_as_it_may_the_reward():
    """`Score.reward` takes numpy's scalars; so do its seats (as floats), or an episode scored
    with numpy would be an INFRA_ERROR saying a finite number is not one."""

    def scored_with_numpy(env: Mirror, episode: Episode) -> Score:
        rewards = np.array([1, -1])
        return Score(rewards.sum(), seats={"a": rewards[0], "b": np.float32(-0.5)})

    engine = Scripted([reply("x"), reply("y")])
    source = EnvironmentSource(
        engine, lambda: Mirror(1), scored_with_numpy, max_turns=2, max_tokens=8, max_context=512
    )
    session = check_session(await source.run(Task("0"), LABEL))
    assert session.status is Status.COMPLETED, session.error
    assert session.seats == {"a": 1.0, "b": -0.5}
    assert all(type(reward) is float for reward in session.seats.values())


async def test_a_self_play_game_cut_when_one_players_conversation_outgrows_the_context():
    """Player 1's conversation (its prompts: 730, then 1136 tokens) outgrows a 1000-token
    context at its second move while player 0's (520, 940) still fits: the game is cut, each
    player scores a loss and the session their sum, -2, as docs/environments.md says."""
    from dew.envs.textarena import TextArena

    game = TextArena.parse("textarena:TicTacToe-v0,self_play=true", seed=3)
    engine = Scripted([reply(f"[{cell}]") for cell in (0, 3, 1, 4, 2)])
    source = game.source(engine, max_tokens=8, max_context=1000)
    session = check_session(await source.run(game.tasks({"task_id": [5]})[0], LABEL))
    assert (session.status, session.truncation) == (Status.TRUNCATED, "context")
    assert [call.seat for call in session.calls] == ["player0", "player1", "player0"]
    assert [len(prompt) for prompt in engine.prompts] == [520, 730, 940]
    assert session.seats == {"player0": -1.0, "player1": -1.0} and session.reward == -2.0
    assert len(chains(session)) == 2


async def test_dew_train_gives_each_player_of_a_self_play_game_a_row():
    """Each player's conversation may run to the game's context, so `dew train` packs a row
    per player of each rollout: with a row per rollout, a batch of full games, two chains of
    over half a row each, had half its groups cut as `no_room`."""
    from dew.envs.textarena import TextArena
    from dew.train._config import TrainConfig
    from dew.train._tasks import _task

    spec = "textarena:TicTacToe-v0,self_play=true"
    game = TextArena.parse(spec, seed=3)
    context = game.game.max_context
    groups = []
    for group in range(2):
        sessions = []
        for sample in range(2):
            # Player 0 wins at its third move: five moves, each player's chain over half a row.
            engine = Scripted([reply(f"[{cell}]") for cell in (0, 3, 1, 4, 2)])
            source = game.source(engine, max_tokens=8, max_context=context)
            task = game.tasks({"task_id": [group]})[0]
            session = await source.run(task, Label(group, sample, 0))
            sessions.append(check_session(session.stamped(task, Label(group, sample, 0), 0, 0)))
        groups.append(sessions)
    assert all(s.status is Status.COMPLETED and len(chains(s)) == 2 for g in groups for s in g)
    assert min(len(c.tokens) for g in groups for s in g for c in chains(s)) > context // 2

    shape = _task(TrainConfig(task=spec), tokenizer.ByteTokenizer()).shape
    assert shape.width == context and shape.rows(4) == 8
    packed = pack(groups, width=shape.width, rows=shape.rows(4), estimator="mean")
    assert packed.cut == ()
    assert len(pack(groups, width=context, rows=4, estimator="mean").cut) == 1


async def test_seats_none_of_which_acted_make_the_rollout_an_infra_error_naming_them():
    """A misspelt seat would leave every call out of training without a word."""

    def misspelt(env: Mirror, episode: Episode) -> Score:
        return Score(0.0, seats={"A": 1.0, "B": -1.0})

    source = EnvironmentSource(
        Scripted([reply("x"), reply("y")]),
        lambda: Mirror(1),
        misspelt,
        max_turns=2,
        max_tokens=8,
        max_context=512,
    )
    session = check_session(await source.run(Task("0"), LABEL))
    assert session.status is Status.INFRA_ERROR
    assert session.error == (
        "verifier scored seats ['A', 'B'], but the seats that acted are ['a', 'b']: "
        "nothing of the episode would train"
    )
    # One named seat that acted is enough: a seat left out is not trained, by design.
    half = attrs.evolve(
        source,
        engine=Scripted([reply("x"), reply("y")]),
        verifier=lambda env, episode: Score(0.0, seats={"a": 1.0}),
    )
    session = check_session(await half.run(Task("0"), LABEL))
    assert session.status is Status.COMPLETED and session.seats == {"a": 1.0}


async def test_seats_for_an_episode_without_seats_make_the_rollout_an_infra_error():
    class Plain:
        def reset(self, task):
            return "go"

        def step(self, action):
            return None, True

    source = EnvironmentSource(
        Scripted([reply("x")]),
        Plain,
        lambda env, episode: Score(1.0, seats={"player0": 1.0}),
        max_turns=2,
        max_tokens=8,
        max_context=512,
    )
    session = check_session(await source.run(Task("0"), LABEL))
    assert session.status is Status.INFRA_ERROR
    assert "no call has a seat" in session.error
