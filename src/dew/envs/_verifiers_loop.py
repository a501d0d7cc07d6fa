"""The asyncio side of verifiers episodes in a trio run.

verifiers is asyncio and dew runs trio: a run's episodes run on one asyncio event loop in a
thread of its own (`_Loop`), started on the run's first episode and stopped when the run ends
(`_run_loop`); a trio task awaits each episode without holding a thread, and a trio cancel
cancels its asyncio task. Episodes download nothing (`no_downloads`), and an environment that
calls `sys.exit` fails its episode, not the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any

import trio

from dew.envs._offline import no_downloads
from dew.envs.environment import describe


class _Loop:
    """An asyncio event loop in a thread of its own, for one trio run: verifiers' episodes run
    there; a trio task awaits each without holding a thread."""

    def __init__(self):
        # Episodes download nothing either (a game built per episode may ask nltk).
        self.offline = contextlib.ExitStack()
        self.offline.enter_context(no_downloads())
        self.loop = asyncio.new_event_loop()
        self.closing = False
        self.thread = threading.Thread(target=self._serve, name="dew-verifiers", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        while not self.closing:
            # asyncio lets a SystemExit or KeyboardInterrupt raised in a task (an environment
            # calling sys.exit) out of the loop, after handing it to the task's awaiters: run on,
            # so that the episodes of this run, that one's included, still end.
            with contextlib.suppress(SystemExit, KeyboardInterrupt):
                self.loop.run_forever()
        # Stopped with the trio run: what is left ends here. The episodes it awaited were
        # cancelled as it ended and are unwinding: they finish their cleanup first (verifiers
        # stops an episode's tool servers under `wait_for` of a gather, and a second cancel
        # there left the gather's CancelledError unretrieved, a traceback on stderr after the
        # run's own error). Then what nobody cancelled (the environment's own helper tasks,
        # and any the cleanup started) is cancelled, until no task is left.
        unwinding = {task for task in asyncio.all_tasks(self.loop) if task.cancelling()}
        self.loop.run_until_complete(asyncio.gather(*unwinding, return_exceptions=True))
        while left := asyncio.all_tasks(self.loop):
            for task in left:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    async def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Await `coroutine` on the asyncio loop; a trio cancel cancels its asyncio task.

        Raises:
            what the coroutine raised, but a SystemExit or KeyboardInterrupt as a RuntimeError
                (`_contained`); `concurrent.futures.CancelledError`, saying so, where its task
                was cancelled inside the loop (it raised asyncio's CancelledError), not by a
                trio cancel.
        """
        future = asyncio.run_coroutine_threadsafe(_contained(coroutine), self.loop)
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def wake(_) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        future.add_done_callback(wake)
        try:
            await done.wait()
        except BaseException:
            future.cancel()
            raise
        if future.cancelled():
            raise concurrent.futures.CancelledError(
                "the episode was cancelled inside the environment (it raised asyncio's "
                "CancelledError), not by dew"
            )
        return future.result()

    def close(self) -> None:
        """Stop the loop; its thread cancels what is left and ends. An episode whose cleanup
        does not end in a minute is left to the daemon thread (the process's exit ends it)."""
        self.closing = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=60)
        self.offline.close()


async def _contained(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """`coroutine`, a SystemExit or KeyboardInterrupt it raises (an environment calling
    `sys.exit`) raised as a RuntimeError instead: asyncio lets those two out of the loop, which
    would end the loop's thread and leave every later episode waiting on it for good."""
    try:
        return await coroutine
    except (SystemExit, KeyboardInterrupt) as error:
        raise RuntimeError(f"the environment raised {describe(error)}") from error


_LOOP = trio.lowlevel.RunVar("dew.envs.verifiers.loop")


def _run_loop() -> _Loop:
    """This trio run's asyncio loop, started on first use and stopped when the run ends."""
    try:
        return _LOOP.get()
    except LookupError:
        loop = _Loop()
        _LOOP.set(loop)
        trio.lowlevel.spawn_system_task(_close_when_the_run_ends, loop)
        return loop


async def _close_when_the_run_ends(loop: _Loop) -> None:
    try:
        await trio.sleep_forever()
    finally:
        loop.close()
