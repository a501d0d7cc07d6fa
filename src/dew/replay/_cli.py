"""The `dew replay` command: replay a trace with overrides and say where it differs."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from dew._checks import int_option, number_option
from dew.objectives.rl.scheduler import (
    MAX_CELLS,
    MAX_IN_FLIGHT,
    MAX_SAMPLES,
    MAX_WIDTH,
    RolloutScheduler,
)
from dew.replay._format import CONFIG, TraceError
from dew.replay._replay import replay


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, or None for the text `none`."""

    def parse_or_none(text: str) -> Any:
        return None if text.lower() == "none" else parse(text)

    return parse_or_none


def _auto_or(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, or "auto" for the text `auto` (admit's own choice)."""

    def parse_or_auto(text: str) -> Any:
        return "auto" if text.lower() == "auto" else parse(text)

    return parse_or_auto


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(text)
    return text.lower() == "true"


_flag.__name__ = "true or false"


# Each override's parser, bounded: a typo of a few zeros would otherwise replay for hours or
# allocate terabytes before the scheduler found anything wrong. The scheduler checks the rest
# (rows x width within its cells, max_lag against ahead and sync_every, ...).
_OPTIONS: dict[str, Callable[[str], Any]] = {
    "width": int_option(1, MAX_WIDTH),
    "rows": int_option(1, MAX_CELLS),
    "groups": int_option(1, MAX_SAMPLES),
    "oversample": int_option(0, MAX_SAMPLES),
    "admit": _optional(_auto_or(int_option(1, MAX_IN_FLIGHT))),
    "max_lag": int_option(0, 10**6),
    "ahead": int_option(0, 64),
    "sync_every": int_option(1, 10**6),
    "max_attempts": int_option(1, 1000),
    "timeout": _optional(number_option(0, 10**7)),
    "estimator": str,
    "truncation": str,
    "support_capacity": _optional(int_option(1, MAX_CELLS)),
    "vocab": _optional(int_option(1, 2**31 - 1)),
    "empty_streak": _optional(int_option(1, 10**6)),
    "filter_uniform": _flag,
    "carry_over": _flag,
    "waste_budget": number_option(0, 1),
    "hedge": _flag,
    "narrow": _flag,
    "align_starts": _optional(int_option(1, 10**6)),
}


# Exit statuses: the replay matched the whole trace, it diverged, the trace cannot be read, or
# a cut-off trace (a killed run's) matched as far as it goes.
MATCHED, DIVERGED, UNREADABLE, MATCHED_CUT = 0, 1, 2, 3


class _Progress:
    """Prints how far a replay has got to standard error, at most once every `every` seconds of
    real time (0: after every call), so a long replay is seen to be working."""

    def __init__(self, every: float, out: TextIO | None = None):
        self.every = every
        self.out = sys.stderr if out is None else out
        self.last = time.monotonic()

    def __call__(self, replayed: int, total: int, seconds: float) -> None:
        now = time.monotonic()
        if now - self.last < self.every and replayed < total:
            return
        self.last = now
        print(
            f"dew replay: step {replayed}/{total} replayed, {seconds:.6g}s into the run",
            file=self.out,
            flush=True,
        )


def configure_cli(parser: argparse.ArgumentParser) -> None:
    """Add `dew replay`'s arguments to its parser: the trace, `--progress-every`, and one
    override per CONFIG name (`--max-lag 0`, `--timeout none`, ...)."""
    parser.add_argument(
        "trace", help="a trace written by `dew train --record` or a Recorder, plain or gzip"
    )
    parser.add_argument(
        "--progress-every",
        type=number_option(0, 86400),
        metavar="SECONDS",
        default=5.0,
        help="print how far the replay has got to standard error every SECONDS of real time "
        "(0: after every call) (default: 5)",
    )
    for name, kind in _OPTIONS.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=kind,
            default=argparse.SUPPRESS,
            help=f"replay with this {name} instead of the recorded one",
        )


def run_cli(args: argparse.Namespace) -> int:
    """`dew replay TRACE [--max-lag N ...]`: replay a trace and print whether it matched.

    Prints the steps, groups and events that matched, or the first divergence: step, group,
    sample, event, field, recorded and replayed values, and its time as seconds into the run;
    for a trace whose recording was cut off, where it ends. Progress goes to standard error.

    Returns:
        MATCHED (0) when the replay matched the whole trace, DIVERGED (1) when it diverged,
        UNREADABLE (2) when the trace cannot be read, MATCHED_CUT (3) when a cut-off trace (a
        killed run's) matched up to where it ends.

    Raises:
        SystemExit: with status 2, through the parser, for an override the scheduler refuses.
    """
    overrides = {name: getattr(args, name) for name in CONFIG if hasattr(args, name)}
    logger = logging.getLogger(RolloutScheduler.__module__)
    level = logger.level
    # The replayed scheduler's logs describe the replay, not the recorded run: its long-wait
    # warnings, and the tracebacks of failures after the first (a run made to part from its
    # recording by an override can return a recorded session before its version was pushed);
    # the divergence says where the two first part.
    logger.setLevel(logging.CRITICAL)
    try:
        result = replay(args.trace, progress=_Progress(args.progress_every), **overrides)
    except (TraceError, OSError) as error:
        print(f"dew replay: {error}", file=sys.stderr)
        return UNREADABLE
    except ValueError as error:
        args.parser.error(str(error))
    finally:
        logger.setLevel(level)
    print(result)
    if not result.matched:
        return DIVERGED
    return MATCHED if result.cut is None else MATCHED_CUT
