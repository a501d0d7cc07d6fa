"""`dew simulate` and `dew tune` at the long tail's levers' edges: knobs that would change
nothing are refused by name, and a figure undefined for a setting reads nan, never a made-up 0."""

from __future__ import annotations

import functools

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
    run = functools.partial(
        run_simulated,
        tmp_path_factory.mktemp("hostile") / "run.trace",
        updates=range(16),
        config=SimulatedConfig(seed=1, duration_mean=4.0, duration_sigma=0.5),
        batch_size=4,
        gap=3.0,
        ahead=1,
        max_lag=1,
        width=512,
        rows=16,
        groups=4,
    )
    return trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def tune_cli(trace, *options):
    return cli.main(
        ["tune", str(trace.path), "--steps", "6", "--seeds", "1", "--ahead", "1"]
        + ["--sync-every", "1", *options]
    )


@pytest.mark.parametrize(
    "options", [["--carry-over"], ["--carry-over", "--admit", "all", "--hedge", "on,off"]]
)
def test_dew_tune_refuses_carry_over_with_no_admit_to_carry(trace, capsys, options):
    """It used to print the plain rows alone, no carry row and no word: the flag did nothing."""
    with pytest.raises(SystemExit) as exit:
        tune_cli(trace, *options)
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
    assert row[0] == "ahead=1" and row[7] == "nan"


def test_dew_tune_with_no_capacity_bound_reads_nan_of_bound_not_zero(trace, capsys):
    """Unbounded slots and a 0 s step leave no bound: goodput over infinity used to read 0.0%."""
    assert tune_cli(trace, "--slots", "unbounded", "--step-time", "0") == 0
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
