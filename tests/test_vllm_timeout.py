"""`dew train --engine-timeout`: how long a vLLM server may send nothing before dew leaves it
out as dead, on a real socket that accepts and never answers (a hung or stopped server; the
fleet tests SIGSTOP real vLLM servers under the engine's own `read_timeout`)."""

from __future__ import annotations

import socket
import threading

import pytest

from _checkpoint import tiny_qwen2
from dew.cli import main


@pytest.fixture
def silent_server():
    """The URL of a server that accepts connections and never sends a byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []

    def accept():
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:  # the listener closed
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    # Closing a socket does not wake a thread blocked in its accept() (the join waited its
    # whole 10 s); shutting it down does.
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()
    for connection in held:
        connection.close()
    thread.join(timeout=10)


def test_a_server_that_sends_nothing_is_dropped_after_engine_timeout(
    silent_server, tmp_path, capsys
):
    """With `--engine-timeout 1` the run ends in seconds with one line naming the server and
    the silence, where the engine's default would have waited ten minutes."""
    folder = tiny_qwen2(tmp_path / "model")
    capsys.readouterr()  # transformers' progress bars
    argv = ["train", "--model", str(folder), "--engine", "vllm", "--steps", "1"]
    argv += ["--engine-url", silent_server, "--engine-timeout", "1", "--run", str(tmp_path / "r")]
    assert main(argv) != 0
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1, error
    assert silent_server in error[0] and "does not answer" in error[0], error
    # Its first request, the listing of its models, waited the run's 1 s (before, 30 s).
    assert "sent nothing for 1 s" in error[0], error


def test_the_options_default_is_the_engines():
    from dew.serve._vllm import READ_TIMEOUT
    from dew.train import TrainConfig

    assert TrainConfig().engine_timeout == READ_TIMEOUT
