"""The recording gateway against a demanding user of the official `openai` client.

Real HTTP on loopback, the official client, trio's real clock; ordering comes from events, never
from sleeps.
"""

from __future__ import annotations

import threading

import openai
import pytest
import trio

from _gateway import ScriptedEngine
from dew.serve.tokenizer import ByteTokenizer
from test_gateway import gateway

pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator '.*' was garbage collected:ResourceWarning"
)


class HeldTokenizer(ByteTokenizer):
    """The byte tokenizer, holding the rendering of a message that holds `marker` (in the worker
    thread a large request is rendered in) until `release` is set."""

    def __init__(self, marker: str):
        self.marker = marker
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode_turn(self, message):
        if self.marker in message["content"]:
            self.entered.set()
            self.release.wait(timeout=10)
        return super().encode_turn(message)


async def test_two_large_requests_at_once_cannot_pass_max_calls():
    # A body of 64 KiB or more is rendered in a worker thread after the session admitted it: a
    # second request admitted meanwhile must still count the first against max_calls.
    held = HeldTokenizer("FIRST")
    engine = ScriptedEngine(["ok"])
    padding = "x" * (70 << 10)
    async with gateway(engine, tokenizer=held, max_context=200_000) as gw:
        session = gw.open(max_calls=1)
        answers = {}
        async with openai.AsyncOpenAI(
            base_url=session.base_url, api_key=session.api_key, max_retries=0
        ) as api:

            async def ask(name):
                try:
                    content = f"{name} {padding}"
                    reply = await api.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": content}]
                    )
                    answers[name] = reply.choices[0].message.content
                except openai.BadRequestError as error:
                    answers[name] = error.code

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, "FIRST")
                await trio.to_thread.run_sync(held.entered.wait, 10)
                await ask("SECOND")
                held.release.set()
    assert answers == {"FIRST": "ok", "SECOND": "call_limit_exceeded"}
    assert len(session.calls) == 1 and session.truncation == "turns"


@pytest.mark.medium
async def test_the_client_can_retrieve_the_model_it_names():
    # `client.models.retrieve` is GET /v1/models/{id}; the gateway serves one policy under any
    # name, so any name (an id may hold slashes, as Hugging Face names do) is found.
    engine = ScriptedEngine()
    async with gateway(engine, model="policy") as gw:
        session = gw.open()
        async with openai.AsyncOpenAI(
            base_url=session.base_url, api_key=session.api_key, max_retries=0
        ) as api:
            named = await api.models.retrieve("policy")
            other = await api.models.retrieve("Qwen/Qwen3-0.6B")
            with pytest.raises(openai.APIStatusError) as raised:
                await api.post("/models/policy", cast_to=object, body={})
    assert (named.id, named.object, other.id) == ("policy", "model", "Qwen/Qwen3-0.6B")
    assert raised.value.status_code == 405
    assert session.calls == () and engine.started == 0
