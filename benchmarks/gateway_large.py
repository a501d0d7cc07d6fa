"""One large request against the others: how long another session waits while it is read.

A client sends one chat request of `--messages` short messages (200,000 make a body of about
6 MB), and while the gateway reads it another session's harness sends small requests one after
another over a keep-alive connection; the script prints the small requests' latencies and what
the large one was answered. With the gateway's default `max_messages` the large request is
refused by its count (after its JSON is parsed, in a worker thread); `--max-messages` above the
count makes the gateway check and render all of it (in a worker thread too) before refusing it
for its length in tokens.

    python benchmarks/gateway_large.py                          # 200,000 messages, refused
    python benchmarks/gateway_large.py --max-messages 1000000   # read and rendered whole
    python benchmarks/gateway_large.py --smoke                  # 20,000, for CI

Target: the small requests' worst latency stays within tens of milliseconds, where reading the
large request on the event loop held them for seconds.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import trio

from dew.gateway import Gateway
from dew.objectives.rl.sessions import Call
from dew.serve import tokenizer

_REPLY = np.concatenate([tokenizer.encode("ok"), [tokenizer.IM_END]]).astype(np.int32)


class InstantEngine:
    """Answers every call at once with the same reply."""

    version = 0

    async def generate(self, prompt, *, max_tokens, stop=(), **sampling) -> Call:
        await trio.lowlevel.checkpoint()
        reply = _REPLY[:max_tokens]
        return Call(np.asarray(prompt, np.int32), reply, np.full(len(reply), -0.5, np.float32), 0)


async def _post(stream, buffer: bytearray, path: str, body: bytes) -> int:
    """One request over a keep-alive connection; its status."""
    head = f"POST {path} HTTP/1.1\r\nhost: b\r\ncontent-length: {len(body)}\r\n\r\n"
    await stream.send_all(head.encode() + body)
    while b"\r\n\r\n" not in buffer:
        buffer += await stream.receive_some(65536)
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(rest) < length:
        rest += await stream.receive_some(65536)
    buffer[:] = rest[length:]
    return int(head.split()[1])


async def main(messages: int, max_messages: int | None, small: int) -> None:
    options = {} if max_messages is None else {"max_messages": max_messages}
    gateway = Gateway(InstantEngine(), max_context=4096, announce=False, **options)
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}] * messages},
        separators=(",", ":"),
    ).encode()
    small_body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    async with gateway:
        large_session, other = gateway.open(), gateway.open()
        host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
        latencies: list[float] = []
        large: dict[str, float | int] = {}

        async def send_large():
            async with await trio.open_tcp_stream(host, int(port)) as stream:
                start = time.perf_counter()
                path = large_session.base_url.removeprefix(gateway.url) + "/chat/completions"
                large["status"] = await _post(stream, bytearray(), path, body)
                large["seconds"] = time.perf_counter() - start

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_large)
            path = other.base_url.removeprefix(gateway.url) + "/chat/completions"
            async with await trio.open_tcp_stream(host, int(port)) as stream:
                buffer = bytearray()
                while "seconds" not in large or len(latencies) < small:
                    start = time.perf_counter()
                    assert await _post(stream, buffer, path, small_body.encode()) == 200
                    latencies.append(time.perf_counter() - start)
    ms = np.array(latencies) * 1e3
    print(f"large request: {messages} messages, {len(body) / 1e6:.1f} MB")
    print(f"  answered {large['status']} after {large['seconds']:.2f} s")
    print(f"another session's {len(ms)} requests meanwhile and after:")
    print(
        f"  p50 {np.median(ms):.2f} ms, p99 {np.percentile(ms, 99):.2f} ms, max {ms.max():.2f} ms"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="20,000 messages, for CI")
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--max-messages", type=int, default=None, help="the gateway's max_messages")
    parser.add_argument("--small", type=int, default=200, help="small requests at least")
    args = parser.parse_args()
    if args.messages < 1 or args.small < 1:
        parser.error("--messages and --small must be >= 1")
    trio.run(main, 20_000 if args.smoke else args.messages, args.max_messages, args.small)
