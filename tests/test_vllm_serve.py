"""`dew serve`: one real vLLM server (its CPU build) started by the command, attached to as
`dew train --engine-url` attaches, and stopped by SIGTERM; the command it prints for those who
start vLLM themselves, and the one docs/vllm.md shows (run by a shell), are the ones dew's own
start runs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax
import pytest

from _checkpoint import tiny_qwen2
from _process_groups import left_running
from dew.cli import main
from dew.serve._vllm_process import SERVER_ENVIRONMENT, server_command
from dew.serve._vllm_start import start_flags
from dew.serve.vllm import VLLMEngine, VLLMError, free_port
from test_vllm import dew_train, metrics

DOCS = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"
DEW = [sys.executable, "-c", "import sys; from dew._command import main; sys.exit(main())"]
READY = re.compile(r"--engine-url (\S+) \(pid (\d+), log (.+)\)")


def _printed(folder: Path, *options: str) -> tuple[dict[str, str], list[str]]:
    """`dew serve FOLDER --print-command`'s output: its variables and its command line.

    The command runs in this process, as the refusals below do: what it prints is its parser's
    and its printer's, which a process of its own (2-4 s each to import the library) added
    nothing to; test_dew_serve_starts_a_server_dew_attaches_to_and_sigterm_stops_it runs `dew
    serve` as a user types it."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert main(["serve", str(folder), "--print-command", *options]) == 0
    words = shlex.split(output.getvalue())
    variables = dict(word.split("=", 1) for word in words if re.match(r"^[A-Z_]+=", word))
    return variables, words[len(variables) :]


def test_print_command_is_what_start_runs(tmp_path):
    folder = tiny_qwen2(tmp_path / "tiny")
    variables, command = _printed(folder, "--port", "8123", "--max-model-len", "128")
    flags = start_flags("tiny", dtype="float32", max_model_len=128)
    expected, added = server_command(
        folder, host="127.0.0.1", port=8123, arguments=flags, environment={}
    )
    assert command == expected
    assert variables == added
    site = Path(variables["PYTHONPATH"].split(os.pathsep)[0])
    assert (site / "sitecustomize.py").is_file()
    # Without --max-model-len: the checkpoint's own length.
    assert _printed(folder)[1][command.index("--max-model-len") + 1] == "256"


def test_print_command_with_a_lora_rank_serves_adapters_loaded_at_run_time(tmp_path, capsys):
    """`dew serve --lora-rank R`, the server `dew train --lora --engine-url` attaches to, runs
    with LoRA on for the smallest rank vLLM takes that holds R, and may load adapters while it
    runs; a rank vLLM cannot serve is refused naming the option."""
    folder = tiny_qwen2(tmp_path / "tiny")
    variables, command = _printed(folder, "--lora-rank", "4")
    at = command.index("--enable-lora")
    assert command[at : at + 5] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]
    assert variables["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    with pytest.raises(SystemExit) as refused:
        main(["serve", str(folder), "--print-command", "--lora-rank", "1024"])
    assert refused.value.code == 2 and "--lora-rank" in capsys.readouterr().err


def test_the_docs_command_has_every_flag_and_variable_of_dews_start():
    """docs/vllm.md's hand-written command, as a shell splits it, holds every variable and flag
    dew's start gives a server, with the same values."""
    text = DOCS.read_text()
    block = text.split("prints the server's environment and command line", 1)[1]
    block = block.split("```console", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    words = shlex.split(block)
    variables = dict(word.split("=", 1) for word in words if re.match(r"^[A-Z_]+=", word))
    assert {**SERVER_ENVIRONMENT, "PYTHONPATH": variables.get("PYTHONPATH")} == variables
    assert "_vllm_site" in variables["PYTHONPATH"]
    command = words[len(variables) :]
    assert command[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = start_flags("qwen2-0.5b", dtype="float32", max_model_len=2048)
    at = command.index("--served-model-name")
    assert command[at:] == flags


@pytest.mark.slow
def test_dew_serve_starts_a_server_dew_attaches_to_and_sigterm_stops_it(tmp_path, capsys):
    folder = tiny_qwen2(tmp_path / "tiny", tied=True)
    serve = subprocess.Popen(
        [*DEW, "serve", str(folder), "--port", "0", "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in serve.stdout:
            lines.append(line)
            if found := READY.search(line):
                break
        else:
            pytest.fail(f"dew serve ended without its URL line:\n{''.join(lines)}")
        url, pid, log = found[1], int(found[2]), Path(found[3])
        assert log.is_file() and log.parent == tmp_path / "logs"
        with VLLMEngine.attach([url], checkpoint=folder, push_dir=tmp_path / "push") as engine:
            assert engine.max_len == 256  # the checkpoint's max_position_embeddings
        # dew train on it, as docs/vllm.md says: its line holds the push, its summary the time.
        run = tmp_path / "run"
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam
            assert main(dew_train(folder, run, [url], "--steps", "1")) == 0
        (line,) = metrics(run)
        assert line["push/version"] == 0 and line["push/seconds"] > 0
        # The full weights: every tensor of the checkpoint, and a tied head's copy besides.
        assert line["push/bytes"] > (folder / "model.safetensors").stat().st_size
        assert "s of wall time (" in capsys.readouterr().out
        serve.send_signal(signal.SIGTERM)
        rest = serve.communicate(timeout=120)[0]
        assert serve.returncode == 0, rest
        assert "stopping the server" in rest
        # Nothing of the server's process group runs on (the engine core included).
        assert not left_running(pid)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


@pytest.mark.slow
def test_a_server_that_is_not_vllm_is_named_in_one_line(tmp_path):
    """Before, the error pasted the web server's 14-line HTML error page in."""
    port = free_port()
    web = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with httpx.Client() as client:
            for _ in range(600):  # until it listens: its import takes a moment
                with contextlib.suppress(httpx.TransportError):
                    client.get(f"http://127.0.0.1:{port}/")
                    break
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(VLLMError) as refused:
            VLLMEngine.attach([url], checkpoint=tiny_qwen2(tmp_path / "tiny"), push_dir=tmp_path)
        message = str(refused.value)
        assert "\n" not in message and "<" not in message, message
        assert url in message and "404 (text/html, from SimpleHTTP" in message
    finally:
        web.kill()
        web.wait()


@pytest.mark.parametrize(
    ("config", "options", "culprit"),
    [
        (None, ["--max-model-len=64"], "not a checkpoint folder (no config.json)"),
        ("{nope", [], "config.json: Expecting property name"),
        ('{"max_position_embeddings": "x"}', [], "gives no max_position_embeddings"),
        ("{}", ["--dtype=fp8"], "argument --dtype: invalid choice: 'fp8'"),
    ],
)
def test_a_bad_checkpoint_or_option_is_refused_in_one_line(
    tmp_path, capsys, config, options, culprit
):
    """Before, --print-command printed a command for a folder that is none, and a --dtype vLLM
    refuses failed the start after a minute, in vLLM's log."""
    folder = tmp_path / "folder"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(config)
    with pytest.raises(SystemExit) as refused:
        main(["serve", str(folder), "--print-command", *options])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and not out
    first, hint = err.splitlines()
    assert first.startswith("dew serve: error: ") and culprit in first, first
    assert hint == "(see `dew serve --help`)"


_SHOWN = """import json, os, sys, sitecustomize
print(json.dumps({"argv": sys.argv[1:], "environment": dict(os.environ),
                  "sitecustomize": sitecustomize.__file__}))"""


@pytest.mark.medium
def test_the_docs_command_run_by_a_shell_runs_what_dew_serve_starts(tmp_path):
    """docs/vllm.md's hand-written command, run by a shell as written but for the reader's own
    parts (its checkpoint folder, the installation's folders, a free port), runs vLLM's server
    with the flags, variables and `sitecustomize` of the command dew's own start runs: its
    Python is asked to show them in place of running the server module, whose start from that
    command test_dew_serve_starts_a_server_dew_attaches_to_and_sigterm_stops_it proves (one
    vLLM start for both: each takes half a minute of a CPU here)."""
    import dew

    text = DOCS.read_text()
    block = text.split("prints the server's environment and command line", 1)[1]
    block = block.split("```console", 1)[1].split("```", 1)[0]
    folder = tiny_qwen2(tmp_path / "qwen2-0.5b", max_len=2048)
    port = free_port()
    site = str(Path(dew.__file__).resolve().parents[1])
    command = block.replace("SITE-PACKAGES", site).replace("checkpoints/qwen2-0.5b", str(folder))
    command = command.replace("--port 8000", f"--port {port}")
    server = "python -m vllm.entrypoints.openai.api_server"
    assert command.count(server) == 1, command
    command = command.replace(server, f"{shlex.quote(sys.executable)} -c {shlex.quote(_SHOWN)}")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = json.loads(done.stdout)
    flags = start_flags("qwen2-0.5b", dtype="float32", max_model_len=2048)
    expected, added = server_command(
        folder, host="127.0.0.1", port=port, arguments=flags, environment={}
    )
    assert shown["argv"] == expected[3:]  # after `python -m vllm.entrypoints.openai.api_server`
    for name, value in added.items():
        if name != "PYTHONPATH":
            assert shown["environment"][name] == value, name
    assert Path(shown["sitecustomize"]).parent.name == "_vllm_site"
    assert Path(shown["sitecustomize"]).parent == Path(added["PYTHONPATH"].split(os.pathsep)[0])


_START_METHODS = """import os, sys
from vllm.engine.arg_utils import EngineArgs
for in_process in sys.argv[2:]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = in_process
    os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    EngineArgs(model=sys.argv[1], max_model_len=128, dtype="float32",
               enforce_eager=True).create_engine_config()
    print("method", in_process, os.environ["VLLM_WORKER_MULTIPROC_METHOD"])"""


@pytest.mark.medium
def test_a_server_with_its_worker_in_the_engine_core_forks_that_engine_core(tmp_path):
    """With the model worker in the engine core's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the
    engine core is the only process a server starts, and dew's `sitecustomize` has vLLM fork it
    (spawned, it imported torch and vLLM again: a tiny server took 22 CPU-s to be ready against
    15); vLLM's own layout keeps the spawn its CPU platform asks for. Checked on the method vLLM
    is left with once it has checked a configuration, in a process with a server's environment:
    one process checks both layouts, each in turn and each twice (a process each took 11 CPU-s
    more, almost all of it importing torch and vLLM again)."""
    folder = tiny_qwen2(tmp_path / "tiny")
    _, added = server_command(folder, host="127.0.0.1", port=0, arguments=(), environment={})
    environment = {**os.environ, **added}
    layouts = ["0", "1", "0", "1"]
    done = subprocess.run(
        [sys.executable, "-c", _START_METHODS, str(folder), *layouts],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # vLLM's log shares the output: the script's lines are those it marked.
    shown = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("method ")]
    methods = {"0": "fork", "1": "spawn"}
    assert shown == [[layout, methods[layout]] for layout in layouts], done.stdout[-1000:]


_SHOW_HIDDEN = """import json, os, subprocess, sys
hidden = [name for name in ("torchvision", "torchaudio", "torchcodec")
          if name in sys.modules and sys.modules[name] is None]
print(json.dumps({"hidden": hidden, "torch": "torch" in sys.modules,
                  "verdict": os.environ["_DEW_HIDDEN_MEDIA"]}), flush=True)
if sys.argv[1:] != ["child"]:
    subprocess.run([sys.executable, __file__, "child"], check=True)
"""


@pytest.mark.medium
def test_the_processes_a_server_starts_hide_its_broken_media_packages_without_importing(
    tmp_path,
):
    """A server's first process finds which media packages cannot load (importing them, torch
    included) and leaves its verdict in the environment; each Python process started from it
    (torch's probes at the first log-prob call, `pip` at `/server_info`: 1.8 CPU-s each, about
    16 a server when each found out again) hides the same ones without importing anything."""
    _, added = server_command(tmp_path, host="127.0.0.1", port=0, arguments=(), environment={})
    script = tmp_path / "show.py"
    script.write_text(_SHOW_HIDDEN)

    def run(**verdict: str) -> list[dict]:
        environment = {**os.environ, **added, **verdict}
        if not verdict:
            environment.pop("_DEW_HIDDEN_MEDIA", None)
        command = [sys.executable, str(script)]
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line) for line in done.stdout.splitlines()]

    first, child = run()
    assert first["verdict"] == ",".join(first["hidden"])
    assert child == {**first, "torch": False}
    # A verdict naming a package: hidden, in the process and its children, with nothing imported.
    told = {"hidden": ["torchvision"], "torch": False, "verdict": "torchvision"}
    assert run(_DEW_HIDDEN_MEDIA="torchvision") == [told, told]
