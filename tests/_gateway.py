"""Helpers of the gateway tests: a scripted engine, a tiny real engine, and a raw HTTP client.

The scripted engine answers each call with the next reply of a script (as the byte tokenizer's
ids, closed by <|im_end|>) and keeps every call it served, so a test can say what the model
"wrote" (a tool call, say) and compare what the gateway recorded with what the engine returned.
The real tiny engine is a `RolloutServer` over a small random transformer: every server built
from it shares one config, so JAX compiles its steps once per prompt bucket for the process.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import attrs
import jax
import numpy as np
import trio

from dew import models
from dew.objectives.rl.sessions import Call
from dew.serve import RolloutServer, tokenizer

CONFIG = models.TransformerConfig(d_model=32, heads=2, layers=1, d_ff=64, max_len=128)


@functools.cache
def params():
    return models.init(jax.random.key(0), CONFIG)


# A first message whose chat prompt (33 to 64 tokens) and a second turn's stay in one prefill
# bucket of the engine, so the tests on the real engine compile one prefill.
GREETING = "Hi, how are you?"


def tiny_server(**kwargs) -> RolloutServer:
    return RolloutServer(CONFIG, params(), slots=8, **kwargs)


@attrs.define(eq=False)
class ScriptedEngine:
    """An engine with `RolloutServer.generate`'s signature that writes scripted replies.

    Args:
        replies: the replies' texts in order; the last one repeats.
        version: the version each call reports.
        delay: seconds of trio's clock each call takes; None waits until cancelled.
        hang_on: a call whose prompt's text holds it waits until cancelled.
        fail_on: a call whose prompt's text holds it raises RuntimeError (an engine fault).
        tokenizer: what the replies are encoded with.
        special: encode the replies with the tokenizer's `encode_rendered`, so the special
            tokens a reply spells are tokens, as a model samples them (Mistral's
            `[TOOL_CALLS]`).
    """

    replies: list[str] = attrs.field(factory=lambda: ["ok"])
    version: int = 0
    delay: float | None = 0.0
    hang_on: str | None = None
    fail_on: str | None = None
    served: list[Call] = attrs.field(factory=list)
    cancelled: int = 0
    started: int = 0
    keys: list = attrs.field(factory=list)
    sampling: list = attrs.field(factory=list)
    tokenizer: Any = tokenizer.BYTES
    special: bool = False

    async def generate(self, prompt, *, max_tokens, stop=(), key=None, **sampling) -> Call:
        index = self.started
        self.started += 1
        self.keys.append(key)
        self.sampling.append(sampling)
        text = self.replies[min(index, len(self.replies) - 1)]
        asked = self.tokenizer.decode(np.asarray(prompt))
        if self.fail_on is not None and self.fail_on in asked:
            raise RuntimeError("the engine broke")
        hang = self.delay is None or (self.hang_on is not None and self.hang_on in asked)
        try:
            await (trio.sleep_forever() if hang else trio.sleep(self.delay))
        except trio.Cancelled:
            self.cancelled += 1
            raise
        encode = self.tokenizer.encode_rendered if self.special else self.tokenizer.encode
        ids = np.concatenate([encode(text), [self.tokenizer.eos_id]])
        ids = ids.astype(np.int32)
        ids = ids[:max_tokens]
        logprobs = -np.linspace(0.1, 1.0, len(ids), dtype=np.float32)
        call = Call(np.asarray(prompt, np.int32), ids, logprobs, self.version)
        self.served.append(call)
        return call

    async def __aenter__(self) -> ScriptedEngine:
        return self

    async def __aexit__(self, *exc_info) -> None:
        return None

    def load(self, variables, version: int) -> None:
        """Serve `version` from the next call on (the Publisher protocol)."""
        self.version = version


def tool_call(name: str, arguments: dict, content: str = "") -> str:
    """A reply that calls a tool in the gateway's documented format."""
    block = json.dumps({"name": name, "arguments": arguments})
    return f"{content}<tool_call>{block}</tool_call>"


LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a key up.",
        "parameters": {
            "type": "object",
            "title": "LookupArgs",
            "properties": {"key": {"type": "string"}},
            "required": ["key"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


@attrs.frozen
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


async def http(
    url: str,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> Response:
    """One HTTP/1.1 request over a fresh connection, read to its close."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}", "connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if "content-length" not in (headers or {}):
        lines.append(f"content-length: {len(body)}")
    async with stream:
        await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        data = bytearray()
        while chunk := await stream.receive_some():
            data += chunk
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    parsed = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        parsed[name.strip().lower()] = value.strip()
    if parsed.get("transfer-encoding") == "chunked":
        rest = _unchunk(rest)
    return Response(int(status_line.split()[1]), parsed, rest)


def _unchunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return bytes(out)


class KeepAlive:
    """An HTTP/1.1 keep-alive connection sending JSON requests one after another (lighter than
    an SDK client, for load tests)."""

    def __init__(self, stream: trio.SocketStream):
        self.stream = stream
        self.buffer = bytearray()

    @classmethod
    async def open(cls, url: str) -> KeepAlive:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        return cls(await trio.open_tcp_stream(host, int(port)))

    async def post(self, path: str, payload) -> tuple[int, dict]:
        body = json.dumps(payload).encode()
        head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
        await self.stream.send_all(head.encode() + body)
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += await self.stream.receive_some()
        head, _, rest = bytes(self.buffer).partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += await self.stream.receive_some()
        self.buffer[:] = rest[length:]
        return int(head.split()[1]), json.loads(rest[:length])
