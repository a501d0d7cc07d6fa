"""The zygote of dew's vLLM servers: imports vLLM's server once, then forks a server per request.

Run by `dew.serve._vllm_fork` as `python dew_vllm_zygote.py`, in the environment of the servers
it forks (this folder leads its PYTHONPATH, so `sitecustomize` has run, and its verdict on the
media packages passes on to each server). Standard library only,
besides the imports it exists for. Its protocol, one JSON object per line:

- it writes `{"ready": true}` once vLLM is imported (or dies, its traceback on stderr);
- it reads `{"argv": [...], "environment": {...}, "log": PATH, "cwd": PATH}`, forks a child
  for it and answers `{"forked": PID}`; the child writes `{"started": PID}` once it leads a
  session (and process group) of its own, then appends its output to PATH, takes the
  environment whole and runs `python -m vllm.entrypoints.openai.api_server ARGV` as it would
  in a fresh process, atexit handlers and exit code included;
- it writes `{"exited": PID, "code": CODE}` when a child ends (Popen's returncode: -N for
  signal N);
- it exits when its input ends (dew closed it, or is gone).
"""

import json
import os
import runpy
import select
import sys

from sitecustomize import MEDIA_VERDICT

SERVER = "vllm.entrypoints.openai.api_server"
POLL = 0.1  # seconds between looks for children that ended
# The answers' pipe, on a descriptor of its own: what vLLM's imports print to stdout goes to
# stderr (descriptor 1 is made a copy of 2 below), and a child closes it.
REPLY = os.dup(1)


def answer(message: dict) -> None:
    os.write(REPLY, (json.dumps(message) + "\n").encode())


def reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        answer({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def requests():
    """The requests read from stdin, until it ends; children ended meanwhile are reported."""
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], POLL)
        reap()
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        yield from (json.loads(line) for line in lines if line.strip())


def fork_servers() -> dict | None:
    """Serve requests in this process; return a request in each child forked for one."""
    for request in requests():
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return request
        answer({"forked": pid})
    return None


def become_server(request: dict) -> None:
    """In a forked child: the process `python -m SERVER ARGV` would be, but for its imports."""
    os.setsid()
    answer({"started": os.getpid()})
    os.close(REPLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    verdict = os.environ[MEDIA_VERDICT]  # this zygote's: the server hides what it hid
    os.environ.clear()
    os.environ.update(request["environment"])
    os.environ[MEDIA_VERDICT] = verdict
    os.chdir(request["cwd"])
    sys.argv = [SERVER, *request["argv"]]


if __name__ == "__main__":
    os.dup2(2, 1)
    import vllm.entrypoints.launchers.api_server.entry  # noqa: F401
    import vllm.entrypoints.openai.api_server  # noqa: F401

    answer({"ready": True})
    request = fork_servers()
    if request is None:
        sys.exit(0)
    become_server(request)
    runpy.run_module(SERVER, run_name="__main__", alter_sys=True)
