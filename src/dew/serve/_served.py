"""A session source whose RolloutServer runs in the trio run of the rollouts that use it."""

from __future__ import annotations

import attrs
import trio

from dew.data import Task
from dew.objectives.rl.sessions import Label, Session, SessionSource
from dew.serve._engine import RolloutServer


@attrs.define(eq=False)
class ServedSource:
    """A session source whose RolloutServer's step loop runs in the trio run that calls it.

    A RolloutServer batches only the calls made inside the trio run its loop runs in, and the
    scheduler's synchronous facade runs its rollouts in a trio run of its own, in a thread it
    owns. So the first rollout starts the server there, as a system task of that run (which
    lives until the run ends), and every rollout waits for it to be up. A server that fails makes
    every later rollout raise, which the scheduler reports to the trainer as a broken source.

    Args:
        source: runs the rollouts; its engine is `server`.
        server: the engine to run in the rollouts' trio run.
    """

    source: SessionSource
    server: RolloutServer
    _running: trio.Event | None = attrs.field(default=None, init=False)
    _token: trio.lowlevel.TrioToken | None = attrs.field(default=None, init=False)
    _failure: BaseException | None = attrs.field(default=None, init=False)

    async def run(self, task: Task, label: Label) -> Session:
        """Run `task` with `source`, once the server is up in this trio run.

        Raises:
            RuntimeError: when called from a second trio run, or when the server failed.
        """
        token = trio.lowlevel.current_trio_token()
        if self._running is None:
            self._running, self._token = trio.Event(), token
            trio.lowlevel.spawn_system_task(self._serve, name="dew-rollout-server")
        elif token is not self._token:
            raise RuntimeError("a ServedSource serves the trio run that first called it only")
        await self._running.wait()
        if self._failure is not None:
            raise RuntimeError("the rollout server stopped") from self._failure
        return await self.source.run(task, label)

    async def _serve(self) -> None:
        try:
            async with self.server:
                self._running.set()
                await trio.sleep_forever()
        except Exception as error:  # an uncaught error in a system task would crash the run
            self._failure = error
            self._running.set()
