"""Gateway: an OpenAI-compatible HTTP server that records every call of each rollout's session.

Hypercorn's protocol serves a small ASGI app in the caller's trio run, beside the engines, from
an accept loop of dew's own (`dew.gateway._connections`), so a request's engine call is an
ordinary trio call: a closed session cancels it, a client that hangs up cancels it, and nothing
runs in asyncio threads.

Around the class, in modules of their own: reading a request's body and parsing it
(`_reading`), the engine call and the engines' shared tokenizer (`_engine`), the answers'
bodies and stream chunks (`_answers`, `_responses`), and the HTTP plumbing (`_http`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import sys
from collections.abc import Callable
from typing import Any

import hypercorn.config
import numpy as np
import trio

from dew import _gc
from dew._checks import check_int
from dew.gateway._answers import (
    Sample,
    assistant_message,
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
    cut,
)
from dew.gateway._api_error import ApiError, invalid
from dew.gateway._connections import Connections, serve
from dew.gateway._engine import engine_call, engines_tokenizer, takes
from dew.gateway._http import (
    bearer,
    conversation,
    model_object,
    retry_count,
    send_json,
    send_stream,
)
from dew.gateway._reading import Gone, off_loop, read_body, read_chat, read_completion
from dew.gateway._record import GatewaySession, Template, Turn
from dew.gateway._responses import Answer, chat_payload, named_sse
from dew.gateway._schema import MAX_MESSAGES, MAX_TOOLS, ChatRequest
from dew.gateway._template import Reply, parse_reply, tool_format
from dew.gateway._templated import tally
from dew.objectives.rl.sessions import Label
from dew.serve._sampling import Sampling

_log = logging.getLogger("dew.gateway")

# Closed sessions remembered (to answer 410 rather than 404); older ones are forgotten.
_CLOSED_KEPT = 100_000
# Keys that say "no key": none, an empty one, and the placeholder OpenAI-compatible local servers
# (vLLM) document and verifiers sends when its key variable is unset. They name no session.
_NO_KEY = (None, "", "EMPTY")


def _check_seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e6:
        raise ValueError(f"{name} must be a number of seconds in (0, 1e6), got {value!r}")
    return float(value)


class Gateway:
    """An OpenAI-compatible HTTP server in front of one engine or a `Fleet`, recording per session.

    `async with gateway:` serves it in the caller's trio run (the engines' run); `open()` then
    opens a rollout's session under a fresh unguessable URL prefix, whose `base_url` and
    `api_key` a harness hands to any OpenAI client. Sessions are sticky to one engine, the
    least-loaded when opened. See docs/gateway.md for the endpoints, the tool-call format and
    which request fields are honoured.

    The behaviour policy's sampling is the gateway's `sampling` (temperature, top-k/top-p, and
    each call's key from the rollout's label and call index): a request's temperature, top_p,
    seed or penalties cannot change what is trained on.

    A tokenizer with a checkpoint's own chat template (`dew.serve.tokenizer.TemplateTokenizer`)
    renders every chat and Responses request with that template; `tool_format` is how replies
    are parsed for tool calls, and `rendering` counts how prompts kept the gateway's own turns
    (`spliced`, `drift`, `rerendered`: docs/gateway.md).

    Args:
        engine: a `RolloutServer` (anything with its `generate`), or a `Fleet` of them.
        max_context: most tokens of a prompt and its completion, at most the engines' longest
            sequence; a longer prompt is refused (400) and TRUNCATES its session (`context`).
        max_tokens: most completion tokens per call; a request may ask for fewer.
        sampling: the behaviour policy's sampling settings.
        tokenizer: the tokenizer and chat template (`dew.serve.tokenizer.Tokenizer`); by default
            the engines' own (a `RolloutServer`'s `tokenizer`), else the byte one.
        host: the address to bind; loopback unless asked.
        port: the port; 0 picks a free one.
        model: the model name `GET /v1/models` lists.
        max_body: the largest request body in bytes (413 above it).
        max_messages: the most messages of a chat request (`input` items of a Responses one);
            more are refused (400 naming the field and this limit) before any is read.
        max_tools: the most tools of a request, likewise.
        header_timeout: seconds a connection may take to send a request's headers, counted
            from its opening or from its previous answer (hypercorn's `keep_alive_timeout`,
            so an idle keep-alive connection is closed after as long); then it is closed.
        body_timeout: seconds a request's body may take to arrive once its headers have;
            then it is answered 408 and its connection closed.
        max_session_requests: the most requests of one session read or answered at once; one
            more is answered 429 (a slow client cannot hold a session's connections open by
            the thousand).
        write_timeout: seconds one write of an answer may wait on its client; then its
            connection is closed (a client that stops reading a large answer cannot hold its
            request, and that request's slot of its session, until it disconnects).
        max_connections: the most connections open at once across the gateway; one more waits
            in the listening socket's backlog until another closes (a flood of connections
            cannot take every file the process may open: keep it below `ulimit -n`).
        announce: print the address to stderr when serving.
        freeze_gc: on entering, collect once and move every object alive then (the imported
            modules, the model, the compiled functions) out of the cyclic garbage collector's
            reach (`gc.freeze`) while it serves. A full collection walks every tracked object
            and stops the whole process while it does: with jax imported that is 60-90 ms,
            which every request in flight waits out (the p99 latency of
            `benchmarks/gateway.py` went from 67-92 ms to about 21 ms). Objects alive then are
            still freed when their last reference goes, and collectable again once the last
            gateway of the process has stopped (`dew._gc.frozen_while_serving`).

    Raises:
        ValueError: naming the argument out of bounds, a max_context above an engine's
            `max_len`, or an engine whose tokenizer differs from `tokenizer`.
    """

    def __init__(
        self,
        engine: Any,
        *,
        max_context: int,
        max_tokens: int = 256,
        sampling: Sampling | None = None,
        tokenizer: Any = None,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = "dew",
        max_body: int = 8 << 20,
        max_messages: int = MAX_MESSAGES,
        max_tools: int = MAX_TOOLS,
        header_timeout: float = 5.0,
        body_timeout: float = 10.0,
        max_session_requests: int = 32,
        write_timeout: float = 30.0,
        max_connections: int = 1024,
        announce: bool = True,
        freeze_gc: bool = True,
    ):
        servers = list(engine.servers) if hasattr(engine, "servers") else [engine]
        for index, server in enumerate(servers):
            if not callable(getattr(server, "generate", None)):
                raise ValueError(f"engine {index} must have an async generate(), got {server!r}")
        self.servers: tuple[Any, ...] = tuple(servers)
        # Which engines report top log-probs (`RolloutServer.generate(top_logprobs=...)`).
        self._reports_top = [takes(server.generate, "top_logprobs") for server in servers]
        self.max_context = check_int("max_context", max_context, low=2)
        for index, server in enumerate(servers):
            longest = getattr(server, "max_len", None)
            if isinstance(longest, int) and self.max_context > longest:
                # A prompt the gateway let through would fail in the engine: a client's long
                # prompt answered 500 and booked as an infrastructure fault.
                raise ValueError(
                    f"max_context must be at most engine {index}'s max_len {longest}, got "
                    f"{max_context}"
                )
        self.max_tokens = check_int("max_tokens", max_tokens, low=1)
        self.sampling = Sampling() if sampling is None else sampling
        if not isinstance(self.sampling, Sampling):
            raise ValueError(f"sampling must be a Sampling, got {sampling!r}")
        self.tokenizer = engines_tokenizer(tokenizer, self.servers)
        self.template = Template.of(self.tokenizer)
        self.tool_format = tool_format(self.tokenizer)
        # Under a checkpoint's template: prompts that extended one of the gateway's calls
        # ("spliced"), those that kept its ids where the template renders other text ("drift"),
        # and the gateway's turns tokenized from their text ("rerendered").
        self.rendering: collections.Counter[str] = collections.Counter()
        self.host = host
        self.port = check_int("port", port, low=0)
        self.model = model
        self.max_body = check_int("max_body", max_body, low=1)
        self.max_messages = check_int("max_messages", max_messages, low=1)
        self.max_tools = check_int("max_tools", max_tools, low=0)
        self.header_timeout = _check_seconds("header_timeout", header_timeout)
        self.body_timeout = _check_seconds("body_timeout", body_timeout)
        self.max_session_requests = check_int("max_session_requests", max_session_requests, low=1)
        self.write_timeout = _check_seconds("write_timeout", write_timeout)
        self.max_connections = check_int("max_connections", max_connections, low=1)
        self._connections: Connections | None = None
        self.announce = announce
        self.freeze_gc = freeze_gc
        self.url: str | None = None
        self._sessions: dict[str, GatewaySession] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._pinned = [0] * len(self.servers)
        self._opened = 0
        self._stack: contextlib.AsyncExitStack | None = None

    # --- life -------------------------------------------------------------------------------------

    async def __aenter__(self) -> Gateway:
        if self._stack is not None:
            raise RuntimeError("this Gateway is already serving")
        config = hypercorn.config.Config()
        host = f"[{self.host}]" if ":" in self.host else self.host
        config.bind = [f"{host}:{self.port}"]
        config.errorlog = None
        config.accesslog = None
        # Agents keep their connections alive across sessions (a client per trio run): no
        # reconnection every 1000 requests, hypercorn's default.
        config.keep_alive_max_requests = sys.maxsize
        # Hypercorn closes a connection whose request headers have not all come this long after
        # it opened or was last answered. Its `read_timeout` is not used: it would also close a
        # connection whose client waits, silent, for a long generation. The body has a
        # deadline of its own (`_body`).
        config.keep_alive_timeout = self.header_timeout
        # Large requests are read two at a time in worker threads (the GIL runs one anyway).
        self._readers = trio.CapacityLimiter(2)
        self._stack = contextlib.AsyncExitStack()
        if self.freeze_gc:
            self._stack.enter_context(_gc.frozen_while_serving())
        nursery = await self._stack.enter_async_context(trio.open_nursery())
        self._nursery = nursery
        try:
            self._connections = Connections(self.max_connections)
            binds = await nursery.start(
                serve, self._app, config, self._connections, self.write_timeout
            )
        except BaseException:
            nursery.cancel_scope.cancel()
            await self._stack.aclose()
            self._stack = None
            raise
        self.url = binds[0]
        if self.announce:
            print(f"dew gateway: serving on {self.url}", file=sys.stderr)
        return self

    async def __aexit__(self, *exc_info) -> bool:
        for session in list(self._sessions.values()):
            session.close("gateway stopped")
        self._nursery.cancel_scope.cancel(reason="gateway stopped")
        try:
            await self._stack.__aexit__(*exc_info)
        except BaseExceptionGroup as group:
            # The body's own exception, not the nursery's wrapping of it.
            if len(group.exceptions) == 1 and group.exceptions[0] is exc_info[1]:
                return False
            raise
        finally:
            self._stack = None
            self.url = None
        return False

    def open(self, label: Label | None = None, *, max_calls: int | None = None) -> GatewaySession:
        """Open a rollout's session under a fresh unguessable URL prefix, on the least-loaded
        engine.

        Args:
            label: the rollout's label, which keys each call's sampling; None numbers the
                session.
            max_calls: the most calls before the session is TRUNCATED (`turns`); None for no
                limit.

        Raises:
            RuntimeError: when the gateway is not serving.
            ValueError: when max_calls is not an int >= 1.
        """
        if self.url is None:
            raise RuntimeError("Gateway.open needs a serving gateway: use `async with gateway:`")
        if max_calls is not None:
            check_int("max_calls", max_calls, low=1)
        token = secrets.token_urlsafe(32)
        engine = min(range(len(self.servers)), key=lambda i: (self._pinned[i], i))
        self._pinned[engine] += 1
        self._opened += 1
        label = Label(self._opened, 0, 0) if label is None else label
        session = GatewaySession(
            token,
            f"{self.url}/{token}/v1",
            label=label,
            engine=engine,
            template=self.template,
            max_calls=max_calls,
            on_close=self._forget,
        )
        self._sessions[token] = session
        return session

    def _forget(self, session: GatewaySession) -> None:
        self._sessions.pop(session.token, None)
        self._pinned[session.engine] -= 1
        self._closed[session.token] = session.closed
        while len(self._closed) > _CLOSED_KEPT:
            self._closed.popitem(last=False)

    @property
    def open_sessions(self) -> int:
        """Sessions open now."""
        return len(self._sessions)

    @property
    def connections(self) -> int:
        """Connections open now (at most `max_connections`; none when not serving)."""
        return 0 if self._connections is None else self._connections.open

    # --- HTTP -------------------------------------------------------------------------------------

    async def _app(self, scope, receive, send) -> None:
        """The ASGI application."""
        if scope["type"] != "http":
            return
        try:
            await self._route(scope, receive, send)
        except ApiError as error:
            headers = [(b"x-should-retry", b"true" if error.retry else b"false")]
            if error.code == "method_not_allowed":
                headers.append((b"allow", error.param.encode()))
                error.param = None
            await send_json(send, error.status, error.body(), headers)
        except Exception as error:
            # A fault of the gateway itself: logged with its traceback, answered as a server
            # error the client must not retry, and the session counts as an infrastructure fault.
            _log.exception("dew gateway: %s %s failed", scope["method"], scope["path"])
            session = self._sessions.get(scope["path"].split("/")[1])
            if session is not None:
                session.fail(f"gateway: {type(error).__name__}: {error}")
            failure = ApiError(500, f"the gateway failed: {error}", type="server_error")
            await send_json(send, 500, failure.body(), [(b"x-should-retry", b"false")])

    def _session(self, token: str) -> GatewaySession:
        session = self._sessions.get(token)
        if session is not None:
            return session
        if token in self._closed:
            raise ApiError(
                410, f"this session is closed ({self._closed[token]})", code="session_closed"
            )
        raise ApiError(
            404,
            "no session is served at this URL",
            type="not_found_error",
            code="session_not_found",
        )

    async def _route(self, scope, receive, send) -> None:
        parts = scope["path"].split("/")
        if len(parts) < 4 or parts[0] or parts[2] != "v1":
            raise ApiError(
                404, f"unknown URL {scope['path']!r}", type="not_found_error", code="unknown_url"
            )
        session = self._session(parts[1])
        key = bearer(scope)
        if key not in _NO_KEY and not secrets.compare_digest(
            key.encode("latin-1"), session.api_key.encode()
        ):
            # The URL is the credential; a key is not needed, but a wrong one means a harness
            # wired to another session, whose calls would be recorded into this rollout.
            raise ApiError(
                401,
                "the Authorization header carries an API key that is not this session's: send "
                "the session's api_key, or no key",
                code="invalid_api_key",
            )
        endpoint = "/".join(parts[3:])
        if endpoint.startswith("models/") and endpoint != "models/":
            # `client.models.retrieve(name)`: any name is served (an id may hold slashes).
            endpoint = "models/{model}"
        routes = {
            "chat/completions": ("POST", self._chat),
            "completions": ("POST", self._completions),
            "responses": ("POST", self._responses),
            "models": ("GET", self._models),
            "models/{model}": ("GET", self._model),
        }
        if endpoint not in routes:
            raise ApiError(
                404, f"unknown endpoint /v1/{endpoint}", type="not_found_error", code="unknown_url"
            )
        method, handler = routes[endpoint]
        if scope["method"] != method:
            raise ApiError(
                405,
                f"/v1/{endpoint} takes {method}, not {scope['method']}",
                param=method,
                code="method_not_allowed",
            )
        session.check_open()
        if session.requests >= self.max_session_requests:
            raise ApiError(
                429,
                f"this session has {session.requests} requests in progress, the gateway's "
                f"max_session_requests",
                code="too_many_requests",
            )
        session.requests += 1
        try:
            await handler(session, scope, receive, send)
        finally:
            session.requests -= 1

    async def _body(self, scope, receive) -> bytes:
        """The request's body, within the gateway's max_body and body_timeout."""
        return await read_body(
            scope, receive, max_body=self.max_body, body_timeout=self.body_timeout
        )

    async def _models(self, session, scope, receive, send) -> None:
        await send_json(send, 200, {"object": "list", "data": [model_object(self.model)]})

    async def _model(self, session, scope, receive, send) -> None:
        """`GET /v1/models/{model}`: every name is the one policy served (`model` is ignored)."""
        name = scope["path"].split("/v1/models/", 1)[1]
        await send_json(send, 200, model_object(name))

    async def _chat(self, session: GatewaySession, scope, receive, send) -> None:
        answered = await self._answer(session, scope, receive, "messages")
        if answered is None:
            return
        _, request, sample, reply = answered
        completion_id = "chatcmpl-" + secrets.token_urlsafe(18)
        parts = (completion_id, request.model, sample, reply, self.tokenizer, request)
        if request.sampled.stream:
            await send_stream(send, chat_chunks(*parts))
        else:
            await send_json(send, 200, chat_body(*parts))

    async def _responses(self, session: GatewaySession, scope, receive, send) -> None:
        answered = await self._answer(session, scope, receive, "input", as_chat=chat_payload)
        if answered is None:
            return
        payload, request, sample, reply = answered
        response_id = "resp_" + secrets.token_urlsafe(18)
        answer = Answer(response_id, payload, sample, reply, self.tokenizer, request)
        if request.sampled.stream:
            await send_stream(send, answer.events(), encode=named_sse, done=False)
        else:
            await send_json(send, 200, answer.response())

    async def _answer(
        self,
        session: GatewaySession,
        scope,
        receive,
        field: str,
        as_chat: Callable[..., dict[str, Any]] | None = None,
    ) -> tuple[dict[str, Any], ChatRequest, Sample, Reply] | None:
        """Read a request, then sample and record the reply to it as to a chat request
        (`as_chat` turns a Responses body into the chat request it stands for): the request's
        own payload, the chat request, the sample and the reply; None when the client hung up
        first. `field` is the request's field the conversation came in (`messages`, `input`),
        which an error about the prompt names.

        The whole request is checked before the session admits it: a refused request leaves
        the session as it was."""
        try:
            body = await self._body(scope, receive)
        except Gone:
            return None
        limits = (self.max_messages, self.max_tools)
        read = await off_loop(len(body), self._readers, read_chat, body, as_chat, *limits)
        request_payload, payload, request, fingerprint = read
        with session.admitted(fingerprint, retry=retry_count(scope) > 0) as index:
            rendered = await off_loop(len(body), self._readers, session.chat_prompt, request, field)
            tally(self.rendering, rendered)
            sample = await self._sample(
                session, rendered.ids, request.sampled, index, receive, field
            )
            if sample is None:
                return None
            reply = parse_reply(sample.text, tools=request.parses_tools, format=self.tool_format)
            turn = Turn(
                sample.call,
                reply.content,
                tuple(call_id for call_id, _, _ in reply.tool_calls),
                len(request.messages),
                fingerprint,
                templated=rendered if rendered.text is not None else None,
                thread=conversation(scope),
            )
            session.record(turn)
        session.transcript = [*payload["messages"], assistant_message(reply)]
        return request_payload, request, sample, reply

    async def _completions(self, session: GatewaySession, scope, receive, send) -> None:
        try:
            body = await self._body(scope, receive)
        except Gone:
            return
        vocab = self.tokenizer.vocab_size
        request, fingerprint = await off_loop(
            len(body), self._readers, read_completion, body, vocab
        )
        with session.admitted(fingerprint, retry=retry_count(scope) > 0) as index:
            if isinstance(request.prompt, str):
                prompt_text = request.prompt
                prompt = await off_loop(
                    len(body), self._readers, session.text_prompt, request.prompt
                )
                if not len(prompt):  # a tokenizer may write no token for some text (engine's 500)
                    raise invalid("prompt", "'prompt' encodes to no tokens")
            else:
                prompt = np.array(request.prompt, np.int32)
                prompt_text = self.tokenizer.decode(prompt)
            sample = await self._sample(session, prompt, request.sampled, index, receive, "prompt")
            if sample is None:
                return
            text_ids = None
            if sample.finish == "length":
                text_ids = np.concatenate([sample.call.prompt, sample.call.completion])
            turn = Turn(
                sample.call,
                None,
                (),
                0,
                fingerprint,
                prompt_text + sample.text,
                text_ids,
                thread=conversation(scope),
            )
            session.record(turn)
        completion_id = "cmpl-" + secrets.token_urlsafe(18)
        parts = (completion_id, request.model, sample, self.tokenizer, request, prompt_text)
        if request.sampled.stream:
            await send_stream(send, completion_chunks(*parts))
        else:
            await send_json(send, 200, completion_body(*parts))

    # --- the engine ------------------------------------------------------------------------------

    async def _sample(
        self, session, prompt: np.ndarray, sampled, index: int, receive, field: str
    ) -> Sample | None:
        """Run the engine call of a request and cut it at its stops; None when the client hung
        up first (nothing is recorded then).

        Args:
            field: the request's field the prompt came from (`messages`, `prompt`, `input`),
                which the context's error names.

        Raises:
            ApiError: 400 when the prompt leaves no room (the session is TRUNCATED, `context`);
                410 when the session closed meanwhile; 500 when the engine failed (the session
                is then an infrastructure fault).
        """
        room = self.max_context - len(prompt)
        budget = min(sampled.max_tokens or self.max_tokens, self.max_tokens, room)
        if budget < 1:
            session.truncate("context")
            raise ApiError(
                400,
                f"'{field}' makes a prompt of {len(prompt)} tokens, leaving no room for a reply "
                f"in the context of {self.max_context} tokens",
                param=field,
                code="context_length_exceeded",
            )
        options = self.sampling.options(session.label, index)
        if sampled.top_logprobs and self._reports_top[session.engine]:
            options["top_logprobs"] = sampled.top_logprobs
        server = self.servers[session.engine]
        stop = self.tokenizer.eos_id
        call = await engine_call(
            server, session, prompt, receive, max_tokens=budget, stop=stop, options=options
        )
        if call is None:
            return None
        return cut(call, self.tokenizer, sampled.stop)
