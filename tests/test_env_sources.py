"""EnvironmentSource and PromptSource: every ending, the limits, cancellation and chains."""

from __future__ import annotations

import threading

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import trio
import trio.testing

from _bpe import train_bpe
from dew import models
from dew.data import Task
from dew.envs.environment import (
    EnvironmentSource,
    Episode,
    MalformedAction,
    Sampling,
    Score,
    Seated,
    messages_of,
)
from dew.envs.prompts import PromptSource
from dew.objectives.rl.sessions import Call, Label, SessionSource, Status, chains, check_session
from dew.serve import RolloutServer, tokenizer
from dew.serve.tokenizer import HuggingFaceTokenizer

# The engine tests' shape, so the engine compiles once for the whole run.
CONFIG = models.TransformerConfig(d_model=32, heads=2, layers=2, d_ff=64, max_len=64)
SLOTS = 4
LABEL = Label(group=3, sample=1, attempt=0)
TASK = Task("7")


def forced(token: int) -> dict:
    """Transformer params under which `token` is certain: the final norm outputs ones, and only
    that token's unembedding column sees them."""
    params = models.init(jax.random.key(0), CONFIG)
    params["ln_f"] = {"scale": jnp.zeros(CONFIG.d_model), "bias": jnp.ones(CONFIG.d_model)}
    params["unembed"] = jnp.zeros((CONFIG.d_model, CONFIG.vocab)).at[:, token].set(30.0)
    return params


def reply(text: str, *, stop: bool = True) -> np.ndarray:
    """Token ids of an assistant reply, ended by <|im_end|> when `stop`."""
    ids = tokenizer.encode(text)
    return np.append(ids, tokenizer.IM_END).astype(np.int32) if stop else ids


@attrs.define(eq=False)
class ScriptedEngine:
    """Answers call i with replies[i] (cut at max_tokens and after a stop token), recording each
    request; optionally never answers call `hang`, so a deadline strikes inside it."""

    replies: list[np.ndarray]
    hang: int | None = None
    requests: list[dict] = attrs.Factory(list)
    generating: trio.Event = attrs.Factory(trio.Event)

    async def generate(
        self, prompt, *, max_tokens, temperature=1.0, top_k=None, top_p=None, stop=(), key=None
    ) -> Call:
        index = len(self.requests)
        self.requests.append(
            {"prompt": np.asarray(prompt), "max_tokens": max_tokens, "key": key, "stop": stop}
        )
        if index == self.hang:
            self.generating.set()
            await trio.sleep_forever()
        completion = self.replies[index][:max_tokens]
        ends = [i for i, token in enumerate(completion) if token in stop]
        if ends:
            completion = completion[: ends[0] + 1]
        return Call(
            np.asarray(prompt, np.int32),
            np.asarray(completion, np.int32),
            np.full(len(completion), -0.5, np.float32),
            version=4,
        )


@attrs.define(eq=False)
class Countdown:
    """Done after `turns` steps; replies 'again' before that. Actions starting with '!' are
    malformed, 'boom' raises a RuntimeError."""

    turns: int
    seen: list[str] = attrs.Factory(list)

    def reset(self, task: Task) -> str:
        return f"count {task.name}"

    def step(self, action: str):
        if action.startswith("!"):
            raise MalformedAction(f"bad action {action!r}")
        if action == "boom":
            raise RuntimeError("the environment broke")
        self.seen.append(action)
        return "again", len(self.seen) >= self.turns


def verify(env: Countdown, episode: Episode) -> Score:
    return Score(len(env.seen) / 10, {"steps": float(len(env.seen))})


def source(engine, *, turns=3, verifier=verify, make_env=None, **options) -> EnvironmentSource:
    settings = {"max_turns": 5, "max_tokens": 8, "max_context": 512, **options}
    return EnvironmentSource(engine, make_env or (lambda: Countdown(turns)), verifier, **settings)


async def run(source) -> object:
    return check_session(await source.run(TASK, LABEL))


async def test_completed_episode_merges_into_one_chain():
    engine = ScriptedEngine([reply("a"), reply("b"), reply("c")])
    session = await run(source(engine, turns=3))
    assert session.status is Status.COMPLETED
    assert session.reward == pytest.approx(0.3)
    assert session.components == {"steps": 3.0}
    assert len(session.calls) == 3
    (chain,) = chains(session)
    assert chain.calls == 3
    expected = [
        {"role": "user", "content": "count 7"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "c"},
    ]
    assert tokenizer.parse_chat(chain.tokens) == expected
    # Each prompt is exactly what the chat template renders for the conversation so far.
    np.testing.assert_array_equal(
        engine.requests[2]["prompt"],
        tokenizer.encode_chat(expected[:5], add_generation_prompt=True),
    )


async def test_episode_handed_to_verifier():
    episodes = []

    def record(env, episode):
        episodes.append(episode)
        return Score(1.0)

    engine = ScriptedEngine([reply("a"), reply("!x")])
    session = await run(source(engine, verifier=record))
    assert session.status is Status.AGENT_ERROR
    (episode,) = episodes
    assert episode.task == TASK
    assert episode.actions == ("a", "!x")
    assert episode.status is Status.AGENT_ERROR
    assert episode.messages[-1] == {"role": "assistant", "content": "!x"}


@attrs.define(eq=False)
class Alternate:
    """Two seats taking turns, `a` first, each told the other's last action; done after
    `turns` actions. From action `plain_after` on, its observations are plain strings."""

    turns: int
    plain_after: int | None = None
    seen: list[str] = attrs.Factory(list)

    def reset(self, task: Task) -> Seated:
        return Seated("a", f"you are a, count {task.name}")

    def step(self, action: str):
        self.seen.append(action)
        if len(self.seen) >= self.turns:
            return None, True
        told = f"the other said {action}"
        if self.plain_after is not None and len(self.seen) >= self.plain_after:
            return told, False
        return Seated("b" if len(self.seen) % 2 else "a", told), False


def seated_verify(env: Alternate, episode: Episode) -> Score:
    return Score(0.0, {"turns": float(len(env.seen))}, seats={"a": 1.0, "b": -1.0})


async def test_a_seated_episode_keeps_a_chain_per_seat_each_call_tagged_with_its_seat():
    engine = ScriptedEngine([reply("w"), reply("x"), reply("y"), reply("z")])
    turns = source(engine, verifier=seated_verify, make_env=lambda: Alternate(4))
    session = await run(turns)
    assert session.status is Status.COMPLETED
    assert [call.seat for call in session.calls] == ["a", "b", "a", "b"]
    assert session.seats == {"a": 1.0, "b": -1.0}
    conversations = {
        "a": ["you are a, count 7", "w", "the other said x", "y"],
        "b": ["the other said w", "x", "the other said y", "z"],
    }
    expected = {
        seat: [
            {"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(texts)
        ]
        for seat, texts in conversations.items()
    }
    # Each seat's calls merge into a chain of its own: its conversation, and no other's.
    parsed = [tokenizer.parse_chat(chain.tokens) for chain in chains(session)]
    assert sorted(parsed, key=str) == sorted(expected.values(), key=str)
    # A seat's next prompt continues its own last call: the template's render of its turns.
    np.testing.assert_array_equal(
        engine.requests[2]["prompt"],
        tokenizer.encode_chat(expected["a"][:3], add_generation_prompt=True),
    )


async def test_an_episode_mixing_seated_and_plain_observations_is_an_infra_error():
    engine = ScriptedEngine([reply("w"), reply("x"), reply("y")])
    mixed = source(engine, verifier=seated_verify, make_env=lambda: Alternate(4, plain_after=2))
    session = await run(mixed)
    assert session.status is Status.INFRA_ERROR
    assert "must all be Seated or none: a plain observation came after Seated" in session.error


@pytest.mark.parametrize(
    "make, culprit",
    [
        (lambda: Seated("", "hi"), "seat must be a non-empty str"),
        (lambda: Score(0.0, seats={}), "seats must be a non-empty mapping"),
        (lambda: Score(0.0, seats={"a": float("nan")}), r"seats\['a'\] must be a finite"),
        (lambda: Score(0.0, seats={3: 1.0}), "seats must be keyed by seat names"),
    ],
)
def test_bad_seats_are_refused_naming_them(make, culprit):
    with pytest.raises(ValueError, match=culprit):
        make()


async def test_malformed_action_is_agent_error_and_scored():
    engine = ScriptedEngine([reply("a"), reply("!no")])
    session = await run(source(engine))
    assert session.status is Status.AGENT_ERROR
    assert session.error == "bad action '!no'"
    assert session.reward == pytest.approx(0.1)
    assert len(session.calls) == 2


async def test_turn_limit_truncates_and_scores():
    engine = ScriptedEngine([reply(str(i)) for i in range(4)])
    session = await run(source(engine, turns=10, max_turns=4))
    assert session.status is Status.TRUNCATED
    assert session.truncation == "turns"
    assert session.reward == pytest.approx(0.4)
    assert len(session.calls) == 4
    assert len(chains(session)) == 1


async def test_reply_without_stop_truncates_for_length():
    engine = ScriptedEngine([reply("a"), reply("abcdefghij", stop=False)])
    session = await run(source(engine, max_tokens=6))
    assert session.status is Status.TRUNCATED
    assert session.truncation == "length"
    assert session.reward == pytest.approx(0.1), "the unfinished reply is not stepped"
    assert len(session.calls[-1].completion) == 6


async def test_reply_without_stop_is_the_action_when_stop_not_required():
    engine = ScriptedEngine([reply("abc", stop=False), reply("def", stop=False)])
    session = await run(source(engine, turns=2, max_tokens=3, require_stop=False))
    assert session.status is Status.COMPLETED
    (chain,) = chains(session)
    # The template closes each unfinished reply as context, so the turns still merge.
    assert tokenizer.parse_chat(chain.tokens)[1:4] == [
        {"role": "assistant", "content": "abc"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "def"},
    ]
    assert int(chain.tokens[chain.trained].size) == 6


async def test_context_limit_truncates_before_the_call_that_would_not_fit():
    first = len(tokenizer.encode_chat([{"role": "user", "content": "count 7"}]))
    engine = ScriptedEngine([reply("a"), reply("b")])
    # Room for the first prompt and its reply, not for the second prompt.
    session = await run(source(engine, max_context=first + 4))
    assert session.status is Status.TRUNCATED
    assert session.truncation == "context"
    assert len(session.calls) == 1
    assert session.reward == pytest.approx(0.1)


async def test_context_limit_clips_the_budget_and_a_clipped_reply_is_context():
    first = len(tokenizer.encode_chat([{"role": "user", "content": "count 7"}]))
    engine = ScriptedEngine([reply("abcdefgh")])
    session = await run(source(engine, max_context=first + 3, require_stop=False))
    assert engine.requests[0]["max_tokens"] == 3
    assert session.status is Status.TRUNCATED
    assert session.truncation == "context"
    assert session.reward == 0.0


async def test_reply_cut_short_by_the_engine_is_context():
    # An engine ends a reply short of max_tokens, without a stop, only at its longest sequence.
    engine = ScriptedEngine([reply("ab", stop=False)])
    session = await run(source(engine, max_tokens=8, require_stop=False))
    assert (session.status, session.truncation) == (Status.TRUNCATED, "context")
    assert session.reward == 0.0


async def test_prompt_longer_than_context_makes_no_call():
    engine = ScriptedEngine([])
    session = await run(source(engine, max_context=5))
    assert (session.status, session.truncation, session.calls) == (Status.TRUNCATED, "context", ())
    assert session.reward == 0.0


async def test_wall_clock_inside_a_call_truncates_and_scores(mock_clock):
    engine = ScriptedEngine([reply("a"), reply("b")], hang=1)
    found = []
    async with trio.open_nursery() as nursery:

        async def play():
            found.append(await run(source(engine, wall_clock=30.0)))

        nursery.start_soon(play)
        await engine.generating.wait()
        mock_clock.jump(29.0)
        await trio.testing.wait_all_tasks_blocked()
        assert not found, "the deadline is 30 s after the rollout began"
        mock_clock.jump(1.0)
    (session,) = found
    assert session.status is Status.TRUNCATED
    assert session.truncation == "wall_clock"
    assert len(session.calls) == 1
    assert session.reward == pytest.approx(0.1)


@attrs.define(eq=False)
class Stuck:
    """An environment whose second step blocks its thread until `release` is set."""

    release: threading.Event
    stepping: trio.Event
    token: trio.lowlevel.TrioToken
    steps: int = 0

    def reset(self, task: Task) -> str:
        return "go"

    def step(self, action: str):
        self.steps += 1
        if self.steps == 2:
            trio.from_thread.run_sync(self.stepping.set, trio_token=self.token)
            self.release.wait()
        return "more", False


@pytest.fixture
def release():
    """A threading.Event set at the test's end, so a thread abandoned in a step finishes."""
    event = threading.Event()
    yield event
    event.set()


def stuck_source(engine, release, **options):
    stepping = trio.Event()
    env = Stuck(release, stepping, trio.lowlevel.current_trio_token())
    return source(engine, make_env=lambda: env, **options), env


async def test_wall_clock_inside_a_step_truncates_unscored(mock_clock, release):
    engine = ScriptedEngine([reply("a"), reply("b")])
    stuck, env = stuck_source(engine, release, wall_clock=5.0)
    found = []
    async with trio.open_nursery() as nursery:

        async def play():
            found.append(await run(stuck))

        nursery.start_soon(play)
        await env.stepping.wait()
        mock_clock.jump(5.0)
    (session,) = found
    assert (session.status, session.truncation) == (Status.TRUNCATED, "wall_clock")
    assert session.reward is None, "the environment is still inside the abandoned step"
    assert len(session.calls) == 2
    assert not release.is_set()


async def test_cancel_abandons_a_stuck_step(release):
    engine = ScriptedEngine([reply("a"), reply("b")])
    stuck, env = stuck_source(engine, release)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, stuck)
            await env.stepping.wait()
            nursery.cancel_scope.cancel()
    assert nursery.cancel_scope.cancelled_caught
    assert not release.is_set(), "the step's thread is still blocked"
    assert env.steps == 2


def failing(where: str):
    class Failing(Countdown):
        def reset(self, task):
            if where == "reset":
                raise OSError("cannot reset")
            return super().reset(task)

    def make():
        if where == "make":
            raise ConnectionError("no sandbox")
        return Failing(3)

    return make


@pytest.mark.parametrize(
    ("make_env", "replies", "calls", "error"),
    [
        (failing("make"), [], 0, "ConnectionError: no sandbox"),
        (failing("reset"), [], 0, "OSError: cannot reset"),
        (failing("none"), [reply("a"), reply("boom")], 2, "RuntimeError: the environment broke"),
    ],
    ids=["make_env", "reset", "step"],
)
async def test_environment_exceptions_are_infra_errors(make_env, replies, calls, error):
    session = await run(source(ScriptedEngine(replies), make_env=make_env))
    assert session.status is Status.INFRA_ERROR
    assert session.error == error
    assert session.reward is None
    assert len(session.calls) == calls


async def test_bad_observation_is_an_infra_error():
    class Silent(Countdown):
        def step(self, action):
            return None, False

    session = await run(source(ScriptedEngine([reply("a")]), make_env=lambda: Silent(3)))
    assert session.status is Status.INFRA_ERROR
    assert session.error.startswith("TypeError: an observation must be a string")


@pytest.mark.parametrize(
    ("verifier", "status", "error"),
    [
        (lambda env, episode: 1 / 0, Status.INFRA_ERROR, "verifier: ZeroDivisionError"),
        (lambda env, episode: None, Status.INFRA_ERROR, "verifier could not score a COMPLETED"),
        (lambda env, episode: 1.0, Status.INFRA_ERROR, "verifier returned float"),
    ],
    ids=["raises", "no_score", "not_a_score"],
)
async def test_verifier_failures_are_infra_errors(verifier, status, error):
    session = await run(source(ScriptedEngine([reply("a")]), turns=1, verifier=verifier))
    assert session.status is status
    assert session.error.startswith(error)
    assert len(session.calls) == 1


async def test_truncated_episode_the_verifier_cannot_score_has_no_reward():
    engine = ScriptedEngine([reply("a"), reply("b")])
    session = await run(source(engine, max_turns=2, verifier=lambda env, episode: None))
    assert (session.status, session.truncation, session.reward) == (Status.TRUNCATED, "turns", None)


async def test_sampling_keys_follow_seed_label_and_call():
    def keys(label):
        engine = ScriptedEngine([reply("a"), reply("b")])
        return engine, source(engine, turns=2, sampling=Sampling(temperature=0.7, seed=11)), label

    found = []
    for label in (LABEL, LABEL, attrs.evolve(LABEL, attempt=1)):
        engine, environment_source, label = keys(label)
        await environment_source.run(TASK, label)
        found.append([request["key"] for request in engine.requests])
    assert found[0] == found[1]
    assert found[0][0] != found[0][1]
    assert found[2][0] not in found[0]
    engine = ScriptedEngine([reply("a")])
    await source(engine, turns=1).run(TASK, LABEL)
    assert engine.requests[0]["key"] is None


@pytest.mark.parametrize(
    ("options", "culprit"),
    [
        ({"max_turns": 0}, "max_turns"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_context": 1}, "max_context"),
        ({"wall_clock": 0.0}, "wall_clock"),
        ({"stop": ()}, "stop"),
    ],
)
def test_environment_source_rejects_bad_limits(options, culprit):
    with pytest.raises(ValueError, match=culprit):
        source(ScriptedEngine([]), **options)


@pytest.mark.parametrize(
    ("options", "culprit"),
    [({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_p": 1.5}, "top_p")],
)
def test_sampling_rejects_bad_values(options, culprit):
    with pytest.raises(ValueError, match=culprit):
        Sampling(**options)


def test_sources_are_session_sources():
    engine = ScriptedEngine([])
    assert isinstance(source(engine), SessionSource)
    assert isinstance(
        PromptSource(engine, {}, lambda task, text: None, max_tokens=1), SessionSource
    )


def test_messages_of():
    assert messages_of("hi") == [{"role": "user", "content": "hi"}]
    system = [{"role": "system", "content": "be brief"}]
    assert messages_of(system) == system
    with pytest.raises(TypeError, match="observation"):
        messages_of(None)


# PromptSource


def answer_verifier(task: Task, text: str) -> Score:
    return Score(float(text == "42"), {"exact": float(text == "42")})


def prompt_source(engine, verifier=answer_verifier, **options) -> PromptSource:
    return PromptSource(engine, {"7": "what is 6 x 7?"}, verifier, max_tokens=4, **options)


async def test_prompt_completed_and_scored(autojump_clock):
    engine = ScriptedEngine([reply("42")])
    session = await run(prompt_source(engine))
    assert (session.status, session.reward, session.components) == (
        Status.COMPLETED,
        1.0,
        {"exact": 1.0},
    )
    np.testing.assert_array_equal(
        engine.requests[0]["prompt"],
        tokenizer.encode_chat([{"role": "user", "content": "what is 6 x 7?"}]),
    )
    assert engine.requests[0]["stop"] == (tokenizer.IM_END,)
    assert len(chains(session)) == 1


async def test_prompt_without_stop_is_truncated_for_length_and_scored(autojump_clock):
    session = await run(prompt_source(ScriptedEngine([reply("42424242", stop=False)])))
    assert (session.status, session.truncation, session.reward) == (Status.TRUNCATED, "length", 0.0)
    assert len(session.calls[0].completion) == 4


async def test_prompt_cut_short_by_the_engine_is_context(autojump_clock):
    session = await run(prompt_source(ScriptedEngine([reply("4", stop=False)])))
    assert (session.status, session.truncation, session.reward) == (
        Status.TRUNCATED,
        "context",
        0.0,
    )


async def test_prompt_verifier_sees_the_reply_without_its_stop(autojump_clock):
    seen = []

    def record(task, text):
        seen.append((task.name, text))
        return Score(0.5)

    await run(prompt_source(ScriptedEngine([reply("4")]), verifier=record))
    assert seen == [("7", "4")]


async def test_prompt_truncated_reply_the_verifier_cannot_score(autojump_clock):
    engine = ScriptedEngine([reply("long answer", stop=False)])
    session = await run(prompt_source(engine, verifier=lambda task, text: None))
    assert (session.status, session.truncation, session.reward) == (
        Status.TRUNCATED,
        "length",
        None,
    )


@pytest.mark.parametrize(
    ("verifier", "error"),
    [
        (lambda task, text: None, "verifier could not score a COMPLETED"),
        (lambda task, text: {}["x"], "verifier: KeyError: 'x'"),
    ],
    ids=["no_score", "raises"],
)
async def test_prompt_verifier_failures_are_infra_errors(autojump_clock, verifier, error):
    session = await run(prompt_source(ScriptedEngine([reply("42")]), verifier=verifier))
    assert session.status is Status.INFRA_ERROR
    assert session.error.startswith(error)
    assert len(session.calls) == 1


async def test_prompt_callable_and_messages(autojump_clock):
    messages = [{"role": "system", "content": "digits only"}, {"role": "user", "content": "6x7"}]
    engine = ScriptedEngine([reply("42")])
    prompts = PromptSource(engine, lambda task: messages, answer_verifier, max_tokens=4)
    session = await run(prompts)
    assert session.reward == 1.0
    np.testing.assert_array_equal(engine.requests[0]["prompt"], tokenizer.encode_chat(messages))


async def test_prompt_for_an_unknown_task_is_a_broken_source(autojump_clock):
    with pytest.raises(KeyError, match="no prompt for task '8'"):
        await prompt_source(ScriptedEngine([reply("42")])).run(Task("8"), LABEL)


def test_prompt_source_rejects_bad_arguments():
    with pytest.raises(ValueError, match="max_tokens"):
        PromptSource(ScriptedEngine([]), {}, answer_verifier, max_tokens=0)
    with pytest.raises(ValueError, match="prompts"):
        PromptSource(ScriptedEngine([]), 3, answer_verifier, max_tokens=1)
    with pytest.raises(ValueError, match="engine"):
        PromptSource(object(), {}, answer_verifier, max_tokens=1)


# On the real engine and transformer


@pytest.mark.medium
async def test_environment_source_on_the_real_engine():
    async with RolloutServer(CONFIG, forced(ord("a")), slots=SLOTS, version=2) as server:
        environment_source = source(server, turns=2, max_tokens=2, require_stop=False)
        session = await run(environment_source)
    assert session.status is Status.COMPLETED
    assert session.reward == pytest.approx(0.2)
    assert [call.version for call in session.calls] == [2, 2]
    (chain,) = chains(session)
    assert chain.calls == 2
    assert tokenizer.parse_chat(chain.tokens) == [
        {"role": "user", "content": "count 7"},
        {"role": "assistant", "content": "aa"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "aa"},
    ]
    np.testing.assert_allclose(chain.logprobs[chain.trained], 0.0, atol=1e-4)


async def test_environment_source_batches_on_the_real_engine():
    params = models.init(jax.random.key(1), CONFIG)
    found = []
    async with RolloutServer(CONFIG, params, slots=SLOTS) as server:
        environment_source = source(
            server, turns=2, max_tokens=2, require_stop=False, sampling=Sampling(seed=3)
        )

        async def one(sample):
            found.append(check_session(await environment_source.run(TASK, Label(0, sample, 0))))

        async with trio.open_nursery() as nursery:
            for sample in range(2 * SLOTS):
                nursery.start_soon(one, sample)
    assert len(found) == 2 * SLOTS
    for session in found:
        assert session.status in (Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED)
        assert [chain.calls for chain in chains(session)] == [len(session.calls)]


async def test_prompt_source_on_the_real_engine():
    async with RolloutServer(CONFIG, forced(tokenizer.IM_END), slots=SLOTS) as server:
        session = await run(prompt_source(server, verifier=lambda task, text: Score(len(text))))
    assert (session.status, session.reward) == (Status.COMPLETED, 0.0)
    np.testing.assert_array_equal(session.calls[0].completion, [tokenizer.IM_END])
    np.testing.assert_array_equal(
        session.calls[0].prompt,
        tokenizer.encode_chat([{"role": "user", "content": "what is 6 x 7?"}]),
    )
    async with RolloutServer(CONFIG, forced(ord("4")), slots=SLOTS) as server:
        session = await run(prompt_source(server, verifier=lambda task, text: Score(len(text))))
    assert (session.status, session.truncation, session.reward) == (Status.TRUNCATED, "length", 4.0)


# Another tokenizer: a BPE trained in the test, behind the same sources.


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return HuggingFaceTokenizer.from_file(train_bpe(tmp_path_factory.mktemp("bpe") / "t.json"))


async def test_environment_source_with_a_bpe_tokenizer_merges_into_one_chain(bpe):
    replies = [np.append(bpe.encode(text), bpe.eos_id) for text in ("the cat", "sat")]
    replies.append(bpe.encode("on the mat"))  # filling max_tokens without a stop
    engine = ScriptedEngine(replies)
    budget = max(len(reply) for reply in replies)
    assert len(replies[-1]) == budget
    options = {"max_tokens": budget, "require_stop": False, "tokenizer": bpe}
    session = await run(source(engine, turns=3, **options))
    assert session.status is Status.COMPLETED
    (chain,) = chains(session)
    expected = [
        {"role": "user", "content": "count 7"},
        {"role": "assistant", "content": "the cat"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "sat"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "on the mat"},
    ]
    assert bpe.parse_chat(chain.tokens) == expected
    for index, request in enumerate(engine.requests):
        assert request["stop"] == (bpe.eos_id,)
        rendered = bpe.encode_chat(expected[: 2 * index + 1], add_generation_prompt=True)
        np.testing.assert_array_equal(request["prompt"], rendered)


async def test_prompt_source_with_a_bpe_tokenizer(autojump_clock, bpe):
    engine = ScriptedEngine([np.append(bpe.encode("42"), bpe.eos_id)])
    session = await run(prompt_source(engine, tokenizer=bpe))
    assert (session.status, session.reward) == (Status.COMPLETED, 1.0)
    prompt = bpe.encode_chat([{"role": "user", "content": "what is 6 x 7?"}])
    np.testing.assert_array_equal(engine.requests[0]["prompt"], prompt)
    assert engine.requests[0]["stop"] == (bpe.eos_id,)


def test_sources_reject_a_bad_tokenizer_and_stops_outside_its_vocabulary(bpe):
    with pytest.raises(ValueError, match="tokenizer must implement dew.serve.tokenizer.Tokenizer"):
        prompt_source(ScriptedEngine([]), tokenizer="bytes")
    with pytest.raises(ValueError, match=r"stop must hold .* in \[0, 260\)"):
        source(ScriptedEngine([]), stop=(300,))
    assert source(ScriptedEngine([]), stop=(300,), tokenizer=bpe).stop == (300,)
