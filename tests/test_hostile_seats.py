"""Hostile tests of episodes of several agents (`Seated`, `Score.seats`)."""

from __future__ import annotations

import collections
import re

import attrs
import numpy as np
import pytest
import trio

from dew.data import ArrayDataset, Task
from dew.envs.environment import EnvironmentSource, Episode, Score, Seated
from dew.objectives.rl._rewards import uniform_group
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import (
    Call,
    Label,
    Session,
    SessionError,
    Status,
    chains,
    check_session,
    pack,
)
from dew.replay import NoRescoring
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


# --- seats that read as misspelt, through the scheduler ----------------------------------------
# On trio's real clock: an EnvironmentSource steps its environment in a worker thread, which the
# autojump clock counts as idle.


@attrs.define(eq=False)
class Served:
    """The engine and the scheduler's publisher: replies "ok" to every prompt under the version
    pushed last."""

    version: int | None = None

    def load(self, variables, version):
        self.version = version

    async def generate(self, prompt, *, max_tokens, stop=(), **sampling) -> Call:
        await trio.lowlevel.checkpoint()
        completion = reply("ok")[:max_tokens]
        logprobs = np.full(len(completion), -0.5, np.float32)
        return Call(np.asarray(prompt, np.int32), completion, logprobs, version=self.version)


@attrs.define(eq=False)
class Duel:
    """Two seats taking turns for `rounds` rounds, each told its task, which take of the task
    the episode is (0 first) and its own name: a segment's decoded text says whose it is."""

    takes: collections.Counter
    seats: tuple[str, str] = ("player.0", "player.1")
    rounds: int = 1
    task: Task | None = None
    take: int = 0
    moves: int = 0

    def tell(self, task: Task, seat: str) -> Seated:
        return Seated(seat, f"game {task.name} take {self.take}: you are {seat}")

    def reset(self, task: Task) -> Seated:
        self.task, self.take = task, self.takes[task.name]
        self.takes[task.name] += 1
        return self.tell(task, self.seats[0])

    def step(self, action: str):
        self.moves += 1
        if self.moves == 2 * self.rounds:
            return None, True
        return self.tell(self.task, self.seats[self.moves % 2]), False


def duel_scheduler(score, wrap=lambda source: source, **seats) -> RolloutScheduler:
    """A scheduler of two-sample groups of Duel episodes scored by `score(env) -> Score`, their
    source `wrap(EnvironmentSource)`."""
    takes = collections.Counter()
    source = EnvironmentSource(
        Served(),
        lambda: Duel(takes, **seats),
        lambda env, episode: score(env),
        max_turns=8,
        max_tokens=8,
        max_context=512,
    )
    return RolloutScheduler(
        NoRescoring(), wrap(source), source.engine, width=256, rows=8, groups=2, ahead=0, max_lag=0
    )


async def train_once(scheduler: RolloutScheduler, tasks: int = 2) -> dict[str, np.ndarray]:
    """A trainer's first call over `tasks` tasks, one group each: the packed batch."""
    data = ArrayDataset({"task_id": np.arange(tasks)}, batch_size=tasks)
    async with scheduler:
        return await scheduler.step(next(scheduler.tasks(data).stream(0)), None, 0)


def segment_advantages(batch: dict[str, np.ndarray]) -> dict[str, float]:
    """Each segment's advantage by its first observation ("game G take K: you are SEAT")."""
    found = {}
    for row in range(batch["tokens"].shape[0]):
        for segment in set(batch["segment_ids"][row].tolist()) - {0}:
            at = batch["segment_ids"][row] == segment
            text = tokenizer.BYTES.decode(batch["tokens"][row][at], skip_special=True)
            (told,) = set(re.findall(r"game \d+ take \d+: you are [\w.]+", text))
            trained = batch["advantages"][row][at & (batch["loss_mask"][row] > 0)]
            assert len(set(trained.tolist())) == 1
            found[told] = float(trained[0])
    return found


def first_wins(env: Duel) -> Score:
    """The first seat wins an episode's first take of its task and loses its second."""
    first = 1.0 if env.take == 0 else -1.0
    return Score(0.0, seats={env.seats[0]: first, env.seats[1]: -first})


async def test_seats_named_right_train_each_seat_on_its_own_reward_through_the_scheduler():
    """The control of the misspelt seats below: `player.0` wins each task's first take and
    `player.1` its second, and each seat's segment trains on its own result against its seat
    in the group (the session's reward, their sum, is 0 every game)."""
    found = segment_advantages(await train_once(duel_scheduler(first_wins)))
    # player.0 and player.1 are NAME.K seats, which share one baseline (mean 0 here); each
    # seat's result still sets its own advantage's sign.
    expected = {}
    for task in range(2):
        for take, first in ((0, 1.0), (1, -1.0)):
            expected[f"game {task} take {take}: you are player.0"] = first
            expected[f"game {task} take {take}: you are player.1"] = -first
    assert found.keys() == expected.keys()
    for told, advantage in expected.items():
        np.testing.assert_allclose(found[told], advantage, rtol=1e-5, err_msg=told)


async def test_a_misspelt_seat_beside_a_right_one_fails_the_call_naming_it():
    """`{"player.0": 1.0, "player1": 0.0}` for seats `player.0` and `player.1`: player.1's
    calls trained on nothing, and the mistyped key was ignored, without a word. The trainer's
    call now fails on the session, naming the mistyped key, the seat left without a reward and
    the seats that acted."""

    def misspelt(env: Duel) -> Score:
        return Score(0.0, seats={"player.0": 1.0, "player1": 0.0})

    with pytest.raises(SessionError) as refused:
        await train_once(duel_scheduler(misspelt))
    assert re.fullmatch(
        r"task '\d' group \d sample \d attempt 0: seats name \['player1'\], which made no call, "
        r"while \['player.1'\] made calls without a reward \(the seats that acted are "
        r"\['player.0', 'player.1'\]\): a misspelt seat would train on nothing",
        str(refused.value),
    ), refused.value


async def test_a_seat_left_out_beside_a_seat_that_made_no_call_is_reported_missing():
    """Seats `red` and `blue` acted; the verifier rewards `red` and a `Blue` that never
    played: the call fails naming `blue` as the seat that made calls without a reward."""

    def capitalised(env: Duel) -> Score:
        return Score(0.0, seats={"red": 1.0, "Blue": -1.0})

    with pytest.raises(SessionError, match=r"while \['blue'\] made calls without a reward"):
        await train_once(duel_scheduler(capitalised, seats=("red", "blue")))


async def test_a_seat_that_made_calls_without_a_reward_alone_trains_nothing_as_documented():
    """Half of a misspelling alone is meant: a seat that made calls without a reward (a judge)
    trains nothing, and the seat beside it trains on its own reward."""

    def judged(env: Duel) -> Score:
        return Score(0.0, seats={"player": 1.0 if env.take == 0 else 0.0})

    found = segment_advantages(await train_once(duel_scheduler(judged, seats=("player", "judge"))))
    expected = {
        f"game {task} take {take}: you are player": 1.0 - 2 * take
        for task in range(2)
        for take in range(2)
    }
    assert found == pytest.approx(expected, rel=1e-5)


async def test_a_reward_for_a_seat_that_made_no_call_alone_is_taken():
    """The other half alone is meant too: a reward for a seat that made no call (here `c`, a
    third player the game ended before) refuses nothing, and a and b train as named."""

    def absent(env: Duel) -> Score:
        return Score(0.0, seats={"a": 1.0 - 2 * env.take, "b": 0.0, "c": 1.0})

    found = segment_advantages(await train_once(duel_scheduler(absent, seats=("a", "b"))))
    expected = {}
    for task in range(2):
        for take in range(2):
            expected[f"game {task} take {take}: you are a"] = 1.0 - 2 * take
            expected[f"game {task} take {take}: you are b"] = 0.0
    assert found == pytest.approx(expected, rel=1e-5)


def test_a_reward_for_a_seat_that_made_no_call_counts_in_its_seats_baseline():
    """Seat b made no call in the first session (its game ended before its turn) and scored
    -1; in the second it played and scored 0: it did better than its seat's mean, -0.5, and
    trains so (alone in its pool it would train on 0)."""
    group = [
        seated({"a": 1.0, "b": -1.0}, [("a", [1], [2])]),
        seated({"a": 0.0, "b": 0.0}, [("a", [11], [12]), ("b", [13], [14])]),
    ]
    batch = pack([[check_session(s) for s in group]], width=16, rows=4, estimator="mean").batch
    trained = batch["loss_mask"] > 0
    advantage = dict(
        zip(batch["tokens"][trained].tolist(), batch["advantages"][trained].tolist(), strict=True)
    )
    assert advantage == {2: 0.5, 12: -0.5, 14: 0.5}


# --- hostile seat values and shapes ----------------------------------------------------------


def seated(seats, calls, status=Status.COMPLETED):
    """A stamped session of `calls` (seat, prompt, completion) and `seats`, reward 0."""
    made = [
        Call(
            np.array(prompt, np.int32),
            np.array(completion, np.int32),
            np.full(len(completion), -0.5, np.float32),
            version=0,
            seat=seat,
        )
        for seat, prompt, completion in calls
    ]
    return Session(status, made, reward=0.0, seats=seats).stamped(Task("t"), LABEL, 0.0, 0.0)


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), -float("inf"), np.float32("nan"), 10**400],
    ids=["nan", "inf", "-inf", "float32-nan", "int-beyond-float"],
)
def test_a_seat_reward_no_float_holds_finite_is_refused_naming_the_seat(value):
    """An int beyond a float's range raised OverflowError from the check, which the scheduler
    does not take as a refused session (its rollout task crashed the run without naming task,
    label or seat); it is refused as NaN and infinity are."""
    session = seated({"a": value, "b": 0.0}, [("a", [1], [2]), ("b", [3], [4])])
    with pytest.raises(SessionError, match=r"seats\['a'\] must be a finite number"):
        check_session(session)


@pytest.mark.parametrize("field", ["reward", "components"])
def test_a_reward_or_component_no_float_holds_is_refused_not_raised_past_the_scheduler(field):
    session = seated({"a": 1.0}, [("a", [1], [2])])
    huge = 10**400 if field == "reward" else {"x": 10**400}
    with pytest.raises(SessionError, match=f"{field}.* must be a finite number"):
        check_session(attrs.evolve(session, **{field: huge}))


async def test_a_seat_reward_beyond_a_float_fails_the_call_as_a_refused_session():
    """Through the scheduler: the trainer's call fails with the check's SessionError, naming
    task, label and seat."""

    @attrs.frozen
    class Huge:
        source: EnvironmentSource

        async def run(self, task, label):
            session = await self.source.run(task, label)
            return attrs.evolve(session, seats={"player.0": 10**400, "player.1": 0.0})

    scheduler = duel_scheduler(first_wins, wrap=Huge)
    with pytest.raises(SessionError, match=r"group \d sample \d attempt 0: seats\['player.0'\]"):
        await train_once(scheduler)


@pytest.mark.parametrize("true", [True, np.True_], ids=["bool", "numpy"])
def test_a_bool_seat_reward_trains_as_the_number_it_is(true):
    """A Python bool is an int, as the scheduler takes it for the reward: True trains as 1.0
    (the replay test pins that traces keep it); numpy's bool alike."""
    calls = [("a", [1], [2]), ("b", [3], [4])]
    false = not true
    as_bool = [seated({"a": true, "b": false}, calls), seated({"a": false, "b": true}, calls)]
    as_float = [seated({"a": 1.0, "b": 0.0}, calls), seated({"a": 0.0, "b": 1.0}, calls)]
    for group in (as_bool, as_float):
        for session in group:
            check_session(session)
    found, expected = (pack([g], width=16, rows=4).batch["advantages"] for g in (as_bool, as_float))
    np.testing.assert_array_equal(found, expected)
    assert np.abs(found).max() > 0


@pytest.mark.parametrize(
    ("seats", "calls", "problem"),
    [
        # The calls of no seat train on the reward, as documented; the misspelt seat is caught.
        (
            {"A": 1.0},
            [("a", [1], [2]), (None, [3], [4])],
            r"name \['A'\], which made no call, while \['a'\] made calls without a reward "
            r"\(the seats that acted are \['a'\]\)",
        ),
        # Seats for calls none of which has one: every call would train on the reward.
        (
            {"a": 1.0, "b": 0.0},
            [(None, [1], [2]), (None, [3], [4])],
            r"name \['a', 'b'\], but no call has a seat",
        ),
    ],
    ids=["seated-and-unseated", "no-call-seated"],
)
def test_seats_that_fit_no_seated_call_are_refused_naming_them(seats, calls, problem):
    with pytest.raises(SessionError, match=f"seats {problem}"):
        check_session(seated(seats, calls))


@pytest.mark.parametrize("status", [Status.INFRA_ERROR, Status.CANCELLED])
def test_misspelt_seats_of_a_session_that_never_trains_are_not_refused(status):
    """An INFRA_ERROR or CANCELLED session is resubmitted, never trained: its seats say
    nothing the run would act on."""
    session = seated({"A": 1.0}, [("a", [1], [2])], status=status)
    assert check_session(session) is session


def test_seats_fitting_some_calls_and_none_on_others_train_as_documented():
    """A seat's calls on its reward against its seat, a call of no seat on the session's reward
    against the group's sessions, and empty seats (no trace recorded a reward) leave the
    seated calls untrained but refuse nothing."""
    calls = [("a", [1], [2]), (None, [3], [4])]
    group = [
        attrs.evolve(seated({"a": 1.0}, calls), reward=5.0),
        attrs.evolve(seated({"a": 0.0}, calls), reward=3.0),
    ]
    batch = pack([[check_session(s) for s in group]], width=16, rows=4, estimator="mean").batch
    trained = batch["loss_mask"] > 0
    assert batch["tokens"][trained].tolist() == [2, 4, 2, 4]
    per_session = batch["advantages"][trained].reshape(2, 2)
    np.testing.assert_allclose(per_session, [[0.5, 1.0], [-0.5, -1.0]])
    empty = check_session(seated({}, [("a", [1], [2]), (None, [3], [4])]))
    assert [len(c) for c in chains(empty)] == [2, 2]


def test_a_seat_of_several_chains_counts_once_in_its_baseline():
    """Seat `a` of the first session makes two chains of different lengths (its second prompt
    does not extend its first call): both train on a's advantage, and a's reward counts once
    in the baseline, not once per chain."""
    twice = [("a", [1], [2]), ("b", [3], [4]), ("a", [5, 6, 7], [8, 9])]
    once = [("a", [11], [12]), ("b", [13], [14])]
    group = [seated({"a": 1.0, "b": 0.0}, twice), seated({"a": 0.0, "b": 1.0}, once)]
    assert [len(chains(s)) for s in group] == [3, 2]
    batch = pack([[check_session(s) for s in group]], width=16, rows=4, estimator="mean").batch
    trained = batch["loss_mask"] > 0
    advantage = dict(
        zip(batch["tokens"][trained].tolist(), batch["advantages"][trained].tolist(), strict=True)
    )
    # Under "mean", a's pool {1, 0} gives 0.5 and -0.5; counted per chain, {1, 1, 0} would not.
    assert advantage == {2: 0.5, 8: 0.5, 9: 0.5, 4: -0.5, 12: -0.5, 14: 0.5}


def test_a_bare_seat_keeps_a_baseline_apart_from_its_numbered_namesakes():
    """`agent` and `agent.0` both scored alike in both sessions (1 and 0): neither did better
    than itself, so neither trains. Pooled together, `agent` trains up and `agent.0` down."""
    calls = [("agent", [1], [2]), ("agent.0", [3], [4])]
    group = [seated({"agent": 1.0, "agent.0": 0.0}, calls) for _ in range(2)]
    batch = pack([[check_session(s) for s in group]], width=16, rows=4, estimator="mean").batch
    assert not batch["advantages"].any()


def test_a_group_whose_seats_each_scored_alike_is_uniform_whatever_its_session_rewards():
    """Every call is seated, so the session rewards train nothing: a group whose seats each
    scored alike carries no signal, and filter_uniform drops it. One unseated call trains on
    the session reward, and then the rewards' spread is signal."""
    seats = {"a": 1.0, "b": 0.0}
    calls = [("a", [1], [2]), ("b", [3], [4])]
    group = [attrs.evolve(seated(seats, calls), reward=float(r)) for r in (0, 1)]
    assert uniform_group(group, "score")
    assert not pack([group], width=16, rows=4, estimator="mean").batch["advantages"].any()
    unseated = [
        attrs.evolve(seated(seats, calls + [(None, [5], [6])]), reward=float(r)) for r in (0, 1)
    ]
    assert not uniform_group(unseated, "score")
