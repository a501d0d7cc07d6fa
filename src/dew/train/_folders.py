"""`dew train`'s paths, checked before anything is written: the run folder (new, or a run to
resume with the same config), the trace to record, and how a pool splits the batch."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from pathlib import Path

import attrs

from dew.envs.reasoning_gym import PREFIX
from dew.train._checkpoint import COMMIT, STATE, read_commit
from dew.train._config import _LOGGING, TrainConfig, _read_json
from dew.train._config_fields import HARNESS
from dew.train._trainer import METRICS, check_log_lengths


class RunInUse(ValueError):
    """Another run holds the run folder: a `dew train` into it, in this process or another,
    has not ended."""


BEST = Path("checkpoints") / "best"
"""Where `--keep-best` keeps the checkpoint of the run's best held-out greedy reward."""


class Misfit(ValueError):
    """A resumed run's checkpoint does not fit the model the run builds now: what it was
    built from (its `--model` folder, its task's lengths) changed since the run trained."""


class _RunLock:
    """The run folder, made if missing and held (an exclusive `flock` on it) until the context
    ends; the system lets it go when its holder dies, however it dies.

    Raises:
        RunInUse: naming the folder, when another holds it.
    """

    def __init__(self, run: Path):
        self.run = run
        self.descriptor: int | None = None

    def __enter__(self) -> _RunLock:
        self.run.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.run, os.O_RDONLY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise RunInUse(
                f"{self.run} is in use by another dew train that has not ended; wait for it, "
                "or stop it (Ctrl-C saves its checkpoint) and resume then"
            ) from None
        self.descriptor = descriptor
        return self

    def __exit__(self, *exc_info) -> None:
        if self.descriptor is not None:
            os.close(self.descriptor)  # lets the lock go
            self.descriptor = None


def _in_use(run: Path) -> bool:
    """Whether a `dew train` holds the folder `run` now (`_RunLock`'s exclusive lock): what it
    has written so far is a run in progress, which taking the lock refuses as such. A shared
    lock asks, so the processes of a pool asking at once do not find each other."""
    descriptor = os.open(run, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)  # lets the shared lock go
    return False


def _check_split(config: TrainConfig, processes: int) -> None:
    """Refuse a batch that the pool's processes cannot share evenly."""
    if config.batch_size % processes:
        raise ValueError(
            f"batch_size {config.batch_size} must split evenly over the {processes} processes"
        )
    if isinstance(config.admit, int) and config.admit % processes:
        raise ValueError(f"admit {config.admit} must split evenly over the {processes} processes")
    urls = config.engine_url
    if urls is not None and processes > 1 and len(urls) % processes:
        raise ValueError(
            f"--engine-url: each of the {processes} processes pushes to servers of its own, "
            f"so the {len(urls)} URLs must split evenly over them"
        )


# The most of a log read at once: a metrics line is a few KiB.
_TAIL = 2**20

# Where a run's arrays live and what it keeps for the backward pass, not what it computes: a run
# resumes onto another mesh (or one device), its checkpoint's shards restored onto the new
# placement, and with or without --remat, which changes its memory, not its updates.
_PLACEMENT = ("mesh", "remat")


def _check_run(config: TrainConfig, run: Path, *, resume: bool) -> None:
    """Refuse a run folder that cannot be written, or that would mix two runs.

    Raises:
        ValueError: when `run` cannot be made or written (`_check_run_folder`), holds a run and
            `resume` is not set, holds a run's history but no commit record to resume it from
            (`_history`), or holds a run of a config that differs from `config` in more than
            its logging (`steps`, ...) and its mesh.
    """
    _check_run_folder(run)
    committed = (run / "checkpoints" / COMMIT).exists()
    history = [] if resume and committed else _history(run)  # read only where it is needed
    previous = _run_config(run) if resume else None
    if previous is not None:
        changed = _differences(previous, config)
        if changed:
            values = "; ".join(
                f"--{name.replace('_', '-')} {_shown(getattr(previous, name))}, "
                f"not {_shown(getattr(config, name))}"
                for name in changed
            )
            raise ValueError(
                f"{run} was trained with other {', '.join(changed)}: {values} (a resumed run "
                f"keeps its config; only {_free()} may change)"
            )
    if resume and config.keep_best:
        _best_greedy(run / BEST)  # a best checkpoint that holds no evaluation is refused
    if resume and history and not committed and not _in_use(run):
        # Resuming from nothing would train from the first step over the logs and remove the
        # arrays at its first checkpoint.
        raise ValueError(
            f"--resume: {run} holds a run's {', '.join(history)} but no commit record "
            f"(checkpoints/{COMMIT}) to resume it from, and training from the first step would "
            "overwrite them; start afresh with another --run (or move them away first)"
        )
    if not resume and (history or committed):
        what = ", ".join(history) or f"checkpoints/{COMMIT}"
        raise ValueError(
            f"{run} already holds a run ({what}); continue it with --resume, or start afresh "
            "with another --run"
        )
    if resume:
        _check_resumable(config, run)


def _run_config(run: Path) -> TrainConfig | None:
    """The config the run in `run` was trained with, from one place: its checkpoint, whose
    commit record keeps it, which `config.json` must agree with but for what a resumed run may
    change (an edited file is refused as an edited option is); `config.json` alone for a run
    without a checkpoint (or one written before checkpoints kept it), and the checkpoint's
    alone when `config.json` is gone. None when there is neither.

    Raises:
        ValueError: naming `config.json`, each field that differs and both values, when the file
            was edited since the checkpoint; naming it when it is gone and the checkpoint keeps
            no config; naming the file that does not read.
    """
    saved = run / "config.json"
    on_file = TrainConfig.from_json(_read_json(saved), where=str(saved)) if saved.exists() else None
    commit = run / "checkpoints" / COMMIT
    try:
        kept = json.loads(commit.read_text())["metadata"]["config"]
    except (OSError, ValueError, TypeError, KeyError):
        if on_file is None and commit.exists():
            # Built from the defaults instead, the run would not fit its own checkpoint.
            raise ValueError(
                f"{saved} is gone, and {commit} keeps no config to resume the run with (it "
                "was written before checkpoints kept one, or is damaged); restore config.json"
            ) from None
        return on_file  # no checkpoint, or one that does not read (`read_commit` names why)
    trained = TrainConfig.from_json(kept, where=f"{commit}'s config")
    if on_file is None:
        return trained
    edited = _differences(trained, on_file)
    if edited:
        values = "; ".join(
            f"{name} {_shown(getattr(on_file, name))}, not {_shown(getattr(trained, name))}"
            for name in edited
        )
        raise ValueError(
            f"{saved} was edited since its checkpoint ({commit}): {values} as trained; restore "
            f"it (a resumed run keeps its config; only {_free()} may change, given as options)"
        )
    return on_file


def _differences(previous: TrainConfig, config: TrainConfig) -> list[str]:
    """The fields a resumed run may not change in which `config` differs from `previous`."""
    return [
        field.name
        for field in attrs.fields(TrainConfig)
        if field.name not in _LOGGING + _PLACEMENT
        and getattr(previous, field.name) != getattr(config, field.name)
    ]


def _free() -> str:
    """The options a resumed run may change, as the command line names them."""
    return ", ".join(f"--{name.replace('_', '-')}" for name in _LOGGING + _PLACEMENT)


def _shown(value: object) -> str:
    """An option's value as the command line gives it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        return " ".join(map(str, value))
    return str(value)


def _check_resumable(config: TrainConfig, run: Path) -> None:
    """Refuse to resume a run for fewer steps than its checkpoint has trained (it would do
    nothing, and say it had), whose logs were cut short since the checkpoint (resuming would
    pad them back to its length with NUL bytes), or whose commit record's `updates` was edited
    (`_check_updates`). A commit record that does not read is left to `read_commit`, which
    names what is wrong with it."""
    try:
        record = json.loads((run / "checkpoints" / COMMIT).read_text())
        updates = int(record["updates"])
        metadata = dict(record["metadata"])
    except (OSError, ValueError, TypeError, KeyError):
        return
    if config.steps < updates:
        raise ValueError(
            f"--steps {config.steps}: {run} has trained {updates} steps already; give more "
            f"to extend it"
        )
    check_log_lengths(run, metadata)
    _check_updates(run, record, updates)


def _check_updates(run: Path, record: dict, updates: int) -> None:
    """Refuse a commit record whose `updates` is not the step of what it goes with: the arrays
    it names (`state-UPDATES-...`) and the last line of the metrics log it keeps. A record
    edited by hand resumed at its step with another step's weights and data position, and
    logged the steps between twice."""
    commit = run / "checkpoints" / COMMIT
    named = str(record.get("arrays", ""))
    stamp = named.removeprefix(STATE)[:8]
    if named.startswith(STATE) and stamp.isdigit() and int(stamp) != updates:
        raise ValueError(
            f"{commit} says updates {updates}, but the arrays it names, {named}, are those of "
            f"updates {int(stamp)}: the record was edited; restore it (a resumed run must not "
            "train or log a step twice)"
        )
    kept = record["metadata"].get("metrics_bytes")
    if not isinstance(kept, int) or kept <= 0:
        return
    with open(run / METRICS, "rb") as log:  # as long as `kept` at least: check_log_lengths
        log.seek(max(0, kept - _TAIL))
        last = log.read(min(kept, _TAIL)).rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        logged = json.loads(last)["updates"]
    except (ValueError, TypeError, KeyError):
        return  # a line of another shape: the record is not what it is checked against
    if logged != updates:
        raise ValueError(
            f"{commit} says updates {updates}, but the last line of {run / METRICS} it goes "
            f"with is of updates {logged}: the record was edited; restore it (a resumed run "
            "must not train or log a step twice)"
        )


def _history(run: Path) -> list[str]:
    """What of a run's history `run` holds, each as a line names it: its logs that are not
    empty (`metrics.jsonl`, `samples.jsonl`, `eval.jsonl`: a run's logs are JSON lines), with
    their lines, and its checkpoint's arrays. A run that starts afresh there cuts the logs and,
    at its first checkpoint, removes the arrays.

    A run refused or stopped before its first step (a full disk, a bad task) leaves only its
    config behind, which is no history: it must not block the run that follows, which
    replaces it.
    """
    logs = sorted(path for path in run.glob("*.jsonl") if path.is_file())
    held = [f"{path.name} ({_lines(path)} lines)" for path in logs if path.stat().st_size > 0]
    checkpoints = run / "checkpoints"
    if checkpoints.is_dir():
        held += [
            f"checkpoints/{path.name}"
            for path in sorted(checkpoints.iterdir())
            if path.name.startswith(STATE)
        ]
    return held


def _lines(path: Path) -> int:
    """How many lines a log holds (a last one cut short counts), read a MiB at a time: a long
    run's metrics log is hundreds of them."""
    lines, last = 0, b"\n"
    with open(path, "rb") as log:
        while chunk := log.read(_TAIL):
            lines, last = lines + chunk.count(b"\n"), chunk[-1:]
    return lines + (last != b"\n")


def _check_run_folder(run: Path) -> None:
    """Refuse a run folder that cannot be made or written, before anything is: a file, a path
    through a file, or one whose nearest existing folder refuses a new entry (unwritable, or a
    file system such as /proc that takes none) would otherwise fail after other files were
    written, or with a traceback.

    Raises:
        ValueError: naming the path and what is wrong with it.
    """
    if run.exists() and not run.is_dir():
        raise ValueError(f"--run {run} is a file, not a folder")
    folder = _nearest_existing(run)
    if not folder.is_dir():
        raise ValueError(f"--run {run}: {folder} is a file, not a folder")
    _probe(folder, f"--run {run}", directory=True)


def _nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (a relative path ends at `.`)."""
    return next((p for p in (path, *path.parents) if p.exists()), Path("."))


def _probe(folder: Path, option: str, *, directory: bool) -> None:
    """Refuse `folder` unless a folder (`directory`) or a file can be made in it, by making a
    hidden one and removing it: permission bits alone do not say (root passes every check, and
    /proc refuses root too).

    Raises:
        ValueError: naming `option` and the folder, with the system's reason.
    """
    try:
        if directory:
            tempfile.TemporaryDirectory(dir=folder, prefix=".dew-probe-").cleanup()
        else:
            tempfile.TemporaryFile(dir=folder, prefix=".dew-probe-").close()
    except OSError as error:
        raise ValueError(
            f"{option}: nothing can be written in {folder} ({error.strerror or error})"
        ) from None


def _check_record(record: str | os.PathLike) -> None:
    """Refuse a trace path before anything is written: a trace is one run's, written whole, so
    an existing file (a resumed run's earlier trace, say) would be silently overwritten, and a
    folder or a missing or unwritable parent would fail after the run folder was written.

    Raises:
        ValueError: naming the path and what is wrong with it.
    """
    path = Path(record)
    if path.is_dir():
        raise ValueError(f"--record {path} is a folder; give the trace's file name")
    if path.exists():
        raise ValueError(
            f"--record {path} already exists and would be overwritten; record to a new file "
            "(a resumed run records a trace of its own)"
        )
    folder = _nearest_existing(path.parent)
    if not folder.is_dir():
        raise ValueError(f"--record {path}: {folder} is a file, not a folder")
    if folder != path.parent:
        raise ValueError(f"--record {path}: the folder {path.parent} does not exist")
    _probe(folder, f"--record {path}", directory=False)


def _default_run(task: str) -> Path:
    # A reasoning-gym task names the folder by its dataset, without its options.
    name = task.removeprefix(PREFIX).removeprefix(HARNESS).split(",")[0]
    name = name.rsplit(":", 1)[-1]  # verifiers:NAME, textarena:GAME
    return Path("dew-runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _best_greedy(best: Path) -> float | None:
    """The greedy held-out reward of the checkpoint in `best` (its record's `eval`), or None
    where there is none yet."""
    record = read_commit(best)
    if record is None:
        return None
    try:
        return float(record["metadata"]["eval"]["greedy"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{best / COMMIT} holds no evaluation (metadata eval greedy): not a --keep-best "
            "checkpoint; move it away"
        ) from None
