"""Gateway overhead: chat completions per second and latency through HTTP, beside in-process calls.

An instant engine (it answers each call at once with a fixed reply) isolates what the gateway
adds: HTTP parsing, request checking, the chat template, recording and the answer's JSON. The
same calls are then made in-process (template, engine, recording, answer, without HTTP), in the
same run, and the ratio printed.

The load comes from a separate process (so the client's own cost is not the gateway's): it keeps
`--connections` HTTP/1.1 keep-alive connections busy, each over its own session, sending the
multi-turn history back each call, and reports each request's latency.

    python benchmarks/gateway.py            # 4,000 requests over 16 connections
    python benchmarks/gateway.py --smoke    # a few hundred, for CI
    python benchmarks/gateway.py --no-freeze-gc   # the gateway leaves the collector as it is

Target: >= 1,000 requests/s and a p99 under 50 ms through HTTP, on the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import trio

from dew.gateway import Gateway
from dew.objectives.rl.sessions import Call
from dew.serve import tokenizer

_REPLY = np.concatenate([tokenizer.encode("All good."), [tokenizer.IM_END]]).astype(np.int32)
_LOGPROBS = np.full(len(_REPLY), -0.5, np.float32)


class InstantEngine:
    """Answers every call at once with the same reply."""

    version = 0

    async def generate(self, prompt, *, max_tokens, stop=(), **sampling) -> Call:
        await trio.lowlevel.checkpoint()
        return Call(np.asarray(prompt, np.int32), _REPLY[:max_tokens], _LOGPROBS[:max_tokens], 0)


def _request(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _read_response(stream, buffer: bytearray) -> bytes:
    """One response's body off a keep-alive connection (content-length framed)."""
    while b"\r\n\r\n" not in buffer:
        buffer += await stream.receive_some(65536)
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(rest) < length:
        rest += await stream.receive_some(65536)
    buffer[:] = rest[length:]
    return rest[:length]


async def _client(host: str, port: int, paths: list[str], calls: int) -> list[float]:
    """Run `calls` chat requests per connection, one connection per session path."""
    latencies: list[float] = []

    async def connection(path: str) -> None:
        messages = [{"role": "user", "content": "Check the weather."}]
        buffer = bytearray()
        async with await trio.open_tcp_stream(host, port) as stream:
            for _ in range(calls):
                body = json.dumps({"model": "m", "messages": messages}).encode()
                start = time.perf_counter()
                await stream.send_all(_request(path, body))
                answer = json.loads(await _read_response(stream, buffer))
                latencies.append(time.perf_counter() - start)
                messages += [answer["choices"][0]["message"], {"role": "user", "content": "ok"}]
                if len(messages) > 20:  # keep the history (and each request) bounded
                    messages = messages[:1]

    async with trio.open_nursery() as nursery:
        for path in paths:
            nursery.start_soon(connection, path)
    return latencies


def client_main(argv: list[str]) -> None:
    """The load process: prints its latencies and its running time in seconds, as JSON."""
    host, port, calls, *paths = argv
    start = time.perf_counter()
    latencies = trio.run(_client, host, int(port), paths, int(calls))
    print(json.dumps({"latencies": latencies, "seconds": time.perf_counter() - start}))


def _figures(latencies: list[float], seconds: float) -> dict[str, float]:
    ms = np.array(latencies) * 1000
    return {
        "requests_per_s": len(latencies) / seconds,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
    }


async def _through_http(connections: int, calls: int, freeze_gc: bool) -> dict[str, float]:
    gateway = Gateway(InstantEngine(), max_context=1 << 16, announce=False, freeze_gc=freeze_gc)
    async with gateway:
        sessions = [gateway.open() for _ in range(connections)]
        host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
        paths = [s.base_url.removeprefix(gateway.url) + "/chat/completions" for s in sessions]
        command = [sys.executable, __file__, "--client", host, port, str(calls), *paths]
        cpu = time.process_time()
        done = await trio.run_process(command, capture_stdout=True)
        cpu = time.process_time() - cpu
        recorded = sum(len(s.calls) for s in sessions)
    load = json.loads(done.stdout)
    latencies, seconds = load["latencies"], load["seconds"]
    if recorded != connections * calls or len(latencies) != recorded:
        raise RuntimeError(f"recorded {recorded} calls for {len(latencies)} answered requests")
    return {**_figures(latencies, seconds), "cpu_ms": 1000 * cpu / recorded}


async def _in_process(connections: int, calls: int) -> dict[str, float]:
    """The same calls without HTTP: the gateway's template, engine call, record and answer."""
    from dew.gateway._answers import chat_body, cut
    from dew.gateway._record import Turn
    from dew.gateway._schema import chat_request
    from dew.gateway._template import parse_reply

    engine = InstantEngine()
    async with Gateway(engine, max_context=1 << 16, announce=False) as gateway:
        latencies = []
        start = time.perf_counter()
        for _ in range(connections):
            session = gateway.open()
            messages = [{"role": "user", "content": "Check the weather."}]
            for _ in range(calls):
                t = time.perf_counter()
                body = json.dumps({"model": "m", "messages": messages}).encode()
                request = chat_request(json.loads(body))
                with session.admitted(b"", retry=False):
                    prompt = session.chat_prompt(request).ids
                    call = await engine.generate(prompt, max_tokens=64)
                    sample = cut(call, gateway.tokenizer, ())
                    reply = parse_reply(sample.text, tools=False)
                    session.record(Turn(sample.call, reply.content, (), len(messages), b""))
                answer = chat_body("x", "m", sample, reply, gateway.tokenizer, request)
                json.dumps(answer).encode()
                latencies.append(time.perf_counter() - t)
                messages += [answer["choices"][0]["message"], {"role": "user", "content": "ok"}]
                if len(messages) > 20:
                    messages = messages[:1]
        seconds = time.perf_counter() - start
    return _figures(latencies, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few hundred requests, for CI")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--calls", type=int, default=250, help="requests per connection")
    parser.add_argument(
        "--no-freeze-gc",
        dest="freeze_gc",
        action="store_false",
        help="serve with Gateway(freeze_gc=False), to compare",
    )
    args, rest = parser.parse_known_args()
    if args.smoke:
        args.connections, args.calls = 8, 25
    http = trio.run(_through_http, args.connections, args.calls, args.freeze_gc)
    local = trio.run(_in_process, args.connections, args.calls)
    total = args.connections * args.calls
    print(
        f"gateway benchmark: {total} chat completions, {args.connections} connections, "
        f"freeze_gc={args.freeze_gc}"
    )
    print(
        f"  through HTTP: {http['requests_per_s']:.1f} req/s, p50 {http['p50_ms']:.2f} ms, "
        f"p99 {http['p99_ms']:.2f} ms"
    )
    print(
        f"  gateway process CPU per request: {http['cpu_ms']:.3f} ms "
        f"(one free core would serve {1000 / http['cpu_ms']:.0f} req/s)"
    )
    print(
        f"  in-process:   {local['requests_per_s']:.1f} req/s, p50 {local['p50_ms']:.3f} ms, "
        f"p99 {local['p99_ms']:.3f} ms"
    )
    ratio = http["requests_per_s"] / local["requests_per_s"]
    print(f"  ratio (HTTP / in-process throughput): {ratio:.3f}")
    met = http["requests_per_s"] >= 1000 and http["p99_ms"] < 50
    print(f"  target >= 1,000 req/s and p99 < 50 ms through HTTP: {'met' if met else 'missed'}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2:])
    else:
        main()
