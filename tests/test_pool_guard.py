"""A real `jax.distributed` pool of three processes, one of which breaks: every process stops,
within seconds, with a line naming the process that broke and why. (Process 1 killed outright
is tested where it matters, on `dew train --processes`, in tests/test_train_pool.py.)

Each pool runs under dew._launch.run_pool, as `dew train --processes` runs one: the processes
that lose the pool get the launcher's grace to stop by themselves, saying why, and a process
still running after it is killed, which fails the test.
"""

from __future__ import annotations

import io
import os
import pathlib
import signal
import socket
import sys

import pytest

from dew._launch import run_pool

WORKER = pathlib.Path(__file__).with_name("_pool_guard_worker.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def break_pool(tmp_path: pathlib.Path, case: str) -> tuple[int, list[str], str]:
    """Run the three-process pool of `case`; its status, each process's log, the report."""
    port = str(free_port())
    commands = [[sys.executable, str(WORKER), port, str(i), "3", case] for i in range(3)]
    logs = [tmp_path / f"process-{i}.log" for i in range(3)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    report = io.StringIO()
    status = run_pool(commands, logs, env=env, report=report, grace=20.0)
    return status, [log.read_text() for log in logs], report.getvalue()


def last_line(log: str) -> str:
    return [line for line in log.splitlines() if line.startswith("process ")][-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, status, culprit",
    [
        ("raise", 1, "process 1 failed (LookupError: the environment of task 9 is gone)"),
        (
            "hang",
            3,
            "passed the 3s deadline of step 0: process 1 had not reached the pool's agreement",
        ),
    ],
)
def test_every_process_stops_naming_the_process_that_broke(tmp_path, case, status, culprit):
    code, logs, report = break_pool(tmp_path, case)
    assert code == status, (report, logs)
    assert "still running after" not in report  # every process stopped by itself
    for index in (0, 2):
        line = last_line(logs[index])
        assert line.startswith(f"process {index} of 3 "), logs[index]
        assert culprit in line, logs[index]
    if case == "raise":
        assert last_line(logs[1]) == (
            "process 1 of 3 failed, stopping the pool: "
            "LookupError: the environment of task 9 is gone"
        )


@pytest.mark.slow
def test_killing_process_0_stops_every_other_process_and_the_launcher_names_it(tmp_path):
    """Process 0 holds the pool's coordination service: when it is killed, jax ends the other
    processes at once (its client aborts on the service's loss, before any line of dew's can
    be written), and the launcher names process 0 as the first failure."""
    code, logs, report = break_pool(tmp_path, "kill0")
    assert code == 128 + signal.SIGKILL, (report, logs)
    assert report.startswith("dew: process 0 failed first (killed by SIGKILL)"), report
    assert "still running after" not in report  # they stopped by themselves, at once
    for index in (1, 2):
        assert "the pool agreed again" not in logs[index]
        assert "Timeout (0:01:00)" not in logs[index]  # not the worker's own bound
