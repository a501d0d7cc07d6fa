"""HarnessSource: agent harnesses written with the official openai client, as async functions
under trio and as subprocesses with the sync client, scored and classified; cancelled by the
scheduler, their processes killed and their sessions closed.

On trio's real clock (the gateway's sockets and the subprocesses are real).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import numpy as np
import openai
import optax
import pytest
import trio
import trio.testing

from _gateway import CONFIG, GREETING, ScriptedEngine, params, tiny_server, tool_call
from dew import models
from dew.data import ArrayDataset, Task
from dew.envs import HarnessResult, HarnessSource, Score
from dew.envs.lookup import (
    HARNESSES,
    LookupOutcome,
    LookupTask,
    LookupVerifier,
    session_client,
)
from dew.gateway import Gateway, ServedGateway
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import Label, Status, chains
from dew.serve import tokenizer
from dew.train import Trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator '.*' was garbage collected:ResourceWarning"
)

TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
}
LABEL = Label(3, 1, 0)


def gateway(engine, **kwargs) -> Gateway:
    kwargs.setdefault("max_context", 4096)
    return Gateway(engine, announce=False, **kwargs)


def exact(result: HarnessResult) -> Score:
    """Scores 1 when the harness's output is 'answer: 42'."""
    return Score(1.0 if result.output == "answer: 42" else 0.0, {"calls": len(result.calls)})


async def tool_agent(base_url: str, api_key: str, task: Task) -> str:
    """Asks, runs the tool the model calls, and answers with the model's last reply."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as api:
        messages = [{"role": "user", "content": f"What is {task.name}?"}]
        while True:
            answer = await api.chat.completions.create(model="m", messages=messages, tools=[TOOL])
            message = answer.choices[0].message
            if not message.tool_calls:
                return message.content
            messages.append(message)
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})


async def test_a_tool_using_harness_completes_in_one_chain_and_is_scored():
    engine = ScriptedEngine([tool_call("lookup", {}), "answer: 42"])
    seen = []

    def verifier(result: HarnessResult) -> Score:
        seen.append(result)
        return exact(result)

    async with gateway(engine) as gw:
        session = await HarnessSource(gw, tool_agent, verifier).run(Task("x"), LABEL)
    assert session.status is Status.COMPLETED and session.reward == 1.0
    assert session.components == {"calls": 2.0}
    assert len(chains(session)) == 1 and len(session.calls) == 2
    (result,) = seen
    assert result.transcript[-1]["content"] == "answer: 42"
    assert result.transcript[0] == {"role": "user", "content": "What is x?"}
    assert engine.keys[0] != engine.keys[1] or engine.keys[0] is None
    assert gw.open_sessions == 0


async def test_a_harness_that_raises_is_an_agent_error_still_scored():
    async def broken(base_url, api_key, task):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key) as api:
            await api.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}]
            )
        raise ValueError("the agent gave up")

    async with gateway(ScriptedEngine()) as gw:
        session = await HarnessSource(gw, broken, exact).run(Task("x"), LABEL)
    assert session.status is Status.AGENT_ERROR and session.reward == 0.0
    assert "ValueError: the agent gave up" in session.error
    assert len(session.calls) == 1


async def test_the_call_limit_truncates_with_turns_and_stops_the_harness():
    ran = []

    async def chatty(base_url, api_key, task):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as api:
            while True:
                ran.append(1)
                try:
                    await api.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "again"}]
                    )
                except openai.BadRequestError:
                    await trio.sleep_forever()  # only the source's cancel ends this harness

    async with gateway(ScriptedEngine()) as gw:
        source = HarnessSource(gw, chatty, lambda result: None, max_calls=3)
        session = await source.run(Task("x"), LABEL)
    assert (session.status, session.truncation) == (Status.TRUNCATED, "turns")
    assert len(session.calls) == 3 and len(ran) == 4
    assert session.reward is None


async def test_a_prompt_past_the_context_truncates_with_context():
    async def long_winded(base_url, api_key, task):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as api:
            messages = [{"role": "user", "content": "short"}]
            await api.chat.completions.create(model="m", messages=messages)
            messages.append({"role": "user", "content": "x" * 500})
            await api.chat.completions.create(model="m", messages=messages)

    async with gateway(ScriptedEngine(), max_context=200) as gw:
        session = await HarnessSource(gw, long_winded, exact).run(Task("x"), LABEL)
    assert (session.status, session.truncation) == (Status.TRUNCATED, "context")
    assert len(session.calls) == 1 and session.reward == 0.0


async def test_the_wall_clock_limit_truncates_and_cancels_the_engine_call():
    engine = ScriptedEngine(delay=None)
    async with gateway(engine) as gw:
        source = HarnessSource(gw, tool_agent, exact, wall_clock=0.3)
        session = await source.run(Task("x"), LABEL)
        while engine.cancelled == 0:
            await trio.testing.wait_all_tasks_blocked()
    assert (session.status, session.truncation) == (Status.TRUNCATED, "wall_clock")
    assert session.calls == () and engine.cancelled == 1


@pytest.mark.medium
async def test_engine_and_verifier_faults_are_infra_errors():
    async with gateway(ScriptedEngine(fail_on="q")) as gw:
        session = await HarnessSource(gw, tool_agent, exact).run(Task("q"), LABEL)
    assert session.status is Status.INFRA_ERROR and "the engine broke" in session.error

    def failing(result):
        raise KeyError("no reference answer")

    async with gateway(ScriptedEngine(["answer: 42"])) as gw:
        session = await HarnessSource(gw, tool_agent, failing).run(Task("x"), LABEL)
    assert session.status is Status.INFRA_ERROR and "no reference answer" in session.error


async def test_a_resubmitted_sample_gets_a_fresh_session():
    urls = []

    async def remember(base_url, api_key, task):
        urls.append(base_url)
        return "answer: 42"

    async with gateway(ScriptedEngine()) as gw:
        source = HarnessSource(gw, remember, exact)
        await source.run(Task("x"), Label(0, 0, 0))
        await source.run(Task("x"), Label(0, 0, 1))
        async with openai.AsyncOpenAI(base_url=urls[0], api_key="k", max_retries=0) as api:
            with pytest.raises(openai.APIStatusError) as refused:
                await api.models.list()
    assert urls[0] != urls[1] and refused.value.status_code == 410


SYNC_AGENT = textwrap.dedent(
    """
    import os, sys
    import openai

    client = openai.OpenAI(max_retries=0)  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    messages = [{"role": "user", "content": "task " + os.environ["DEW_TASK"]}]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    while True:
        message = client.chat.completions.create(
            model="m", messages=messages, tools=tools
        ).choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
    print("progress", file=sys.stderr)
    if os.environ.get("FAIL"):
        sys.exit(3)
    print(message.content, end="")
    """
)


def command(script: str) -> list[str]:
    return [sys.executable, "-c", script]


@pytest.mark.medium
async def test_a_subprocess_harness_with_the_sync_client_completes():
    engine = ScriptedEngine([tool_call("lookup", {"q": 1}), "answer: 42"])
    async with gateway(engine) as gw:
        source = HarnessSource(gw, command(SYNC_AGENT), exact)
        session = await source.run(Task("7"), LABEL)
    assert session.status is Status.COMPLETED and session.reward == 1.0, session.error
    assert len(session.calls) == 2 and len(chains(session)) == 1
    assert b"task 7" in np.asarray(session.calls[0].prompt, np.uint8).tobytes()


@pytest.mark.medium
async def test_a_failing_subprocess_is_an_agent_error_with_its_stderr_tail():
    async with gateway(ScriptedEngine(["answer: 42"])) as gw:
        source = HarnessSource(gw, command(SYNC_AGENT), exact, env={"FAIL": "1"})
        session = await source.run(Task("7"), LABEL)
    assert session.status is Status.AGENT_ERROR and session.reward == 0.0
    assert "exited with status 3" in session.error and "progress" in session.error


async def test_a_command_that_cannot_start_is_an_infra_error():
    async with gateway(ScriptedEngine()) as gw:
        source = HarnessSource(gw, ["/nonexistent/agent"], exact)
        session = await source.run(Task("7"), LABEL)
    assert session.status is Status.INFRA_ERROR and "could not start" in session.error


HANGING_AGENT = textwrap.dedent(
    """
    import json, subprocess, sys
    import openai

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(sys.argv[1], "w") as out:
        json.dump([child.pid], out)
    openai.OpenAI(max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hang"}]
    )
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child not yet reaped by its dead parent is a zombie until init reaps it.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.medium
async def test_a_cancelled_rollout_kills_the_process_group_and_closes_the_session(tmp_path):
    engine = ScriptedEngine(hang_on="hang")
    pids = tmp_path / "pids.json"
    async with gateway(engine) as gw:
        source = HarnessSource(gw, [*command(HANGING_AGENT), str(pids)], exact)
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(source.run, Task("x"), LABEL)
                while engine.started == 0:
                    await trio.sleep(0.02)  # the subprocess starts on its own
                scope.cancel()
        # The session's close cancelled the engine call; its task runs that cancel when trio
        # next schedules it, which the rollout's end does not wait for.
        await trio.testing.wait_all_tasks_blocked()
        assert engine.cancelled == 1 and gw.open_sessions == 0
    (child,) = json.loads(pids.read_text())
    for _ in range(100):
        if not alive(child):
            break
        await trio.sleep(0.02)
    assert not alive(child)


# --- through the scheduler ------------------------------------------------------------------------


class RecordingGateway(Gateway):
    """A gateway that keeps every session it opened, by base URL."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.opened = {}

    def open(self, label=None, **kwargs):
        session = super().open(label, **kwargs)
        self.opened[session.base_url] = session
        return session


# Surplus: each task's second sample hangs, and its first finishing makes the group; timeout:
# each task's second sample hangs on its first attempt, and the scheduler's deadline cancels it
# and submits it again (the deadline leaves a busy machine time to open a client and answer
# the other samples).
OPTIONS = {
    "surplus": {"groups": 1, "oversample": 1},
    "timeout": {"groups": 2, "timeout": 2.0},
}


@pytest.mark.medium
@pytest.mark.parametrize("cause", OPTIONS)
async def test_rollouts_the_scheduler_cancels_stop_harness_and_engine_and_train_nothing(cause):
    engine = ScriptedEngine(["answer: 42"], hang_on="slow")
    cancelled = []

    async def agent(base_url, api_key, task):
        label = gw.opened[base_url].label
        content = "slow" if (label.sample, label.attempt) == (1, 0) else "fast"
        try:
            async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key) as api:
                answer = await api.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": content}]
                )
        except trio.Cancelled:
            cancelled.append(base_url)
            raise
        return answer.choices[0].message.content

    async with RecordingGateway(engine, max_context=CONFIG.max_len, announce=False) as gw:
        scheduler = RolloutScheduler(
            GRPOObjective(models.model(CONFIG)),
            HarnessSource(gw, agent, exact),
            engine,
            width=CONFIG.max_len,  # the shape of the end-to-end test's: one compilation
            rows=4,
            ahead=0,
            **OPTIONS[cause],
        )
        dataset = scheduler.tasks(ArrayDataset({"task_id": np.arange(2)}, batch_size=2))
        async with scheduler:
            batch = next(iter(dataset.stream()))
            rows = await scheduler.step(batch, params(), 0)
        while engine.cancelled < 2:
            await trio.testing.wait_all_tasks_blocked()
    assert len(cancelled) == 2 and engine.cancelled == 2
    assert all(gw.opened[url].closed == "cancelled" for url in cancelled)
    record = scheduler.last_record
    assert record.groups == 2
    if cause == "surplus":
        assert record.cancelled == 2
    else:
        assert {cause: n for cause, n in record.resubmitted.items() if n} == {"timeout": 2}
    # What trains is exactly the answered ("fast") calls' tokens.
    assert rows["loss_mask"].sum() == sum(len(call.completion) for call in engine.served)
    assert len(engine.served) == (2 if cause == "surplus" else 4)


def test_bad_arguments_name_the_culprit():
    with pytest.raises(ValueError, match="gateway"):
        HarnessSource(object(), tool_agent, exact)
    gw = Gateway(ScriptedEngine(), max_context=64, announce=False)
    with pytest.raises(ValueError, match="harness"):
        HarnessSource(gw, "python agent.py", exact)
    with pytest.raises(ValueError, match="max_calls"):
        HarnessSource(gw, tool_agent, exact, max_calls=0)
    with pytest.raises(ValueError, match="verifier"):
        HarnessSource(gw, tool_agent, None)
    with pytest.raises(ValueError, match="wall_clock"):
        HarnessSource(gw, tool_agent, exact, wall_clock=0)
    with pytest.raises(ValueError, match="env"):
        HarnessSource(gw, tool_agent, exact, env={"A": 1})
    with pytest.raises(RuntimeError, match="serving"):
        gw.open()
    with pytest.raises(ValueError, match="max_context"):
        Gateway(ScriptedEngine(), max_context=1)


# --- the built-in lookup harness ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lookup", "lookup-tools"])
async def test_a_lookup_agent_that_looks_up_then_answers_scores_1_in_one_chain(name):
    lookup, task = LookupTask(seed=0), Task("2")
    key = lookup.key(task)
    value = lookup.value(task, key)
    call = key if name == "lookup" else tool_call("lookup", {"key": key})
    engine = ScriptedEngine([call, value])
    async with gateway(engine) as gw:
        session = await HARNESSES[name].source(gw, seed=0).run(task, LABEL)
    assert session.status is Status.COMPLETED, session.error
    assert session.reward == 1.0 and session.components == {"lookup": 1.0, "answer": 1.0}
    assert len(session.calls) == 2 and len(chains(session)) == 1
    if name == "lookup":  # the tool's result is the value, written 16 times, as a user turn
        assert tokenizer.decode(session.calls[1].prompt).endswith(
            f"{key}<|im_end|>\n<|im_start|>user\n{value * 16}<|im_end|>\n<|im_start|>assistant\n"
        )


async def test_the_lookup_harness_fits_its_context_whatever_the_model_writes():
    # The longest session: replies cut by their budget (no stop token), the first a valid key
    # (" 5", whose tool result is the value 16 times).
    engine = ScriptedEngine([" 5", "xyz"])
    harness = HARNESSES["lookup"]
    async with gateway(engine, max_context=harness.max_len, max_tokens=harness.max_tokens) as gw:
        session = await harness.source(gw).run(Task("7"), LABEL)
    assert session.status is Status.COMPLETED, session.error
    last = session.calls[-1]
    assert len(last.prompt) + len(last.completion) == 69 <= harness.max_len
    assert LookupTask().value(Task("7"), "5") * 16 in tokenizer.decode(last.prompt)
    assert session.components["answer"] == 0.0


def outcome(task: Task, *outcome) -> Score:
    return LookupVerifier(LookupTask())(
        HarnessResult(task, Status.COMPLETED, LookupOutcome(*outcome), (), ())
    )


def test_the_lookup_verifier_credits_positions_and_never_a_guess():
    task = Task("5")
    lookup = LookupTask()
    key = lookup.key(task)
    value = lookup.value(task, key)
    other = str((int(key) + 1) % 10)
    assert lookup.question(task) == key * 8 and lookup.observation(task, "x") == "unknown key"
    # Each task has its own table: the value is not a function of the key alone.
    assert len({lookup.value(Task(str(i)), "0") for i in range(20)}) > 1
    assert outcome(task, (key,), value).components == {"lookup": 1.0, "answer": 1.0}
    # Extra characters dilute the credit; a wrong character earns nothing.
    assert outcome(task, (key,), value + "!").components == {"lookup": 1.0, "answer": 0.5}
    # The tool knows no key "K!": the agent never read the value, so its answer earns nothing.
    assert outcome(task, (key + "!",), value).components == {"lookup": 0.5, "answer": 0.0}
    assert outcome(task, (other,), None).components == {"lookup": 0.0, "answer": 0.0}
    # The right value answered without looking the key up is a guess: no credit.
    assert outcome(task, (), value).components == {"lookup": 0.0, "answer": 0.0}
    assert outcome(task, (other,), value).components["answer"] == 0.0
    # Looking the key up after a wrong first lookup reads the value, but is no first lookup.
    assert outcome(task, (other, key), value).components == {"lookup": 0.0, "answer": 1.0}
    # An agent that raised has no outcome.
    failed = HarnessResult(task, Status.AGENT_ERROR, None, (), (), error="boom")
    assert LookupVerifier(lookup)(failed).reward == 0.0


async def test_the_tools_lookup_truncates_on_a_short_context():
    server = tiny_server()
    async with server, gateway(server, max_context=CONFIG.max_len, max_tokens=8) as gw:
        session = await HARNESSES["lookup-tools"].source(gw).run(Task("2"), LABEL)
    # The tools turn alone is longer than this engine's 128 tokens: the first call is refused,
    # the rollout TRUNCATED and still scored (nothing answered).
    assert (session.status, session.truncation, session.calls) == (Status.TRUNCATED, "context", ())
    assert session.reward == 0.0


# --- trained end to end ---------------------------------------------------------------------------


@pytest.mark.medium
def test_a_harness_trains_end_to_end_through_the_synchronous_facade(tmp_path):
    server = tiny_server()

    async def agent(base_url, api_key, task):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key) as api:
            messages = [{"role": "user", "content": GREETING}]
            for _ in range(2):
                answer = await api.chat.completions.create(
                    model="m", messages=messages, max_tokens=4
                )
                messages += [answer.choices[0].message, {"role": "user", "content": "1"}]
        return answer.choices[0].message.content

    def verifier(result: HarnessResult) -> Score:
        return Score(sum(map(ord, result.output or "")) % 7 / 7)  # any varying score trains

    source = ServedGateway(
        server,
        lambda gateway: HarnessSource(gateway, agent, verifier),
        {"max_context": CONFIG.max_len, "max_tokens": 4, "announce": False},
    )
    objective = GRPOObjective(models.model(CONFIG))
    scheduler = RolloutScheduler(
        objective, source, server, width=CONFIG.max_len, rows=4, groups=2, ahead=0
    )
    trainer = Trainer(objective, optax.sgd(1e-3, momentum=0.9), params(), directory=tmp_path)
    dataset = ArrayDataset({"task_id": np.arange(4)}, batch_size=2)
    try:
        trainer.run(scheduler, scheduler.tasks(dataset), steps=2, ahead=0)
    finally:
        scheduler.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["updates"] for line in lines] == [1, 2]
    # Every rollout trained: two calls, merged into one chain.
    assert all(line["groups"] == 2 and line["merge_ratio"] == 0.5 for line in lines)
    assert all(line["tokens/trained"] > 0 for line in lines)
    assert server.version == 1 and source.gateway.open_sessions == 0


def test_session_clients_share_one_connection_pool_per_trio_run_closed_when_it_ends():
    async def two_sessions():
        first = await session_client("http://127.0.0.1:1/a/v1", "key-a")
        second = await session_client("http://127.0.0.1:1/b/v1", "key-b")
        assert (str(first.base_url), first.api_key) == ("http://127.0.0.1:1/a/v1/", "key-a")
        assert (str(second.base_url), second.api_key) == ("http://127.0.0.1:1/b/v1/", "key-b")
        assert first._client is second._client and not first.is_closed()
        return first

    first = trio.run(two_sessions)
    assert first.is_closed()  # the run's pool, closed as the run ended
    assert trio.run(two_sessions)._client is not first._client  # a new run, a new pool
