"""From recorded runs to the workload `dew tune` simulates: the traces read, fitted
(`dew.calibrate`) and checked for what the grid reads of them (`calibrated`), the waste budgets
their runs chose (`recorded_budgets`), and the recorded run's trainer step timed on this machine
(`time_trainer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dew import calibrate
from dew._checks import check_int, check_number
from dew.replay import Trace, read_trace
from dew.simulate import Contention, Workload


def calibrated(
    paths: Sequence[str],
    *,
    warmup: int,
    steps: int,
    seed: int,
    slots: int | str | None,
    contention: bool | Contention,
) -> tuple[list[Trace], calibrate.Calibration, Workload]:
    """The traces at `paths`, their fit past the first `warmup` calls, and the workload of
    `steps` trainer calls it predicts (`Calibration.workload`'s other arguments).

    Raises:
        OSError: for a trace that cannot be read.
        ValueError: naming the trace and what is wrong with it (`check_recorded`), or the
            traces whose every rollout took 0 s.
    """
    traces = [read_trace(path) for path in paths]
    fitted = calibrate.calibrate(traces, warmup=warmup)
    for trace in traces:
        check_recorded(trace, fitted.tasks, warmup)
    if not fitted.mean_duration > 0:
        raise ValueError(
            f"{', '.join(fitted.traces)}: every finished rollout took 0 s on the "
            "scheduler's clock: there is no rollout time to simulate"
        )
    workload = fitted.workload(steps=steps, seed=seed, slots=slots, contention=contention)
    return traces, fitted, workload


def check_recorded(trace: Trace, tasks: int, warmup: int) -> None:
    """Refuse a trace whose scheduler settings `tune` reads are out of bounds (a hand-edited
    or foreign trace: `read_trace` checks the config's names, not their values), or whose run
    admitted no group after its first `warmup` calls (every group failed or was discarded), of
    which every prediction would read 0 samples a second.

    Raises:
        ValueError: naming the trace and the field and its value, or the calls.
    """
    config = trace.config
    try:
        check_int("groups", config["groups"], low=1)
        check_int("ahead", config["ahead"], low=0)
        admit = config["admit"]
        whole = isinstance(admit, int) and not isinstance(admit, bool)
        if not (admit is None or admit == "auto" or (whole and 1 <= admit <= tasks)):
            raise ValueError(
                f"admit must be null, 'auto' or an int within [1, {tasks}], got {admit!r}"
            )
        if not isinstance(config["carry_over"], bool):
            raise ValueError(f"carry_over must be a bool, got {config['carry_over']!r}")
        check_number("waste_budget", config["waste_budget"], low=0, high=1, high_open=True)
    except ValueError as error:
        raise ValueError(f"{trace.path}: its config's {error}") from None
    delivered = [call for call in trace.calls if call.record is not None][warmup:]
    if not any(call.record.groups for call in delivered):
        raise ValueError(
            f"{trace.path}: its run admitted no group in its {len(delivered)} trainer calls "
            f"after the first {warmup} (every group failed or was discarded): there is no "
            "admitted work to predict"
        )


def recorded_budgets(traces: Sequence[Trace]) -> tuple[float, ...]:
    """The waste budgets of the traces whose run chose its own cut (admit "auto"), each
    once, in the traces' order: what `dew tune --admit auto` predicts at unless told."""
    budgets = (float(t.config["waste_budget"]) for t in traces if t.config["admit"] == "auto")
    return tuple(dict.fromkeys(budgets))


def time_trainer(run: str, workload: Workload, counts: Sequence[int]) -> dict[int, float]:
    """`dew.train.step_seconds` of the run in folder `run`, which must be of the traces' batch
    shape; imported only when asked for, since it builds the run's model.

    Raises:
        ValueError: naming the folder whose config is unreadable or of another batch shape, or
            whose run cannot be timed (`step_seconds`).
        ImportError, OSError: for a task or checkpoint of the run's that cannot be loaded here.
    """
    from dew.train import TrainConfig, step_seconds

    config = TrainConfig.from_file(Path(run) / "config.json")
    if (config.batch_size, config.groups) != (workload.tasks, workload.groups):
        raise ValueError(
            f"{run} trained {config.batch_size} tasks x {config.groups} rollouts a batch, the "
            f"traces {workload.tasks} x {workload.groups}: give the folder of the recorded run"
        )
    return step_seconds(run, counts)
