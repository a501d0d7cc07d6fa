"""ServedGateway: a harness source whose engine and gateway run in the trio run that calls it.

The scheduler's synchronous facade (what `Trainer.run` and `dew train` drive) runs its rollouts
in a trio run of its own, in a thread it owns, and the gateway must serve in that run, beside
the engine. So the first rollout starts the engine and the gateway there, as a system task of
that run (which lives until the run ends), builds the source over the serving gateway, and every
rollout waits for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import trio

from dew.data import Task
from dew.gateway._server import Gateway
from dew.objectives.rl.sessions import Label, Session, SessionSource


class ServedGateway:
    """A `SessionSource` that serves `engine` and a `Gateway` in the rollouts' own trio run.

    Args:
        engine: a `RolloutServer` or a `Fleet` (its `async with` runs it); also the scheduler's
            weight Publisher.
        make_source: builds the source from the serving gateway, e.g.
            `lambda gateway: HarnessSource(gateway, agent, verifier)`.
        options: the Gateway's keyword arguments (`max_context` at least).
    """

    def __init__(
        self,
        engine: Any,
        make_source: Callable[[Gateway], SessionSource],
        options: Mapping[str, Any],
    ):
        if not callable(make_source):
            raise ValueError(f"make_source must be callable, got {make_source!r}")
        self.engine = engine
        self.make_source = make_source
        self.options = dict(options)
        Gateway(engine, **self.options)  # refuse bad options now, not in the first rollout
        self.gateway: Gateway | None = None
        self._source: SessionSource | None = None
        self._running: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._failure: BaseException | None = None

    async def run(self, task: Task, label: Label) -> Session:
        """Run `task` with the built source, once the engine and gateway serve in this run.

        Raises:
            RuntimeError: when called from a second trio run, or when serving failed.
        """
        token = trio.lowlevel.current_trio_token()
        if self._running is None:
            self._running, self._token = trio.Event(), token
            trio.lowlevel.spawn_system_task(self._serve, name="dew-gateway")
        elif token is not self._token:
            raise RuntimeError("a ServedGateway serves the trio run that first called it only")
        await self._running.wait()
        if self._failure is not None:
            raise RuntimeError("the gateway or its engine stopped") from self._failure
        return await self._source.run(task, label)

    async def _serve(self) -> None:
        try:
            async with self.engine, Gateway(self.engine, **self.options) as gateway:
                self.gateway = gateway
                self._source = self.make_source(gateway)
                self._running.set()
                await trio.sleep_forever()
        except Exception as error:  # an uncaught error in a system task would crash the run
            self._failure = error
            self._running.set()
