"""HarnessSource: train any agent harness written against the OpenAI API, unchanged.

Each rollout opens a session on a `dew.gateway.Gateway` and runs one harness against it: an
async function given the session's `base_url` and `api_key`, or a command run with
`OPENAI_BASE_URL` and `OPENAI_API_KEY` in its environment (and the task's name in `DEW_TASK`),
which every official OpenAI client reads. The gateway records each model call token in / token
out; when the harness ends, a verifier scores what it did.

Outcomes:

- COMPLETED: the harness returned (or exited with status 0);
- AGENT_ERROR: it raised (or exited non-zero); still scored, its error text (the traceback's
  tail, or the command's status and stderr tail) kept in `error`;
- TRUNCATED: the session hit a limit, with its reason: `turns` (more calls than `max_calls`),
  `context` (a prompt that leaves no room in the gateway's context) or `wall_clock` (the
  harness ran `wall_clock` seconds); scored too, where the verifier can;
- INFRA_ERROR: the engine failed a call, the command could not start, or the verifier failed.

A rollout that hits a limit, or whose engine failed, ends at once: the harness is cancelled (a
command's whole process group is killed). So does a cancelled rollout, whose session then refuses
every call (410) and cancels its engine calls in flight. A command's group is killed too when
dew itself dies, however it dies (`dew._processes`).
"""

from __future__ import annotations

import math
import os
import subprocess
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from dew._processes import kill_group, watched
from dew.data import Task
from dew.envs.environment import Score, blocking, describe, scored_session
from dew.objectives.rl.sessions import Call, Label, Session, Status

AsyncHarness = Callable[[str, str, Task], Awaitable[Any]]
"""An agent harness as an async function `(base_url, api_key, task) -> output`."""

_STDOUT_KEPT = 1 << 20


@attrs.frozen(eq=False)
class HarnessResult:
    """What a verifier sees of one harness run.

    Args:
        task: the task run.
        status: how the run ended (COMPLETED, AGENT_ERROR or TRUNCATED).
        output: the function's return value, or the command's stdout text (its first MiB).
        transcript: the last chat request's messages, as the harness sent them, and the
            gateway's answer to it (OpenAI message objects); empty without a chat call.
        calls: the recorded calls.
        truncation: why a TRUNCATED run stopped.
        error: the harness's error text, for AGENT_ERROR (and a TRUNCATED run that also failed).
    """

    task: Task
    status: Status
    output: Any
    transcript: tuple[Mapping[str, Any], ...]
    calls: tuple[Call, ...]
    truncation: str | None = None
    error: str | None = None


HarnessVerifier = Callable[[HarnessResult], Score | None]
"""Scores a harness run; None where it cannot (e.g. a truncated run)."""


def _harness(instance, attribute, value):
    command = isinstance(value, Sequence) and not isinstance(value, str | bytes)
    if command:
        if not value or not all(isinstance(arg, str) for arg in value):
            raise ValueError(f"harness as a command must be non-empty strings, got {value!r}")
    elif not callable(value):
        raise ValueError(
            f"harness must be an async function (base_url, api_key, task) or a command "
            f"(a list of strings), got {value!r}"
        )


async def play_in_session(session, wall_clock: float | None, play):
    """Run `play()` until it returns, its gateway session ends (a limit or a fault ends it) or
    `wall_clock` seconds pass, whichever comes first.

    Returns:
        What `play()` returned (None where it was cut short) and whether the wall clock cut it.
    """
    played = None
    with trio.move_on_after(math.inf if wall_clock is None else wall_clock) as deadline:
        async with trio.open_nursery() as nursery:

            async def stop_when_session_ends() -> None:
                await session.ended.wait()
                nursery.cancel_scope.cancel(reason="session ended")

            nursery.start_soon(stop_when_session_ends)
            played = await play()
            nursery.cancel_scope.cancel(reason="play ended")
    return played, deadline.cancelled_caught


def _gateway(instance, attribute, value):
    if not callable(getattr(value, "open", None)):
        raise ValueError(f"gateway must be a dew.gateway.Gateway, got {value!r}")


def _optional_count(instance, attribute, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{attribute.name} must be an int >= 1 or None, got {value!r}")


def _optional_seconds(instance, attribute, value):
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
    ):
        raise ValueError(f"{attribute.name} must be a number of seconds > 0 or None, got {value!r}")


def _characters(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


def _environment(instance, attribute, value):
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(f"{attribute.name} must map strings to strings, got {value!r}")


def _callable(instance, attribute, value):
    if not callable(value):
        raise ValueError(f"{attribute.name} must be callable, got {value!r}")


@attrs.frozen
class _End:
    status: Status
    output: Any = None
    truncation: str | None = None
    error: str | None = None


@attrs.frozen
class HarnessSource:
    """Runs one agent harness per rollout against a recording gateway (a `SessionSource`).

    See the module for the outcomes. The verifier runs in a worker thread that a cancel abandons,
    once the harness is over; it must bound its own time.

    Args:
        gateway: a serving `dew.gateway.Gateway` (in the rollouts' trio run).
        harness: an async function `(base_url, api_key, task) -> output`, or a command (a list
            of strings) run with OPENAI_BASE_URL, OPENAI_API_KEY and DEW_TASK in its environment.
        verifier: scores a `HarnessResult`.
        max_calls: the most model calls per rollout; None for no limit.
        wall_clock: seconds of trio's clock a rollout's harness may run; None for no limit.
        env: more environment variables for a command.
        stderr_tail: how many characters of a command's stderr (or of a traceback) to keep.
    """

    gateway: Any = attrs.field(validator=_gateway)
    harness: AsyncHarness | Sequence[str] = attrs.field(validator=_harness)
    verifier: HarnessVerifier = attrs.field(validator=_callable)
    max_calls: int | None = attrs.field(default=None, kw_only=True, validator=_optional_count)
    wall_clock: float | None = attrs.field(default=None, kw_only=True, validator=_optional_seconds)
    env: Mapping[str, str] = attrs.field(factory=dict, kw_only=True, validator=_environment)
    stderr_tail: int = attrs.field(default=4000, kw_only=True, validator=_characters)

    async def run(self, task: Task, label: Label) -> Session:
        """Run the harness on `task` in a fresh gateway session and score it."""
        session = self.gateway.open(label, max_calls=self.max_calls)
        played = False
        try:
            end = await self._play(session, task)
            played = True
        finally:
            # A cancel (which may reach here wrapped in an exception group) closes it too.
            session.close("finished" if played else "cancelled")
        return await self._score(session, task, end)

    async def _play(self, session, task: Task) -> _End:
        """Run the harness until it ends, the session ends (a limit or a fault) or time is up."""
        ended, timed_out = await play_in_session(
            session, self.wall_clock, lambda: self._attempt(session, task)
        )
        ran = _End(Status.COMPLETED) if ended is None else ended
        if session.infra_error is not None:
            return _End(Status.INFRA_ERROR, error=session.infra_error)
        if session.truncation is not None:
            return attrs.evolve(ran, status=Status.TRUNCATED, truncation=session.truncation)
        if timed_out:
            return attrs.evolve(ran, status=Status.TRUNCATED, truncation="wall_clock")
        return ran

    async def _attempt(self, session, task: Task) -> _End:
        if callable(self.harness):
            return await self._call(session, task)
        return await self._command(session, task)

    async def _call(self, session, task: Task) -> _End:
        try:
            output = await self.harness(session.base_url, session.api_key, task)
        except Exception as error:
            text = "".join(traceback.format_exception(error))
            return _End(Status.AGENT_ERROR, error=f"{describe(error)}\n{text[-self.stderr_tail :]}")
        return _End(Status.COMPLETED, output)

    async def _command(self, session, task: Task) -> _End:
        env = {
            **os.environ,
            **self.env,
            "OPENAI_BASE_URL": session.base_url,
            "OPENAI_API_KEY": session.api_key,
            "DEW_TASK": task.name,
        }
        try:
            process = await trio.lowlevel.open_process(
                list(self.harness),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as error:
            session.fail(f"harness command could not start: {describe(error)}")
            return _End(Status.INFRA_ERROR, error=session.infra_error)
        stdout, stderr = bytearray(), bytearray()
        # Should dew die before the finally below runs (kill -9, a crash), the watchdog kills
        # the group.
        with watched(process.pid):
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_read, process.stdout, stdout, _STDOUT_KEPT, False)
                    nursery.start_soon(_read, process.stderr, stderr, self.stderr_tail * 4, True)
                    status = await process.wait()
                    # The harness is over: whatever it left running in its group goes too,
                    # which also closes the pipes those processes held.
                    kill_group(process.pid)
            finally:
                if process.returncode is None:
                    kill_group(process.pid)
                    with trio.CancelScope(shield=True):
                        await process.wait()
        output = stdout.decode("utf-8", errors="replace")
        if status == 0:
            return _End(Status.COMPLETED, output)
        tail = stderr.decode("utf-8", errors="replace")[-self.stderr_tail :]
        how = f"killed by signal {-status}" if status < 0 else f"exited with status {status}"
        return _End(Status.AGENT_ERROR, output, error=f"harness {how}; stderr tail:\n{tail}")

    async def _score(self, session, task: Task, end: _End) -> Session:
        calls = session.calls
        if end.status is Status.INFRA_ERROR:
            return Session(end.status, calls, error=end.error)
        result = HarnessResult(
            task=task,
            status=end.status,
            output=end.output,
            transcript=tuple(session.transcript),
            calls=calls,
            truncation=end.truncation,
            error=end.error,
        )
        try:
            score = await blocking(self.verifier, result, what="the verifier")
        except Exception as error:
            return Session(Status.INFRA_ERROR, calls, error=f"verifier: {describe(error)}")
        return scored_session(calls, end.status, end.truncation, end.error, score)


async def _read(stream, into: bytearray, keep: int, tail: bool) -> None:
    """Read a pipe to its end, keeping its first (or, with `tail`, last) `keep` bytes."""
    async with stream:
        while chunk := await stream.receive_some():
            if tail:
                into += chunk
                del into[: max(0, len(into) - keep)]
            elif len(into) < keep:
                into += chunk[: keep - len(into)]
