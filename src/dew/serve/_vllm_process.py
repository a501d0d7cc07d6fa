"""Starting and stopping a vLLM server process on loopback, and waiting for it to be ready.

The server runs in a session (and process group) of its own, so stopping it reaches the engine
core processes vLLM spawns too, and a Ctrl-C at the terminal reaches dew alone, which stops its
servers in order. The group is registered with dew's watchdog (`dew._processes`) while it runs,
so not even a killed dew leaves a server behind.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dew._processes import kill_group, unwatch, watch
from dew.serve._failure import CallFailed
from dew.serve._vllm_fork import ZygoteFailed, fork_server, forks_servers

if TYPE_CHECKING:
    import httpx

_SITE = Path(__file__).with_name("_vllm_site")
_TAIL_LINES = 25

SERVER_ENVIRONMENT = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
}
"""The environment every server dew starts runs in (`environment=` adds to it): vLLM's RL
endpoints (pause, reload, weight version) exist only in its development mode; a KV cache of
1 GiB and threads not bound to cores suit a shared CPU machine; offline, a missing file fails at
once instead of trying the model hub."""


class VLLMError(RuntimeError):
    """A vLLM server that cannot serve the run: it failed to start, refused a push, answered
    out of contract, or none is left alive. The message names the server's URL."""


class PortTaken(VLLMError):
    """A server that exited because another process bound its port first: the port was free
    when it was picked, and vLLM binds it only after its imports, seconds later, while any
    process's outgoing connections may take it meanwhile (such ports lie in the system's
    ephemeral range)."""


# Seconds `stop_servers` gives a server between its SIGTERM and its SIGKILL: one that was ready
# (its requests drain), one still starting.
_GRACE = 20.0
_STARTING_GRACE = 2.0

# What a server's log says when its port was taken before it bound it.
_PORT_TAKEN = "Address already in use"


# A URL pasted without its scheme: `localhost:8000`, `gpu-0:8000/v1`.
_HOST_PORT = re.compile(r"^[\w.\-\[\]:]*:\d+(/.*)?$")


def server_url(url: str) -> str:
    """A vLLM server's base URL as users paste it, normalised: `http://host:port`, `.../`
    and `.../v1` (the OpenAI client's `base_url`) all give `http://host:port`. A path other
    than `/v1` stays (a server behind a proxy at `https://gateway/vllm-0`).

    Raises:
        ValueError: naming the URL when it cannot be a server's: no http or https scheme (a
            bare `host:port`), no host, a bad port, a query or a fragment.
    """
    text = url.strip() if isinstance(url, str) else url
    if not isinstance(text, str):
        raise ValueError(f"a vLLM server URL must be a string, got {url!r}")
    parts = urllib.parse.urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or "://" not in text:
        hint = f": give its scheme, http://{text}" if _HOST_PORT.match(text) else ""
        raise ValueError(
            f"{url!r} is not a vLLM server URL (http://HOST:PORT or https://HOST:PORT){hint}"
        )
    try:
        parts.port  # noqa: B018 (urllib checks the port only when asked for it)
    except ValueError as error:
        raise ValueError(f"{url!r} is not a vLLM server URL: {error}") from None
    if not parts.hostname:
        raise ValueError(f"{url!r} is not a vLLM server URL: it names no host")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r} is not a vLLM server URL: a base URL has no query or fragment")
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return f"{scheme}://{parts.netloc}{path}"


def server_urls(urls: Iterable[str]) -> list[str]:
    """The servers' base URLs, each normalised by `server_url`.

    Raises:
        ValueError: naming a URL that cannot be a server's, or two that name one server (a
            server given twice would reload every push twice, at once).
    """
    seen: dict[str, str] = {}
    for url in urls:
        normal = server_url(url)
        if normal in seen:
            raise ValueError(
                f"the vLLM server {normal} is given twice ({seen[normal]!r} and {url!r}): "
                "give each server once"
            )
        seen[normal] = url
    return list(seen)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the system's pick)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Raise VLLMError naming `host:port` when something already listens there."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError as error:
            raise VLLMError(
                f"port {port} on {host} is in use ({error.strerror}): give another port, or 0 "
                "for a free one"
            ) from None


def server_command(
    checkpoint: Path,
    *,
    host: str,
    port: int,
    arguments: Sequence[str],
    environment: Mapping[str, str],
) -> tuple[list[str], dict[str, str]]:
    """The command line of a vLLM server of `checkpoint` on `host:port` and the variables it
    needs on top of dew's environment: `SERVER_ENVIRONMENT`, `environment`, and a PYTHONPATH
    led by the `_vllm_site` folder. The one place a server's command is made: `ServerProcess`
    runs it and `dew serve --print-command` prints it, so a server started by hand runs as
    dew's own do."""
    added = {**SERVER_ENVIRONMENT, **environment}
    # Every Python process vLLM starts imports `_vllm_site/sitecustomize.py` first (it mends
    # broken torchvision builds, whose import fails vLLM's).
    inherited = added.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
    added["PYTHONPATH"] = os.pathsep.join([str(_SITE), *filter(None, [inherited]), *_dew_source()])
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint),
        "--host",
        host,
        "--port",
        str(port),
        *arguments,
    ]
    return command, added


class ServerProcess:
    """One vLLM OpenAI-compatible server process that dew started, and its log: a fresh
    process, or with vLLM's CPU build a fork of a process that imported vLLM already
    (`dew.serve._vllm_fork`), the same process but for the imports it skips.

    Args:
        checkpoint: the folder vLLM serves.
        port: where it listens on `host`.
        arguments: vLLM's command-line flags after `--model`, `--host` and `--port`.
        log: the file its output goes to.
        environment: variables added to dew's environment for it.
    """

    def __init__(
        self,
        checkpoint: Path,
        *,
        host: str,
        port: int,
        arguments: Sequence[str],
        log: Path,
        environment: Mapping[str, str],
    ):
        self.url = f"http://{host}:{port}"
        self.log = log
        command, added = server_command(
            checkpoint, host=host, port=port, arguments=arguments, environment=environment
        )
        try:
            forked = forks_servers()
        except ValueError as error:  # DEW_VLLM_ZYGOTE misspelt: one line from `dew train`
            raise VLLMError(f"the vLLM server {self.url} did not start: {error}") from None
        if forked:
            try:
                self._process = fork_server(command, added=added, log=log)
            except ZygoteFailed as error:
                raise VLLMError(f"the vLLM server {self.url} did not start: {error}") from None
        else:
            with open(log, "wb") as output:
                self._process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **added},
                    start_new_session=True,
                )
        self._ready = False  # until it answers `wait_ready`'s check
        watch(self._process.pid)
        _RUNNING.add(self)

    @property
    def pid(self) -> int:
        """The server's process id, also its process group's."""
        return self._process.pid

    def exit_code(self) -> int | None:
        """The process's exit code, None while it runs."""
        return self._process.poll()

    def tail(self, lines: int = _TAIL_LINES) -> str:
        """The last lines of its log."""
        try:
            text = self.log.read_bytes()[-64_000:].decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, deadline: float, client: httpx.Client) -> None:
        """Wait until `GET /health` answers 200.

        Raises:
            VLLMError: naming the URL and quoting the log's last lines, when the process exits
                first (vLLM refused the checkpoint or its flags; PortTaken when another process
                bound its port first) or `deadline` passes.
        """
        import httpx  # the vllm extra; `server_urls` checks a config's URLs without it

        while True:
            code = self.exit_code()
            if code is not None:
                tail = self.tail()
                failure = PortTaken if _PORT_TAKEN in tail else VLLMError
                raise failure(
                    f"the vLLM server {self.url} exited with code {code} before it was ready; "
                    f"its last log lines ({self.log}):\n{tail}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self._ready = True
                    return
            if time.monotonic() > deadline:
                raise VLLMError(
                    f"the vLLM server {self.url} was not ready within the timeout; its last log "
                    f"lines ({self.log}):\n{self.tail()}"
                )
            time.sleep(0.5)

    def check_alive(self) -> None:
        """Raise CallFailed naming the URL and the exit code when the process has ended."""
        code = self.exit_code()
        if code is not None:
            raise CallFailed(f"the vLLM server {self.url} died (exit code {code})")

    def kill(self) -> None:
        """Kill the server's whole process group at once (a crash, as tests make one)."""
        kill_group(self._process.pid)
        self._process.wait()

    def stop(self, grace: float | None = None) -> None:
        """Stop the server and every process of its group (`stop_servers`). Safe to call
        again."""
        stop_servers([self], grace)


def stop_servers(servers: Iterable[ServerProcess], grace: float | None = None) -> None:
    """Stop `servers` together, each with every process of its group: SIGTERM to all, then
    SIGKILL to each group still there once its `grace` seconds have passed, counted from the
    same moment for all. `grace` defaults to 20 seconds for a server that answered its
    readiness check and 2 for one still starting: vLLM runs a SIGTERM that comes during its
    start only once its engine is built, tens of seconds later, and such a server serves
    nothing that a grace would let it finish (a failed start of an engine, a run's Ctrl-C
    while its servers start)."""
    servers = list(servers)
    for server in servers:
        _RUNNING.discard(server)
        kill_group(server._process.pid, signal.SIGTERM)
    signalled = time.monotonic()
    for server in servers:
        wait = grace if grace is not None else _GRACE if server._ready else _STARTING_GRACE
        try:
            server._process.wait(timeout=max(0.0, signalled + wait - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # The engine core may outlive the API server's exit: nothing of the group stays.
        kill_group(server._process.pid)
        server._process.wait()
        unwatch(server._process.pid)


def _dew_source() -> list[str]:
    """The folder dew imports from, so the servers' `sitecustomize` finds `dew._torch_media`
    however dew was installed."""
    return [str(Path(__file__).resolve().parents[2])]


# The servers not yet stopped: stopped at interpreter exit, should an exception skip the
# engine's own `close`.
_RUNNING: set[ServerProcess] = set()


@atexit.register
def _stop_all() -> None:
    stop_servers(list(_RUNNING), grace=5.0)
