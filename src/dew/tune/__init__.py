"""Choose the scheduler's knobs by their simulated figures on a calibrated workload: `dew tune`.

`tune` simulates every setting of a `Grid` — ahead, oversample, admit, sync_every, max_lag,
carry-over, the hedge and admit="auto"'s waste budget, each setting within max_lag's bound
(max_lag >= ahead + sync_every - 1) — over several seeds of one workload
(`dew.calibrate.Calibration.workload` fits one to recorded runs), and `front` keeps the settings
no other beats on both goodput and mean lag among those within a waste and a selection-bias
limit: the Pareto front a user picks from. `table` prints every setting's figures, `plot` draws
goodput against lag with the front marked.

The package is split by what each part does: `_grid` the grid and its simulation (`Grid`,
`Row`, `tune` and the engine's and trainer's scaling), `_report` what is made of the rows
(`front`, `best`, `table`, `plot`), `_calibration` the recorded runs read and fitted into the
workload `dew tune` simulates, and `_cli` the command's options. This module only re-exports.
"""

# The command's limits stay where tune.py kept them, as plain names of the module.
from dew.tune._cli import (  # noqa: F401
    MAX_RUNS,
    MAX_SLOTS,
    MAX_VALUES,
    PLOT_SUFFIXES,
    configure_cli,
    run_cli,
)
from dew.tune._grid import (
    Grid,
    Row,
    admitted,
    sized_to_ahead,
    sized_to_rows,
    timed_rows,
    tune,
)
from dew.tune._report import best, feasible, front, plot, table

__all__ = [
    "Grid",
    "Row",
    "admitted",
    "best",
    "configure_cli",
    "feasible",
    "front",
    "plot",
    "run_cli",
    "sized_to_ahead",
    "sized_to_rows",
    "table",
    "timed_rows",
    "tune",
]
