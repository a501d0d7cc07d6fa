"""Joining a `jax.distributed` pool, and stopping all of it, by name, when one process fails.

A process of the pool that fails on its own (its source broke, its engine crashed) tells the pool
why in the coordination service's key-value store and exits; a process that is killed says
nothing. Either way the others find out inside a collective: gloo reports the lost peer within
milliseconds, by address only. `stop` turns that into an error naming the processes that stopped
the pool and why: from what they wrote, from their pids (each process registers its host and pid
when it joins, so a process on the same machine sees that one is gone), or from their silence.

Process 0 is the exception: it holds the coordination service, and when it dies jax's client
ends every other process at once, with jax's own message (the "leader task" died), before a line
of dew's can be written; jax offers no hook to change that. Under `dew train --processes` the
launcher names process 0 as the first failure (`dew._launch`); a process that still loses the
pool in a collective first says that process 0 is gone.

A process that hangs (alive, but never reaching the next collective) is found by `Deadline`: a
step past its deadline says where each process was (which processes had reached the pool's
agreement and which had not), tells the pool, and ends its process, so the others stop too.

The key-value store is jax's coordination service client, which jax offers no public handle for;
it is reached through `jax._src.distributed` in `_client` alone.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

from dew._checks import check_int, check_number

_STOPPED = "dew/stopped/"
_ARRIVED = "dew/arrived/"
_HEARD = "dew/heard/"
_PIDS = "dew/pid/"
# Seconds a process that lost the pool waits for the others to say why they stopped.
HEAR_WITHIN = 5.0
# Seconds between the coordination service's heartbeats that mark a process dead; a pool whose
# processes outlive this without a word is torn down by jax itself.
HEARTBEAT = 30


def join(coordinator: str, processes: int, index: int, *, timeout: int = 300) -> None:
    """Join the pool of `processes` processes whose coordinator (process 0) listens at
    `coordinator` ("HOST:PORT"), as process `index`, with gloo for the CPU collectives.

    Args:
        coordinator: process 0's address; process 0 listens on its port.
        processes: the pool's size.
        index: this process's index, in 0..processes - 1.
        timeout: seconds to wait for every process to join.

    Raises:
        ValueError: naming the argument that is malformed or out of bounds.
    """
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator must be HOST:PORT, got {coordinator!r}")
    processes = check_int("num_processes", processes, low=1)
    if check_int("process_id", index, low=0) >= processes:
        raise ValueError(f"process_id must be an int < num_processes {processes}, got {index!r}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes=processes,
        process_id=index,
        initialization_timeout=timeout,
        heartbeat_timeout_seconds=HEARTBEAT,
    )
    # Where this process runs, so that a process on the same machine can tell it died.
    here = f"{socket.gethostname()} {os.getpid()}"
    _store(lambda client: client.key_value_set(f"{_PIDS}{index}", here, allow_overwrite=True))


def lost_the_pool(error: BaseException) -> bool:
    """Whether error is a collective's report that another process of the pool went away."""
    return "Gloo" in str(error) or isinstance(error, jax.errors.JaxRuntimeError)


def stop(error: BaseException, *, hear_within: float = HEAR_WITHIN) -> str:
    """Tell the pool why this process stops, and say what stopped the pool.

    A process whose own work failed writes its error and returns at once: it must exit soon, as
    the others learn of it when it does. A process that lost the pool in a collective waits up
    to `hear_within` seconds for another process's error; processes still silent then are named
    as stopped without a word (killed, or hung).

    Args:
        error: what this process's run raised.
        hear_within: seconds to wait for the others' word after losing the pool.

    Returns:
        One line for this process's log, naming the processes that stopped the pool and why.
    """
    index, count = jax.process_index(), jax.process_count()
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    lost = lost_the_pool(error)
    said = f"lost the pool: {first}" if lost else f"{type(error).__name__}: {first}"
    _store(lambda client: client.key_value_set(f"{_STOPPED}{index}", said, allow_overwrite=True))
    if not lost:
        line = f"process {index} of {count} failed, stopping the pool: {said}"
    else:
        line = _what_stopped(index, count, first, time.monotonic() + hear_within)
    _leave(index, hear_within)
    return line


def _leave(index: int, hear_within: float) -> None:
    """Say this process heard why the pool stops; process 0 then waits for the others to."""
    _store(lambda client: client.key_value_set(f"{_HEARD}{index}", "1", allow_overwrite=True))
    if index == 0:
        # Process 0 holds the coordination service: the others' reads die with it, so it goes
        # last, once every process has heard why or is gone (or after hear_within).
        count = jax.process_count()

        def everyone(heard: dict[int, str]) -> bool:
            missing = set(range(count)) - set(heard)
            return not missing or missing <= set(_dead_here())

        _wait_for(everyone, _HEARD, time.monotonic() + hear_within)


def _what_stopped(index: int, count: int, first: str, ends: float) -> str:
    """The line of a process that lost the pool: who failed and why, who died, or who fell
    silent. It returns as soon as it knows of a failure or a death, so that its own exit frees
    the processes still blocked in a collective with it."""
    found: dict[str, Any] = {}

    def known(heard: dict[int, str]) -> bool:
        found["failed"] = {i: w for i, w in heard.items() if not w.startswith("lost the pool")}
        found["dead"] = {i: pid for i, pid in _dead_here().items() if i not in heard}
        return bool(found["failed"] or found["dead"])

    heard = _wait_for(known, _STOPPED, ends)
    if heard is None:
        return (
            f"process {index} of {count} stops with the pool: process 0 is gone (it holds the "
            f"pool's coordination service, which no longer answers) ({first})"
        )
    failed, dead = found["failed"], found["dead"]
    causes = [f"process {i} failed ({why})" for i, why in sorted(failed.items())]
    causes += [f"process {i} died (its pid {pid} is gone)" for i, pid in sorted(dead.items())]
    silent = [i for i in range(count) if i not in heard]
    if not causes and silent:
        causes.append(f"{_names(silent)} stopped without a word (killed, or hung)")
    if not causes:
        causes.append(f"every process lost the pool ({first})")
    return f"process {index} of {count} stops with the pool: {'; '.join(causes)}"


def _dead_here() -> dict[int, int]:
    """The pool's processes on this machine whose pid is gone (or a zombie): process -> pid."""
    entries = _store(lambda client: client.key_value_dir_get(_PIDS)) or []
    here = socket.gethostname()
    dead = {}
    for key, value in entries:
        host, _, pid = value.rpartition(" ")
        if host == here and not _alive(int(pid)):
            dead[int(key.rpartition("/")[2])] = int(pid)
    return dead


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    # The state follows the command's closing parenthesis; a zombie has exited.
    return stat.rpartition(")")[2].split()[0] != "Z"


def _wait_for(
    done: Callable[[dict[int, str]], bool], prefix: str, ends: float
) -> dict[int, str] | None:
    """The store's entries under prefix, by process, once done(entries) or at `ends`; None if
    the store does not answer."""
    while True:
        entries = _store(lambda client: client.key_value_dir_get(prefix))
        if entries is None:
            return None
        heard = {int(key.rpartition("/")[2]): value for key, value in entries}
        if done(heard) or time.monotonic() > ends:
            return heard
        time.sleep(0.1)


class Deadline:
    """Ends this process when a step outlives `seconds`, saying where the pool's processes were.

    Each process marks its arrival at each of the pool's agreements (`arrived`); a step past its
    deadline names the processes behind the others, tells the pool, dumps every thread's stack
    to standard error, and exits the process with status 3, so that the others, waiting in a
    collective, lose it at once and stop too.

    Args:
        seconds: a step's deadline.
        exit: called with the status to end the process (os._exit: the pool's collectives would
            block an orderly exit).
    """

    def __init__(self, seconds: float, *, exit: Callable[[int], Any] = os._exit):
        self.seconds = check_number("deadline", seconds, low=0, low_open=True)
        self._exit = exit
        self._step: int | None = None
        self._changed = threading.Condition()
        threading.Thread(target=self._watch, name="dew-deadline", daemon=True).start()

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Watch step `number` until the block ends."""
        with self._changed:
            self._step = number
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                self._step = None
                self._changed.notify()

    def _watch(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._step is not None)
                step = self._step
                expired = not self._changed.wait_for(
                    lambda step=step: self._step != step, timeout=self.seconds
                )
            if expired:
                self._expire(step)
                return

    def _expire(self, step: int) -> None:
        index, count = jax.process_index(), jax.process_count()
        entries = _store(lambda client: client.key_value_dir_get(_ARRIVED)) or []
        arrived = {int(key.rpartition("/")[2]): int(value) for key, value in entries}
        newest = max(arrived.values(), default=-1)
        behind = [i for i in range(count) if arrived.get(i, -1) < newest]
        where = (
            f"{_names(behind)} had not reached the pool's agreement the others waited in"
            if behind
            else "no process was behind the others at the pool's agreements"
        )
        said = f"passed the {self.seconds:g}s deadline of step {step}: {where}"
        _store(lambda client: client.key_value_set(f"{_STOPPED}{index}", said, True))
        print(f"process {index} of {count} {said}; its threads:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        _leave(index, HEAR_WITHIN)
        self._exit(3)


def arrived(call: int) -> None:
    """Mark this process's arrival at the pool's agreement of its `call`-th call, for
    `Deadline`: a process behind the others at a deadline is the one that hangs."""
    index = jax.process_index()
    _store(lambda client: client.key_value_set(f"{_ARRIVED}{index}", str(call), True))


def _client() -> Any:
    from jax._src import distributed

    return distributed.global_state.client


def _store(call: Callable[[Any], Any], *, within: float = 2.0) -> Any:
    """call(client) on the coordination service, or None if it fails or does not answer within
    `within` seconds (the coordinator may be the process that went away)."""
    client = _client()
    if client is None:
        return None
    answer: list[Any] = [None]

    def ask() -> None:
        with contextlib.suppress(Exception):
            answer[0] = call(client)

    asking = threading.Thread(target=ask, name="dew-pool-store", daemon=True)
    asking.start()
    asking.join(within)
    return answer[0]


def _names(indices: list[int]) -> str:
    if len(indices) == 1:
        return f"process {indices[0]}"
    return f"processes {', '.join(map(str, indices))}"
