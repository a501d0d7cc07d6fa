"""`dew simulate` and `dew tune` at the long tail's levers' edges: knobs that would change
nothing are refused by name, and a figure undefined for a setting reads nan, never a made-up 0."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import trio
import trio.testing

from dew import cli, simulate, tune
from dew.envs.simulated import ObservedRollout, SimulatedConfig
from dew.objectives.rl.sessions import Status
from dew.testing import run_simulated


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """A 16-call trace of a simulated run at ahead 1 (4 tasks x 4 rollouts, a 3 s step)."""
    config = SimulatedConfig(seed=1, duration_mean=4.0, duration_sigma=0.5)
    return record(tmp_path_factory.mktemp("hostile") / "run.trace", config)


def record(path, config: SimulatedConfig, gap: float = 3.0):
    """A 16-call trace of a simulated run of `config` at ahead 1, the trainer's step `gap` s."""
    run = functools.partial(
        run_simulated,
        path,
        updates=range(16),
        config=config,
        batch_size=4,
        gap=gap,
        ahead=1,
        max_lag=1,
        width=512,
        rows=16,
        groups=4,
    )
    return trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def tune_cli(path, *options):
    return cli.main(
        ["tune", str(path), "--steps", "6", "--seeds", "1", "--ahead", "1"]
        + ["--sync-every", "1", *options]
    )


@pytest.mark.parametrize(
    "options", [["--carry-over"], ["--carry-over", "--admit", "all", "--hedge", "on,off"]]
)
def test_dew_tune_refuses_carry_over_with_no_admit_to_carry(trace, capsys, options):
    """It used to print the plain rows alone, no carry row and no word: the flag did nothing."""
    with pytest.raises(SystemExit) as exit:
        tune_cli(trace.path, *options)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        "dew tune: error: argument --carry-over: it carries the groups --admit cuts: give "
        "--admit a value other than all"
    )


def test_the_grid_refuses_knobs_that_add_no_row_by_their_own_name():
    """carry_over without an admit used to fail as "no setting ... max_lag", and hedge False
    without carry_over ran rows named as if hedged."""
    with pytest.raises(ValueError, match="carry_over True needs an admit value other than None"):
        tune.Grid(carry_over=(True,))
    with pytest.raises(ValueError, match="hedge False backs up no carried group's stragglers"):
        tune.Grid(admit=(3,), hedge=(True, False))
    assert tune.Grid(admit=(None, 3), carry_over=(True,)).settings(tasks=4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hedge": False}, "hedge backs up carried groups' stragglers: give carry_over too"),
        ({"admit": 3, "waste_budget": 0.1}, "waste_budget bounds the cut of admit='auto'"),
        ({"waste_budget": 0.1}, "got admit None with waste_budget 0.1"),
    ],
)
def test_a_setting_refuses_a_lever_that_changes_nothing(options, message):
    """As `dew train` refuses --no-hedge without --carry-over and --waste-budget without
    --admit auto: a row so named would report figures of a run it did not simulate."""
    with pytest.raises(ValueError, match=message):
        simulate.Setting("x", ahead=1, max_lag=3, **options)
    simulate.Setting("x", ahead=1, max_lag=3, admit="auto", carry_over=True, waste_budget=0.1)


def test_a_setting_that_admits_nothing_reads_nan_selection_not_a_warning():
    """Every rollout fails: nothing is admitted, and the selection over no rollout is nan
    (np.mean of nothing used to warn, an error under the test config)."""
    failing = (ObservedRollout(seconds=(), status=Status.INFRA_ERROR, failing=1.0),)
    workload = simulate.Workload(steps=3, slots=8, tasks=2, groups=2, step_time=1.0,
                                 observed=failing)  # fmt: skip
    outcome = simulate.simulate(workload, simulate.Setting("ahead=1", ahead=1, max_lag=1))
    assert outcome.admitted == 0 and outcome.wasted == 1.0
    assert outcome.selection != outcome.selection  # nan
    row = simulate.report(workload, [outcome]).splitlines()[2].split()
    assert row[0] == "ahead=1" and row[8] == "nan"  # after the waste and the slot waste


def test_dew_tune_with_no_capacity_bound_reads_nan_of_bound_not_zero(trace, capsys):
    """Unbounded slots and a 0 s step leave no bound: goodput over infinity used to read 0.0%."""
    assert tune_cli(trace.path, "--slots", "unbounded", "--step-time", "0") == 0
    row = next(
        line for line in capsys.readouterr().out.splitlines() if "ahead=1 sync=1 lag=1 " in line
    )
    assert row.split()[6] == "nan", row
    outcome = simulate.simulate(
        simulate.Workload(steps=3, slots=None, tasks=2, groups=2, step_time=0.0),
        simulate.Setting("ahead=1", ahead=1, max_lag=1),
    )
    assert outcome.bound == float("inf") and outcome.goodput > 0
    assert outcome.share != outcome.share  # nan


def refusal(capsys, path, *options) -> str:
    """The one line `dew tune` refuses the trace at `path` with, its exit status checked."""
    with pytest.raises(SystemExit) as exit:
        tune_cli(path, *options)
    assert exit.value.code == 2
    return capsys.readouterr().err.splitlines()[0]


@pytest.mark.parametrize(
    ("options", "culprit"),
    [
        (["--oversample", "0,2,0"], "--oversample: must list each value once, got '0' again in"),
        (["--admit", "all,all"], "--admit: must list each value once, got 'all' again in"),
        (["--admit", "auto,3,auto"], "--admit: must list each value once, got 'auto' again in"),
        (["--admit", "3,03"], "--admit: must list each value once, got '03' again in '3,03'"),
        (["--max-lag", "least,least"], "--max-lag: must list each value once, got 'least' again"),
        (["--sync-every", "2, 2"], "--sync-every: must list each value once, got '2' again in"),
    ],
)
def test_dew_tune_refuses_a_value_listed_twice_by_name(trace, capsys, options, culprit):
    """A value listed twice used to be dropped silently (the grid keeps one setting of each):
    a typo ('1,1' for '1,2') ran a grid other than the one meant, and said nothing."""
    assert f"dew tune: error: argument {culprit}" in refusal(capsys, trace.path, *options)


def test_dew_tune_names_the_words_a_knob_takes(trace, capsys):
    """'AUTO' used to be refused as not an int, as if 'all' and 'auto' were not values too."""
    assert refusal(capsys, trace.path, "--admit", "AUTO").endswith(
        "argument --admit: must be an int within [1, 4096] or one of 'all', 'auto', got 'AUTO'"
    )
    assert refusal(capsys, trace.path, "--max-lag", "1,most").endswith(
        "argument --max-lag: must be an int within [0, 10000] or one of 'least', got 'most'"
    )
    assert tune._cli._hedges("on, off") == (True, False)


def with_config(trace, folder, **changes):
    """A copy of `trace` whose header's scheduler config has `changes` (a hand-edited trace)."""
    lines = Path(trace.path).read_text(encoding="utf-8").split("\n")
    header = json.loads(lines[0])
    header["config"].update(changes)
    path = folder / "edited.trace"
    path.write_text("\n".join([json.dumps(header), *lines[1:]]), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("changes", "culprit"),
    [
        ({"groups": 0}, "groups must be an int >= 1, got 0"),
        ({"ahead": "one"}, "ahead must be an int >= 0, got 'one'"),
        ({"admit": 9}, "admit must be null, 'auto' or an int within [1, 4], got 9"),
        ({"admit": 2.0}, "admit must be null, 'auto' or an int within [1, 4], got 2.0"),
        ({"carry_over": "yes"}, "carry_over must be a bool, got 'yes'"),
        ({"admit": "auto", "waste_budget": 1.5}, "waste_budget must be within [0, 1), got 1.5"),
        ({"waste_budget": None}, "waste_budget must be within [0, 1), got None"),
    ],
)
def test_dew_tune_names_a_traces_config_out_of_bounds(trace, tmp_path, capsys, changes, culprit):
    """A hand-edited trace's settings used to reach sized_to_rows or the Workload and end in a
    traceback (ValueError: groups must be an int >= 1), or, as the budget, be taken as they
    were; the trace itself and the field are named now."""
    path = with_config(trace, tmp_path, **changes)
    line = refusal(capsys, path, "--engine-scaling", "1", "--trainer-scaling", "1")
    assert line == f"dew tune: error: argument TRACE: {path}: its config's {culprit}"


def test_dew_tune_refuses_an_empty_trace_by_name(tmp_path, capsys):
    empty = tmp_path / "empty.trace"
    empty.touch()
    assert refusal(capsys, empty).endswith(
        f"argument TRACE: {empty}:1: the file is empty, not a trace"
    )


def test_dew_tune_refuses_a_trace_whose_run_admitted_no_group(tmp_path, capsys):
    """Every rollout failed, so the run trained on nothing: the table used to read 0.00/s for
    every setting, star them on the front and call one the best goodput."""
    path = tmp_path / "failing.trace"
    record(path, SimulatedConfig(seed=1, duration_mean=4.0, infra_error=1.0))
    assert refusal(capsys, path) == (
        f"dew tune: error: argument TRACE: {path}: its run admitted no group in its 14 trainer "
        "calls after the first 2 (every group failed or was discarded): there is no admitted "
        "work to predict"
    )


def test_dew_tune_refuses_a_trace_whose_rollouts_took_no_time(tmp_path, capsys):
    """Rollouts that return at once under the recording's clock left 0 slots and a 0 s mean
    duration, which used to end in a traceback from the Workload's validators."""
    path = tmp_path / "instant.trace"
    instant = (ObservedRollout(seconds=(0.0,), status=Status.COMPLETED),)
    record(path, SimulatedConfig(seed=1, observed=instant), gap=0.0)
    for slots in ("observed", "unbounded"):
        assert refusal(capsys, path, "--slots", slots) == (
            f"dew tune: error: argument TRACE: {path}: every finished rollout took 0 s on the "
            "scheduler's clock: there is no rollout time to simulate"
        )


@pytest.mark.medium
def test_dew_tune_refuses_a_run_measured_over_no_time(tmp_path, capsys):
    """Rollouts of one duration, eight batches ahead and a free trainer: every measured batch
    is ready before the first measured step, the window lasts 0 s, and the goodput (samples
    over 0 s) used to end in a ZeroDivisionError."""
    path = tmp_path / "even.trace"
    even = (ObservedRollout(seconds=(1.0,), status=Status.COMPLETED),)
    record(path, SimulatedConfig(seed=1, observed=even))
    options = ["--steps", "4", "--ahead", "8", "--step-time", "0", "--slots", "unbounded"]
    assert refusal(capsys, path, *options) == (
        "dew tune: error: argument --step-time: ahead=8 sync=1 lag=8 (seed 0) trained its 2 "
        "measured steps in 0 s: every batch was ready before them and the trainer's steps take "
        "0 s, so its goodput is unbounded; give the trainer's steps some time"
    )
    assert tune_cli(path, "--steps", "4", "--ahead", "8", "--slots", "unbounded") == 0
