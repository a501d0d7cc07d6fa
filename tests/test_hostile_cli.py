"""The second hostile pass over dew's commands and the processes they start (issue 21, items 7,
8, 13, 14, 15 and 17): every size bounded, every refusal one line and a hint, nothing left
behind by a refusal or a full disk, `--plot` and `--config` meaning what they say, and every
process dew starts ending with it, however it ends.

The refusals run in this process (`dew.cli.main`); the processes' tests start real processes and
kill them, and wait for what they need (a line, a process's end) with a bound, never for a time.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import pathlib
import select
import signal
import subprocess
import sys
import time
import tomllib

import attrs
import psutil
import pytest
import trio
import trio.testing

import dew
from dew import cli, tune
from dew.envs.simulated import SimulatedConfig
from dew.testing import run_simulated
from dew.train import TrainConfig
from dew.train import _run as train_run
from dew.train._folders import _check_run
from dew.train._interrupt import INTERRUPTED

ROOT = pathlib.Path(__file__).resolve().parents[1]
HUGE = "1" + "0" * 30  # an int and a float far past every bound


def refusal(capsys, argv: list[str]) -> str:
    """Run `dew argv`, which must refuse with status 2; its one error line (after checking
    that the refusal is that line and the hint, without argparse's usage block)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    command = " ".join(["dew", *argv[:1]]) if argv and argv[0] in cli.COMMANDS else "dew"
    assert len(lines) == 2, captured.err
    assert lines[0].startswith(f"{command}: error: "), lines
    assert lines[1] == f"(see `{command} --help`)"
    return lines[0]


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    """A short recorded run for `dew tune` (a simulated one, under a mock clock)."""
    path = tmp_path_factory.mktemp("trace") / "run.trace"
    run = functools.partial(
        run_simulated,
        path,
        updates=range(12),
        config=SimulatedConfig(seed=1, duration_mean=4.0, duration_sigma=0.5),
        batch_size=4,
        gap=3.0,
        ahead=1,
        max_lag=1,
        width=512,
        rows=16,
        groups=4,
    )
    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    return str(path)


# --- 7. every size option is bounded ---------------------------------------------------------


def numeric_options() -> list[tuple[str, str]]:
    """(command, option) for every option of every command that takes a number (or a list of
    them): found from the parser, so an option added later is covered too."""
    top = cli.parser()
    (commands,) = [a for a in top._actions if isinstance(a.choices, dict)]
    found = []
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if not action.option_strings or action.type is None:
                continue
            try:
                value = action.type("1")
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                continue
            if not isinstance(value, str | os.PathLike):  # a folder named 1 is no number
                found.append((name, action.option_strings[0]))
    return found


def test_the_numeric_options_are_found():
    found = numeric_options()
    for expected in [
        ("train", "--steps"),
        ("train", "--seed"),
        ("train", "--oversample"),
        ("train", "--learning-rate"),
        ("train", "--processes"),
        ("train", "--deadline"),
        ("tune", "--steps"),
        ("tune", "--ahead"),
        ("tune", "--slots"),
        ("simulate", "--steps"),
        ("replay", "--width"),
        ("replay", "--progress-every"),
    ]:
        assert expected in found


@pytest.mark.parametrize(("command", "option"), numeric_options())
def test_every_numeric_option_refuses_a_huge_value_naming_itself_and_its_bound(
    capsys, tmp_path, command, option
):
    run = tmp_path / "run"
    extra = ["--run", str(run)] if command == "train" else []
    line = refusal(capsys, [command, *extra, option, HUGE])
    assert f"argument {option}: " in line
    assert "within [" in line or "within (" in line
    assert not run.exists()


@pytest.mark.parametrize(
    ("argv", "bound"),
    [
        (["tune", "TRACE", "--steps", "1000000000"], "must be an int within [1, 10000]"),
        (["tune", "TRACE", "--ahead", "1000000"], "must be an int within [0, 64]"),
        (["train", "--oversample", "1000000000"], "oversample must be an int within [0, 4096]"),
        (["train", "--seed", str(10**23)], "seed must be an int within [0, 4294967295]"),
        (["simulate", "--tasks", "1000000"], "must be an int within [1, 4096]"),
    ],
)
def test_the_sizes_the_issue_names_are_refused_before_anything_runs(
    capsys, trace, tmp_path, argv, bound
):
    argv = [trace if a == "TRACE" else a for a in argv]
    if argv[0] == "train":
        argv += ["--run", str(tmp_path / "run")]
    assert bound in refusal(capsys, argv)
    assert not (tmp_path / "run").exists()


def test_every_numeric_train_config_field_has_an_upper_bound():
    # A config file or a resumed run's config.json sets the fields without the options.
    for field in attrs.fields(TrainConfig):
        kind = field.metadata["type"]
        if kind not in (int, float):
            continue
        huge = 10**30 if kind is int else 1e300
        with pytest.raises(ValueError, match=rf"^{field.name} must be"):
            TrainConfig(**{field.name: huge})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--batch-size", "64", "--oversample", "2000", "--ahead", "1"],
            "rollouts in flight, which must be <= 65536, got 258048",
        ),
        (
            ["--d-model", "16384", "--d-ff", "65536", "--layers", "8", "--heads", "8"],
            "the transformer's weights, which must be <= 2147483648",
        ),
    ],
)
def test_train_bounds_the_products_that_allocate(capsys, tmp_path, argv, message):
    run = tmp_path / "run"
    assert message in refusal(capsys, ["train", "--run", str(run), *argv])
    assert not run.exists()


def test_tune_bounds_the_simulated_runs_and_simulate_the_rollouts(capsys, trace):
    ahead = ",".join(map(str, range(64)))
    line = refusal(
        capsys, ["tune", trace, "--ahead", ahead, "--sync-every", "1,2", "--seeds", "40"]
    )
    assert "128 settings x --seeds 40 must make at most 4096 simulated runs" in line
    line = refusal(capsys, ["simulate", "--steps", "10000", "--tasks", "100", "--groups", "4"])
    assert "steps x tasks x groups must be <= 100000 rollouts a setting" in line


# --- 13. one line, and nothing left behind -----------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--task", "reasoning-gym:NOSUCH"], "--task reasoning-gym:NOSUCH: reasoning-gym has no"),
        (["--task", "reasoning-gym:leg_counting,bogus=1"], "unexpected keyword argument 'bogus'"),
        (["--task", "reasoning-gym:leg_counting,max_words=abc"], "'max_words'"),
        (["--task", "reasoning-gym:leg_counting,max_animals=abc"], "{'max_animals': 'abc'}"),
        (["--task", "reasoning-gym:"], "reasoning-gym has no dataset ''"),
        (["--d-model", "3", "--heads", "2"], "d_model must be a multiple of heads 2, got 3"),
        (["--temperature", "1e-300"], "argument --temperature: temperature must be within"),
        (["--learning-rate", "1e300"], "argument --learning-rate: learning_rate must be within"),
        (["--engine-timeout", "0"], "argument --engine-timeout: engine_timeout must be within"),
        (["--engine-timeout", "nan"], "argument --engine-timeout: engine_timeout must be within"),
        (["--engine-timeout", "soon"], "argument --engine-timeout: invalid float value: 'soon'"),
    ],
)
def test_a_bad_train_option_is_one_line_and_leaves_no_run_folder(capsys, tmp_path, argv, culprit):
    run = tmp_path / "run"
    assert culprit in refusal(capsys, ["train", "--run", str(run), *argv])
    assert not run.exists()


def test_a_bad_value_in_a_config_file_names_the_file_and_the_field(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('tensorboard = "yes"\n')
    line = refusal(capsys, ["train", "--config", str(config), "--run", str(tmp_path / "run")])
    assert line.endswith(f"{config}: tensorboard must be true or false, got 'yes'")
    assert not (tmp_path / "run").exists()


def test_a_full_disk_is_one_line_with_status_1_and_the_rerun_is_not_blocked(
    capsys, tmp_path, monkeypatch
):
    def full(path, write):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # The name config.json, the run folder's first file, is written through (the checkpoints
    # are written through dew.train._checkpoint's: test_hostile_folders.py injects there).
    monkeypatch.setattr(train_run, "_write_atomically", full)
    run = tmp_path / "run"
    assert cli.main(["train", "--run", str(run), "--steps", "1"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"dew train: cannot write {run}: No space left on device; the last checkpoint stands: "
        f"continue with `dew train --run {run} --resume` once it can be written"
    )
    # The folder was made before the disk filled: it holds no trained step, so it is free.
    assert run.is_dir()
    _check_run(TrainConfig(steps=1), run, resume=False)


def test_a_run_folder_that_trained_no_step_does_not_block_a_new_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    _check_run(TrainConfig(), run, resume=False)
    (run / "metrics.jsonl").write_text('{"updates": 1}\n')
    with pytest.raises(ValueError, match="already holds a run"):
        _check_run(TrainConfig(), run, resume=False)


@pytest.mark.parametrize(
    ("path", "culprit"),
    [
        ("/proc/front.png", "argument --plot: /proc/front.png: nothing can be written in /proc"),
        ("/read-only/x.png", "argument --plot: /read-only/x.png: the folder /read-only does not"),
        ("front.txt", "argument --plot: front.txt must end in .png, .pdf, .svg"),
    ],
)
def test_tune_refuses_a_plot_it_cannot_write_before_simulating(capsys, trace, path, culprit):
    assert culprit in refusal(capsys, ["tune", trace, "--plot", path])


def test_tune_says_in_one_line_when_the_plot_fails_at_run_time(
    capsys, trace, tmp_path, monkeypatch
):
    def full(rows, path, **limits):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tune._cli, "plot", full)
    picture = tmp_path / "front.png"
    argv = ["tune", trace, "--steps", "4", "--seeds", "1", "--ahead", "0", "--sync-every", "1"]
    assert cli.main([*argv, "--plot", str(picture)]) == 1
    assert capsys.readouterr().err == f"dew tune: cannot write {picture}: No space left on device\n"


# --- 14. --plot says where it wrote; --config's suffix in any case -----------------------------


def test_tune_plot_says_where_it_really_wrote(capsys, trace, tmp_path):
    argv = ["tune", trace, "--steps", "4", "--seeds", "1", "--ahead", "0", "--sync-every", "1"]
    folder = tmp_path / "plots"
    folder.mkdir()
    assert cli.main([*argv, "--plot", str(folder)]) == 0
    assert f"front drawn in {folder / 'front.png'}\n" in capsys.readouterr().out
    assert (folder / "front.png").read_bytes()[:4] == b"\x89PNG"
    bare = tmp_path / "front"
    assert cli.main([*argv, "--plot", str(bare)]) == 0
    assert f"front drawn in {bare}.png\n" in capsys.readouterr().out
    assert pathlib.Path(f"{bare}.png").read_bytes()[:4] == b"\x89PNG"


def test_a_config_file_ending_in_upper_case_toml_is_read_as_toml(tmp_path):
    config = tmp_path / "upper.TOML"
    config.write_text("steps = 7\nlearning_rate = 0.01\n")
    assert TrainConfig.from_file(config) == TrainConfig(steps=7, learning_rate=0.01)


# --- 15. a refusal is the error and a hint, not the usage block --------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--steps", "0"],
        ["train", "--harness", "nope"],
        ["train", "--resume"],
        ["tune"],
        ["tune", "TRACE", "--warmup", "30", "--steps", "4"],
        ["simulate", "--slots", "0"],
        ["replay"],
        ["replay", "TRACE", "--width", "0"],
        ["nosuch"],
        [],
    ],
)
def test_every_refusal_is_the_error_and_a_one_line_hint(capsys, trace, tmp_path, argv):
    argv = [trace if a == "TRACE" else a for a in argv]
    if argv[:1] == ["train"] and "--resume" not in argv:
        argv += ["--run", str(tmp_path / "run")]
    line = refusal(capsys, argv)
    assert "usage:" not in line


# --- 8. every process dew starts ends with it ----------------------------------------------------

# `dew train --harness sleeper`: a harness command that starts a process of its own and never
# ends, so the rollouts are in flight when dew is stopped.
SLEEPER = """
import os, sys
from dew._processes import end_with_parent
# Killed with the test's process (an xdist worker ended by the timeout included), not left on.
end_with_parent(int(os.environ["DEW_TEST_PARENT"]))
from dew.envs import lookup
from dew.envs.harness import HarnessSource

def source(gateway, *, seed=0):
    command = ["sh", "-c", "sleep 300 & sleep 300"]
    return HarnessSource(gateway, command, lambda result: None)

lookup.HARNESSES["sleeper"] = lookup.BuiltinHarness(
    "never ends", source, lookup.LookupTask().dataset, max_len=72, max_tokens=2
)
from dew._command import main
sys.exit(main())
"""

TINY = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]
TINY += ["--batch-size", "2", "--groups", "2", "--tasks", "4", "--steps", "2"]


def environment() -> dict[str, str]:
    # The child imports the dew the tests import.
    paths = [str(pathlib.Path(dew.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}


def wait_for_descendants(process: subprocess.Popen, word: str, count: int) -> list:
    """The descendants of `process` once `count` of them have `word` in their command line
    (for at most 120 s)."""
    parent = psutil.Process(process.pid)
    deadline = time.monotonic() + 120
    while True:
        found = parent.children(recursive=True)
        if sum(1 for p in found if word in _command_line(p)) >= count:
            return found
        assert process.poll() is None, f"the process ended with {process.returncode}"
        assert time.monotonic() < deadline, f"{count} {word} processes never started"
        time.sleep(0.1)


def read_until(process: subprocess.Popen, text: str, *, seconds: float) -> str:
    """What `process` writes to its stderr until it has written `text`, ended, or `seconds`
    passed (a run that never answers fails its test with what it said, rather than hanging
    it). Reads the pipe's file descriptor, so no line waits in a buffer select cannot see."""
    deadline = time.monotonic() + seconds
    said = b""
    fd = process.stderr.fileno()
    while text.encode() not in said and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            said += chunk
    return said.decode(errors="replace")


def _command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # it has just ended
        return ""


def assert_all_end(processes: list) -> None:
    """Every process in `processes` ends within 15 s (a zombie counts as ended: its parent,
    or init, reaps it); those that do not are killed, then named."""
    gone, alive = psutil.wait_procs(processes, timeout=15)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    for process in alive:
        process.kill()
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


def a_thread_not_the_main(process: subprocess.Popen) -> int:
    """The id of one of `process`'s threads other than its main one: a signal sent to it with
    kill(2) is the process's, and Linux hands it to that thread, as it may any process signal
    where the main thread already has one pending."""
    return max(thread.id for thread in psutil.Process(process.pid).threads())


@pytest.mark.slow
@pytest.mark.parametrize("landing", ["main thread", "another thread"])
def test_sigterm_stops_dew_train_in_order_and_ends_every_harness_process(tmp_path, landing):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    argv = [sys.executable, str(script), "train", "--harness", "sleeper", *TINY]
    process = subprocess.Popen(
        [*argv, "--run", str(tmp_path / "run")],
        env={**environment(), "DEW_TEST_PARENT": str(os.getpid())},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    started = []
    try:
        # Two tasks x two rollouts, each a shell and its two sleeps.
        started = wait_for_descendants(process, "sleep 300", 8)
        if landing == "main thread":
            process.send_signal(signal.SIGTERM)
        else:  # while the trainer's thread waits on its first batch, which never comes
            os.kill(a_thread_not_the_main(process), signal.SIGTERM)
        # The first SIGTERM asks for a stop after the step; the rollouts never end, so the
        # second stops the run at once. Signals sent together may merge: wait for the first's.
        asked = "dew train: SIGTERM: stopping after the step in progress"
        said = read_until(process, asked, seconds=120)
        assert asked in said, f"the first SIGTERM went unanswered in 120 s: {said}"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == INTERRUPTED
        assert "stopped at once; the last checkpoint stands" in process.stderr.read()
    finally:
        process.kill()
        process.wait()
        process.stderr.close()
        assert_all_end(started)


# A dew process that dies at once, with no clean-up: it starts what `what` says, prints the
# pids to watch, and waits to be killed.
KILLED = """
import os, sys, time, subprocess, concurrent.futures, multiprocessing
from dew import _processes
from dew._launch import run_pool
what = sys.argv[1]
if what == "group":
    process = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"], start_new_session=True)
    _processes.watch(process.pid)
    print("ready", flush=True)
    time.sleep(300)
elif what == "pool":
    print("ready", flush=True)
    command = ["sh", "-c", "sleep 300 & sleep 300"]
    run_pool([command, command], [sys.argv[2] + "-0.log", sys.argv[2] + "-1.log"])
elif what == "workers":
    context = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(
        2, mp_context=context, initializer=_processes.end_with_parent, initargs=(os.getpid(),)
    )
    futures = [pool.submit(time.sleep, 300) for _ in range(2)]
    print("ready", flush=True)
    time.sleep(300)
"""


@pytest.mark.parametrize(("what", "word", "count"), [
    ("group", "sleep 300", 2), ("pool", "sleep 300", 4), ("workers", "spawn_main", 2)
])  # fmt: skip
def test_the_processes_of_a_killed_dew_process_end_with_it(tmp_path, what, word, count):
    """kill -9 of the process that started them: nothing of it runs, yet they end (the
    watchdog kills the groups; the kernel kills the workers)."""
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED, what, str(tmp_path / "pool")],
        env=environment(),
        stdout=subprocess.PIPE,
        text=True,
    )
    started = []
    try:
        assert process.stdout.readline() == "ready\n"
        started = wait_for_descendants(process, word, count)
        process.kill()
        process.wait()
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
        assert_all_end(started)


# --- 17. the notebooks extra ---------------------------------------------------------------------


def test_the_notebooks_extra_installs_jupyterlab_and_the_docs_say_how_to_run_them():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["notebooks"]
    assert {requirement.split(">")[0] for requirement in extra} == {"jupyterlab", "matplotlib"}
    page = (ROOT / "docs" / "notebooks.md").read_text()
    assert "pip install -e '.[notebooks]'" in page and "jupyter lab notebooks/" in page
    assert "'.[notebooks]'" in (ROOT / "README.md").read_text()
