"""Environments at their defaults (issue 43): `dew train --env` sizes a run for everything its
agents' first request holds (a tool environment's tool schemas, the system text, the chat
template's wrapping), refuses a first prompt that cannot fit before anything is written, and
says so in one line.

The environments are verifiers tasksets built in the tests (`_vf_lookup`: an MCP tool the agent
calls), trained through `dew train` with its tool servers real subprocesses.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import trio

from _gateway import ScriptedEngine
from _scripted import OBJECTIVE, PARAMS, Engine, Plan, Scripted, dataset
from dew.cli import main
from dew.data import Task
from dew.envs.verifiers import Verifiers
from dew.gateway import Gateway
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import Call, Label, Session, Status
from dew.serve.tokenizer import BYTES
from dew.train import SampleLog
from dew.train._tasks import _verifiers_prompt_length
from test_envs_verifiers import use_nltk_data

# verifiers' MCP client retries with tenacity's deprecated `initial=` (as test_envs_verifiers).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The 'initial' parameter is deprecated:DeprecationWarning"
)
TESTS = str(Path(__file__).parent)
TINY = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]
TINY += ["--batch-size", "2", "--groups", "2", "--tasks", "4", "--eval-tasks", "2"]
TINY += ["--checkpoint-every", "5"]


@pytest.fixture
def tool_servers(monkeypatch):
    """verifiers starts each task's tool server as `python -m _vf_lookup`: it must import."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train(argv: list[str]) -> int:
    with jax.numpy_dtype_promotion("standard"):  # as in test_train_env
        return main(["train", *argv])


# --- build point 2: the prompt budget counts everything the template renders -------------------


def test_a_tool_environments_first_prompt_counts_its_tools():
    """The length a run is sized by is the gateway's prompt of the agent's first request: its
    tools' schemas are in it, so it is longer than the messages alone."""
    env = Verifiers.parse("_vf_lookup", size=1)
    task = env.task(0)
    bare = len(BYTES.encode_chat(env.prompt(task)))
    counted = _verifiers_prompt_length(env, BYTES)(task)
    assert counted > bare + len('"name": "lookup"')


@pytest.mark.medium
def test_a_tool_environment_trains_at_the_default_context(tmp_path, tool_servers):
    """At the default context a tool environment's first call fits: every step trains on tokens
    (before, every rollout was TRUNCATED `context` before its first call: trained on nothing)."""
    run = tmp_path / "run"
    # One task a step: each rollout starts its tool server, a process importing verifiers (about
    # 4 CPU-s each), and one task's group shows what every step trains on as well as two.
    argv = ["--env", "verifiers:_vf_lookup", "--run", str(run), *TINY, "--batch-size", "1"]
    assert train([*argv, "--steps", "2", "--max-tokens", "4"]) == 0
    metrics = lines(run / "metrics.jsonl")
    assert [line["updates"] for line in metrics] == [1, 2]
    for line in metrics:
        assert line["tokens/trained"] > 0
        assert line["masked/context"] == 0


# An episode cancelled by its trio run, whose cleanup stops a server process as verifiers' runtime
# teardown stops an episode's tool servers (`wait_for` of a gather of the processes' exits); the
# trio run ends, as a run's error ends it, once that cleanup is under way.
CANCELLED_EPISODE = """
import asyncio, sys, threading
import trio
from dew.envs._verifiers_loop import _run_loop

started, cleaning = threading.Event(), threading.Event()

async def episode():
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys, time; sys.stdin.read(); time.sleep(1)",
        stdin=asyncio.subprocess.PIPE,
    )
    try:
        started.set()
        await asyncio.Event().wait()
    finally:
        cleaning.set()
        server.stdin.close()
        await asyncio.wait_for(asyncio.gather(server.wait(), return_exceptions=True), 30)

async def main():
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_run_loop().run, episode())
        await trio.to_thread.run_sync(started.wait)
        nursery.cancel_scope.cancel()
    await trio.to_thread.run_sync(cleaning.wait)

trio.run(main)
print("ended")
"""


@pytest.mark.medium
def test_an_episode_cancelled_by_the_runs_end_finishes_its_cleanup_without_a_traceback():
    """A run that ends (its error, or its last step) while an environment's episode is still
    stopping its servers lets that cleanup finish: it is not cancelled a second time when the
    asyncio loop closes (a verifiers tool environment's run printed `_GatheringFuture exception
    was never retrieved` and its traceback after the run's own one-line error)."""
    done = subprocess.run(
        [sys.executable, "-c", CANCELLED_EPISODE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ended", done.stderr[-3000:]
    assert "never retrieved" not in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_first_prompt_that_cannot_fit_is_refused_before_the_run_folder(
    tmp_path, capsys, tool_servers
):
    run = tmp_path / "run"
    argv = ["--env", "verifiers:_vf_lookup", "--run", str(run), *TINY, "--max-context", "200"]
    with pytest.raises(SystemExit) as exit_:
        train([*argv, "--steps", "1"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "task '0'" in error and "--max-context 200" in error
    length = _verifiers_prompt_length(Verifiers.parse("_vf_lookup", size=1), BYTES)
    assert f"{length(Verifiers.parse('_vf_lookup', size=1).task(0))} tokens" in error
    assert "Traceback" not in error
    assert not run.exists()


def test_a_games_first_prompt_past_the_context_is_refused_before_the_run_folder(tmp_path, capsys):
    """TextArena alike: TicTacToe's first message (about 400 bytes) cannot fit 100 tokens."""
    run = tmp_path / "run"
    argv = ["--env", "textarena:TicTacToe-v0", "--run", str(run), *TINY, "--max-context", "100"]
    with pytest.raises(SystemExit) as exit_:
        train([*argv, "--steps", "1"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "--max-context 100: task '0'" in error and "tokens" in error
    assert "Traceback" not in error and not run.exists()


# --- build point 3: several agents per episode -------------------------------------------------


@pytest.mark.medium
def test_a_two_agent_environment_is_sized_for_both_chains_and_cuts_no_group(tmp_path, caplog):
    """`_vf_duo`'s episodes are two chains (one per agent): rows are sized for both, so no
    group is cut for room (before, half of them were, silently: `groups 1, cut 1`)."""
    run = tmp_path / "run"
    caplog.set_level(logging.WARNING, "dew.objectives.rl.scheduler")
    argv = ["--env", "verifiers:_vf_duo,digits=3", "--run", str(run), *TINY]
    assert train([*argv, "--steps", "2", "--max-tokens", "4"]) == 0
    metrics = lines(run / "metrics.jsonl")
    assert [line["updates"] for line in metrics] == [1, 2]
    for line in metrics:
        assert line["cut"] == 0 and line["groups"] == 2
    assert not [r for r in caplog.records if "cut" in r.getMessage()]


async def test_a_group_cut_for_room_is_said_in_one_line_and_counted(autojump_clock, caplog):
    """Rows too few for a batch's chains (a source of more chains a rollout than its run was
    sized for): each group left out is counted (`cut`), and the first is said in one warning
    line naming the task, the chains that did not fit and the rows."""
    engine = Engine()
    source = Scripted(engine, lambda task, label: Plan(tokens=40))  # one 42-token chain a row
    options = {"width": 64, "rows": 2, "groups": 2, "ahead": 0, "max_lag": 0}
    async with RolloutScheduler(OBJECTIVE, source, engine, **options) as sched:
        stream = sched.tasks(dataset(2, size=2)).stream(0)
        for updates in range(2):
            await sched.step(next(stream), PARAMS, updates)
            assert sched.last_record.cut == 1 and sched.last_record.groups == 1
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1, said  # the first cut, once
    assert "task '1'" in said[0] and "2 chains" in said[0] and "2 rows" in said[0]


# --- build point 4: errors in one line, the real cause first, before the run folder -------------


def refused(tmp_path, capsys, spec: str) -> str:
    """`dew train --env spec`'s one-line refusal; no run folder made."""
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        train(["--env", spec, "--run", str(run), *TINY, "--steps", "1"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and not run.exists()
    assert len(error.strip().splitlines()) == 2, error  # the line, and the pointer to --help
    return error.splitlines()[0]


def test_a_game_option_of_the_wrong_type_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    use_nltk_data(tmp_path, monkeypatch)
    line = refused(tmp_path, capsys, "textarena:Wordle-v0,num_guesses=abc")
    assert "num_guesses" in line and "'abc'" in line


def test_a_package_of_an_older_verifiers_api_is_named_with_the_api_dew_runs(tmp_path, capsys):
    line = refused(tmp_path, capsys, "verifiers:_vf_old_api")
    assert "'_vf_old_api'" in line and "verifiers.v1" in line and "__all__" in line


def test_an_environment_whose_own_import_fails_names_the_missing_module(tmp_path, capsys):
    line = refused(tmp_path, capsys, "verifiers:_vf_needs_dependency")
    assert "No module named 'dew_tests_missing_dependency'" in line
    assert "is not installed" not in line


def test_an_import_error_in_load_is_named_without_a_cache_hint(tmp_path, capsys):
    line = refused(tmp_path, capsys, "verifiers:_vf_load_raises")
    assert "No module named 'dew_tests_missing_scorer'" in line
    assert "Hugging Face" not in line


def test_a_first_prompt_past_the_context_leaves_no_run_folder_from_python(tmp_path):
    """`dew.train.train` checks the task's fit before it writes the run folder (it wrote
    `config.json`, then failed with a traceback)."""
    from dew.train import TrainConfig
    from dew.train import train as train_run

    config = TrainConfig(
        task="verifiers:_vf_lookup", tasks=4, eval_tasks=2, batch_size=2, max_context=200
    )
    with pytest.raises(ValueError, match=r"--max-context 200: task '0'"):
        train_run(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


# --- build point 7: honest records ---------------------------------------------------------------


class ByDuration:
    """A source whose rollout `sample` of a group takes `duration(sample)` seconds and scores
    its sample index: the first to finish is the quickest."""

    def __init__(self, duration):
        self.duration = duration

    async def run(self, task: Task, label: Label) -> Session:
        await trio.sleep(self.duration(label.sample))
        call = Call(np.array([1, 2], np.int32), np.array([3], np.int32), np.zeros(1, np.float32), 0)
        return Session(Status.COMPLETED, (call,), reward=float(label.sample))


async def kept_samples(source, *, seed: int, groups: int = 200, size: int = 4) -> list[int]:
    """The sample index `SampleLog` keeps of each of `groups` groups of `size` rollouts."""
    log = SampleLog(source, BYTES, batch_size=1, keep=1, seed=seed)
    async with trio.open_nursery() as nursery:
        for group in range(groups):
            for sample in range(size):
                nursery.start_soon(log.run, Task(str(group)), Label(group, sample, 0))
    return [log.take(group)[0]["sample"] for group in range(groups)]


async def test_samples_are_drawn_uniformly_within_a_group_and_replay_alike(autojump_clock):
    """samples.jsonl kept the first rollout of each group to finish, so it over-showed short
    episodes; each group's kept rollout is now drawn uniformly (seeded by group and sample), so
    the same draw whatever order the rollouts finish in."""
    quick_first = await kept_samples(ByDuration(lambda sample: 1 + sample), seed=0)
    counts = np.bincount(quick_first, minlength=4)
    assert counts.min() >= 30, counts  # each of the 4 about 50 times; first-to-finish: 200, 0..
    slow_first = await kept_samples(ByDuration(lambda sample: 4 - sample), seed=0)
    assert slow_first == quick_first
    assert await kept_samples(ByDuration(lambda sample: 1), seed=1) != quick_first


@pytest.mark.medium
async def test_errors_that_quote_each_reply_are_counted_as_one_kind_with_the_first_text(caplog):
    """`_vf_quote`'s reward raises quoting the reply, a text that differs every rollout: its
    errors are one kind (`TaskError / ValueError`), warned at its 1st and 10th time with that
    rollout's text, kept with the first full text (before: a line per rollout, 24 for 24)."""
    env = Verifiers.parse("_vf_quote", size=2)
    engine = ScriptedEngine([str(reply) for reply in range(24)])
    caplog.set_level(logging.WARNING, "dew.envs.verifiers")
    async with Gateway(engine, max_context=128, max_tokens=8, announce=False) as gateway:
        source = env.source(gateway)
        sessions = [await source.run(env.task(i % 2), Label(i, 0, 0)) for i in range(24)]
    assert len({s.error for s in sessions}) == 24
    first = "TaskError: task QuoteTask scoring: ValueError: cannot score the reply '0'"
    assert sessions[0].error == first
    assert source.errors.most_common(3) == ((first, 24),)
    said = [r.getMessage() for r in caplog.records if r.name == "dew.envs.verifiers"]
    assert len(said) == 2, said
    assert "1 rollouts" in said[0] and "10 rollouts" in said[1]
    assert "TaskError / ValueError" in said[1] and "reply '9'" in said[1]


# --- build point 5: tasks= taken from the environment --------------------------------------------


async def test_a_verifiers_source_finds_its_task_by_id_without_tasks_given():
    """A scheduler given no `tasks=` hands the source plain task ids (`task_ids`): the source of
    `Verifiers.source` takes each id's task from its environment (before, every rollout was
    AGENT_ERROR: 'NoneType' object has no attribute 'data')."""
    env = Verifiers.parse("_vf_copy,digits=3", size=2)
    digits = env.task(1).payload.data.digits
    async with Gateway(
        ScriptedEngine([digits]), max_context=128, max_tokens=8, announce=False
    ) as g:
        session = await env.source(g).run(Task("1"), Label(0, 0, 0))
    assert session.status is Status.COMPLETED, session.error
    assert session.components["copied"] == 1.0


async def test_a_task_id_outside_the_environment_is_named():
    env = Verifiers.parse("_vf_copy,digits=3", size=2)
    async with Gateway(ScriptedEngine(["1"]), max_context=128, max_tokens=8, announce=False) as g:
        with pytest.raises(ValueError, match=r"task id 7 is outside 0 \.\. 1"):
            await env.source(g).run(Task("7"), Label(0, 0, 0))
        with pytest.raises(ValueError, match=r"task 'x' carries no verifiers task"):
            await env.source(g).run(Task("x"), Label(0, 0, 0))


ENVIRONMENTS = Path(__file__).parents[1] / "docs" / "environments.md"
SNIPPETS = re.findall(
    r"^```python\n(.*?)^```$", ENVIRONMENTS.read_text(encoding="utf-8"), re.M | re.S
)


@pytest.mark.medium
def test_the_verifiers_snippet_of_the_docs_runs(capsys):
    """docs/environments.md's verifiers snippet, as written but for its taskset: the tests'
    `_vf_copy` stands for `my-taskset`."""
    (snippet,) = [s for s in SNIPPETS if "Verifiers.parse" in s]
    code = snippet.replace('"my-taskset"', '"_vf_copy"')
    with jax.numpy_dtype_promotion("standard"):  # as test_readme: a reader's promotion
        exec(compile(code, "docs/environments.md", "exec"), {"__name__": "docs"})
    assert capsys.readouterr().out.startswith("reward ")


def test_the_verifiers_loader_snippet_of_the_docs_builds_the_environment_parse_builds(capsys):
    """docs/environments.md's snippet of verifiers' own loader, as written but for its taskset:
    the environment it builds has the tasks `Verifiers.parse` gives."""
    (snippet,) = [s for s in SNIPPETS if "vf.load_environment" in s]
    scope = {"__name__": "docs"}
    exec(
        compile(snippet.replace('"my-taskset"', '"_vf_copy"'), "docs/environments.md", "exec"),
        scope,
    )
    assert capsys.readouterr().out == "4 tasks of _vf_copy\n"
    parsed = Verifiers.parse("_vf_copy", size=4)
    loaded = scope["env"]
    assert [vars(loaded.task(i).payload) for i in range(4)] == [
        vars(parsed.task(i).payload) for i in range(4)
    ]


@pytest.mark.medium
def test_the_textarena_snippet_of_the_docs_runs(capsys):
    """docs/environments.md's TextArena snippet, as written: a TicTacToe game, one step."""
    (snippet,) = [s for s in SNIPPETS if "TextArena.parse" in s]
    with jax.numpy_dtype_promotion("standard"):
        exec(compile(snippet, "docs/environments.md", "exec"), {"__name__": "docs"})
    assert capsys.readouterr().out.startswith("reward ")
