"""The gateway's connections: hypercorn's HTTP protocol on each, taken by an accept loop of dew's
own, which bounds what no hypercorn setting does.

- The connections open at once across the gateway (`max_connections`): past it, a new one waits
  in the listening socket's backlog until another closes, so a flood of connections cannot take
  every file descriptor of the process (and with it the engines' and the trainer's files).
- How long one write of an answer may wait on its client (`write_timeout`): hypercorn writes
  with no deadline, so a client that stops reading a large answer held its request, and that
  request's slot of its session (`max_session_requests`), until it disconnected. Past the
  deadline its connection is closed, which ends the request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import hypercorn.config
import trio
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app


class _Connection(trio.abc.HalfCloseableStream):
    """A TCP connection whose every write must end within `seconds`, else it is closed, and
    which calls `gone` when its client closes it.

    hypercorn shields its writes from cancellation: a deadline of the caller's would not reach
    them, one inside `send_all` does. And hypercorn keeps serving a connection its client closed
    while idle until its keep-alive timeout: `gone` lets the accept loop end it at once.
    """

    def __init__(self, stream: trio.SocketStream, seconds: float, gone: Callable[[], None]):
        self.stream = stream
        self.seconds = seconds
        self.gone = gone
        self.socket = stream.socket  # hypercorn reads the addresses of the connection from it

    async def send_all(self, data) -> None:
        with trio.move_on_after(self.seconds):
            await self.stream.send_all(data)
            return
        # Part of the write may have gone: the connection cannot carry another answer.
        await trio.aclose_forcefully(self.stream)
        raise trio.BrokenResourceError(
            f"the client took none of a write for the gateway's write_timeout of {self.seconds:g} s"
        )

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self.stream.receive_some(max_bytes)
        if not data:
            # The client closed its side: hypercorn ends the request in progress (its app is
            # told the client disconnected), and nothing more can come.
            self.gone()
        return data

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


class Connections:
    """A gateway's connections: at most `limit` open at once, `open` of them now.

    Each accept takes one of `slots` before it waits for a connection, which releases it when
    it ends: an accept waiting holds one.
    """

    def __init__(self, limit: int):
        self.slots = trio.Semaphore(limit)
        self.open = 0


class _Capped(trio.abc.Listener):
    """A listener that accepts a connection only while one of `slots` is free; the connection's
    handler releases it when the connection ends."""

    def __init__(self, listener: trio.SocketListener, slots: trio.Semaphore):
        self.listener = listener
        self.slots = slots

    async def accept(self) -> trio.SocketStream:
        await self.slots.acquire()
        try:
            return await self.listener.accept()
        except BaseException:
            self.slots.release()
            raise

    async def aclose(self) -> None:
        await self.listener.aclose()


async def serve(
    app: Any,
    config: hypercorn.config.Config,
    connections: Connections,
    write_timeout: float,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI `app` on `config`'s binds until cancelled, at most `connections`' limit
    open at once, each write bounded by `write_timeout` seconds; `started` with the URLs
    served.

    What hypercorn's `serve` does, less its lifespan messages (the app needs none), its
    statistics and TLS (`config` binds plain HTTP).
    """
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    context = WorkerContext(None)  # hypercorn's worker-wide cap on requests: none
    async with contextlib.AsyncExitStack() as stack:
        listeners, urls = [], []
        for sock in config.create_sockets().insecure_sockets:
            sock.listen(config.backlog)
            listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
            stack.push_async_callback(listener.aclose)
            listeners.append(_Capped(listener, connections.slots))
            urls.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")

        async def connection(stream: trio.SocketStream) -> None:
            connections.open += 1
            try:
                with trio.CancelScope() as scope:
                    connection = _Connection(stream, write_timeout, scope.cancel)
                    await TCPServer(wrapped, config, context, ConnectionState({}), connection)
            finally:
                # hypercorn closes it, unless it was cancelled first.
                await trio.aclose_forcefully(stream)
                connections.open -= 1
                connections.slots.release()

        async with trio.open_nursery() as nursery:
            task_status.started(urls)
            await trio.serve_listeners(connection, listeners, handler_nursery=nursery)
