"""Fleet: several RolloutServers as one Publisher, so the gateway can spread sessions over them."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import trio


class Fleet:
    """An engine fleet: the servers a `Gateway` routes sessions to, and one weight Publisher.

    `async with fleet:` runs every server's step loop in the caller's trio run. `load` is the
    fleet's publish sequence: it hands the weights to every server in one uninterrupted stretch
    of that run's thread (from another thread it hops into the run), and a server starts calls
    under new weights only at a step of its loop, which runs in that thread too. So a push lands
    on every server before any server starts a call under the new version.

    Args:
        servers: the engines (`RolloutServer`s, or anything with their `generate`, `load` and
            async context), at least one.

    Raises:
        ValueError: when there is no server or one lacks `generate` or `load`.
    """

    def __init__(self, servers: Sequence[Any]):
        servers = tuple(servers)
        if not servers:
            raise ValueError("a Fleet needs at least one server")
        for index, server in enumerate(servers):
            for method in ("generate", "load"):
                if not callable(getattr(server, method, None)):
                    raise ValueError(f"servers[{index}] has no {method}(): {server!r}")
        self.servers = servers
        self._token: trio.lowlevel.TrioToken | None = None
        self._stack: contextlib.AsyncExitStack | None = None

    async def __aenter__(self) -> Fleet:
        stack = contextlib.AsyncExitStack()
        async with stack:
            for server in self.servers:
                await stack.enter_async_context(server)
            self._stack = stack.pop_all()
        self._token = trio.lowlevel.current_trio_token()
        return self

    async def __aexit__(self, *exc_info) -> bool:
        self._token = None
        stack, self._stack = self._stack, None
        return await stack.__aexit__(*exc_info)

    def load(self, variables, version: int) -> None:
        """Serve `variables` under `version` on every server (the Publisher protocol).

        Raises:
            ValueError: as `RolloutServer.load`, before any server is changed when the first
                server refuses the weights.
        """
        if self._token is None or _in_run(self._token):
            self._load_all(variables, version)
        else:
            trio.from_thread.run_sync(self._load_all, variables, version, trio_token=self._token)

    def _load_all(self, variables, version: int) -> None:
        for server in self.servers:
            server.load(variables, version)

    @property
    def version(self) -> int:
        """The version calls submitted now start under (the last one loaded)."""
        return self.servers[0].version


def _in_run(token: trio.lowlevel.TrioToken) -> bool:
    try:
        return trio.lowlevel.current_trio_token() is token
    except RuntimeError:
        return False
