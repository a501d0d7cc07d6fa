"""Fleet: the gateway spreads sessions over several engines (sticky, least-loaded first), and a
push lands on every engine before a call starts under the new version."""

from __future__ import annotations

import jax
import openai
import pytest
import trio

from _gateway import CONFIG, GREETING, ScriptedEngine, tiny_server
from dew import models
from dew.gateway import Fleet, Gateway

pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator '.*' was garbage collected:ResourceWarning"
)


async def ask(session, content: str = GREETING) -> None:
    async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as api:
        await api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": content}], max_tokens=2
        )


@pytest.mark.medium
async def test_sessions_stick_to_the_least_loaded_engine():
    engines = [ScriptedEngine([f"from {i}"]) for i in range(3)]
    async with Fleet(engines) as fleet, Gateway(fleet, max_context=512, announce=False) as gw:
        sessions = [gw.open() for _ in range(4)]
        assert [s.engine for s in sessions] == [0, 1, 2, 0]
        sessions[1].close()
        assert gw.open().engine == 1
        for session in sessions[:1] + sessions[2:]:
            for _ in range(2):
                await ask(session)
    # Every call of a session went to its engine.
    assert [len(e.served) for e in engines] == [4, 0, 2]
    assert [s.calls[0].completion.tolist() for s in (sessions[0], sessions[2], sessions[3])] == [
        engines[e].served[0].completion.tolist() for e in (0, 2, 0)
    ]


@pytest.mark.medium
async def test_a_push_lands_on_every_engine_before_a_call_under_its_version():
    servers = [tiny_server(), tiny_server()]
    pushed = models.init(jax.random.key(1), CONFIG)
    async with Fleet(servers) as fleet, Gateway(fleet, max_context=128, announce=False) as gw:
        sessions = [gw.open(), gw.open()]
        async with trio.open_nursery() as nursery:
            for session in sessions:
                nursery.start_soon(ask, session)
        # The trainer's thread pushes; the push hops into the engines' trio run.
        await trio.to_thread.run_sync(fleet.load, pushed, 5)
        assert [server.version for server in servers] == [5, 5] and fleet.version == 5
        async with trio.open_nursery() as nursery:
            for session in sessions:
                nursery.start_soon(ask, session)
    assert [[call.version for call in s.calls] for s in sessions] == [[0, 5], [0, 5]]
    assert {s.engine for s in sessions} == {0, 1}


def test_a_fleet_needs_engines():
    with pytest.raises(ValueError, match="at least one"):
        Fleet([])
    with pytest.raises(ValueError, match=r"servers\[1\] has no generate"):
        Fleet([ScriptedEngine(), object()])


def test_the_public_surface():
    import inspect

    import dew.envs
    import dew.gateway

    assert set(dew.gateway.__all__) >= {"Gateway", "Fleet", "GatewaySession"}
    assert {"HarnessSource", "HarnessResult"} <= set(dew.envs.__all__)
    assert list(inspect.signature(dew.gateway.Gateway).parameters) == [
        "engine",
        "max_context",
        "max_tokens",
        "sampling",
        "tokenizer",
        "host",
        "port",
        "model",
        "max_body",
        "max_messages",
        "max_tools",
        "header_timeout",
        "body_timeout",
        "max_session_requests",
        "write_timeout",
        "max_connections",
        "announce",
        "freeze_gc",
    ]
    assert list(inspect.signature(dew.envs.HarnessSource).parameters) == [
        "gateway",
        "harness",
        "verifier",
        "max_calls",
        "wall_clock",
        "env",
        "stderr_tail",
    ]
    assert inspect.iscoroutinefunction(dew.envs.HarnessSource.run)
    assert list(inspect.signature(dew.gateway.Fleet.load).parameters) == [
        "self",
        "variables",
        "version",
    ]
