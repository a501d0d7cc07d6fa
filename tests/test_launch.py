"""The local process pool's launcher (dew._launch) over real child processes.

The children are tiny Python programs: the ones meant to outlive a failure block on their
standard input or in a bounded sleep, so nothing here can hang past that bound, and the tests
order nothing by time: each waits for what it needs (a file, a process's end).
"""

from __future__ import annotations

import io
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dew._launch import describe_exit, exit_status, run_pool

# A child that should still be running when the pool stops it: it writes its pid, then waits.
WAITER = (
    "import os, sys, time; print(os.getpid(), file=open(sys.argv[1], 'w'), flush=True); "
    "time.sleep(60)"
)


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def wait_for(paths: list[pathlib.Path], bound: float = 30.0) -> None:
    """Wait until every path holds text, for at most `bound` seconds."""
    deadline = time.monotonic() + bound
    while not all(p.exists() and p.read_text().strip() for p in paths):
        assert time.monotonic() < deadline, f"{paths} never appeared"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_pool_that_succeeds_exits_0_and_keeps_each_processs_log(tmp_path):
    logs = [tmp_path / f"process-{i}.log" for i in range(3)]
    commands = [python(f"print('hello from {i}')") for i in range(3)]
    echo, report = io.StringIO(), io.StringIO()
    assert run_pool(commands, logs, echo=echo, report=report) == 0
    for i, log in enumerate(logs):
        assert log.read_text() == f"hello from {i}\n"
    assert echo.getvalue() == "hello from 0\n"  # process 0's output is the console's
    assert report.getvalue() == ""


@pytest.mark.parametrize(
    "failure, status, words",
    [("sys.exit(3)", 3, "exit status 3"), ("os.kill(os.getpid(), 9)", 137, "killed by SIGKILL")],
)
def test_the_first_failure_stops_every_other_process_and_gives_the_pools_status(
    tmp_path, failure, status, words
):
    pids = [tmp_path / f"pid-{i}" for i in range(3)]
    logs = [tmp_path / f"process-{i}.log" for i in range(3)]
    commands = [python(WAITER, str(pids[0])), None, python(WAITER, str(pids[2]))]
    # The failing process waits for the others to be up, so it surely fails first.
    commands[1] = python(
        textwrap.dedent(f"""
        import os, pathlib, sys, time
        paths = [pathlib.Path(p) for p in sys.argv[1:]]
        while not all(p.exists() and p.read_text().strip() for p in paths):
            time.sleep(0.05)
        print("failing now", flush=True)
        {failure}
        """),
        str(pids[0]),
        str(pids[2]),
    )
    report = io.StringIO()
    assert run_pool(commands, logs, report=report, grace=1.0) == status
    assert report.getvalue() == (
        f"dew: process 1 failed first ({words}); stopping processes 0, 2\n"
        "dew: processes 0, 2 still running after 1s: sending SIGTERM\n"
    )
    assert logs[1].read_text() == "failing now\n"
    for path in (pids[0], pids[2]):
        assert gone(int(path.read_text()))


def test_ctrl_c_stops_the_whole_pool(tmp_path):
    """The launcher in a process of its own, interrupted as a terminal's Ctrl-C would: every
    process of the pool is stopped and the launcher exits 130."""
    pids = [tmp_path / f"pid-{i}" for i in range(2)]
    logs = [tmp_path / f"process-{i}.log" for i in range(2)]
    script = textwrap.dedent(f"""
        import sys
        from dew._launch import run_pool
        commands = [[sys.executable, "-c", {WAITER!r}, p] for p in {list(map(str, pids))!r}]
        sys.exit(run_pool(commands, {list(map(str, logs))!r}, report=sys.stdout))
        """)
    launcher = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    try:
        wait_for(pids)
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
    assert launcher.returncode == 130
    assert output == "dew: interrupted: stopping processes 0, 1\n"
    for path in pids:
        assert gone(int(path.read_text()))


def test_exit_statuses_read_as_a_shell_shows_them():
    assert exit_status(0) == 0 and exit_status(2) == 2 and exit_status(-9) == 137
    assert describe_exit(-15) == "killed by SIGTERM" and describe_exit(1) == "exit status 1"


def test_a_pool_needs_a_log_per_command(tmp_path):
    with pytest.raises(ValueError, match="one log per command"):
        run_pool([python("pass")], [])
    with pytest.raises(ValueError, match="at least one command"):
        run_pool([], [])
