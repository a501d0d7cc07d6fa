"""The `dew replay` command: replay a trace with overrides and say where it differs."""

from __future__ import annotations

import argparse
import logging
import sys

from dew.objectives.rl.scheduler import RolloutScheduler
from dew.replay._format import CONFIG, TraceError
from dew.replay._replay import replay


def _optional(kind: type):
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = f"{kind.__name__} or none"
    return parse


_OPTIONS = {
    "width": int,
    "rows": int,
    "groups": int,
    "oversample": int,
    "admit": _optional(int),
    "max_lag": int,
    "ahead": int,
    "sync_every": int,
    "max_attempts": int,
    "timeout": _optional(float),
    "estimator": str,
    "truncation": str,
    "support_capacity": _optional(int),
}


def configure_cli(parser: argparse.ArgumentParser) -> None:
    """Add `dew replay`'s arguments to its parser: the trace, and one override per CONFIG
    name (`--max-lag 0`, `--timeout none`, ...)."""
    parser.add_argument("trace", help="a trace written by dew.replay.Recorder")
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
    sample, event, field, recorded and replayed values.

    Returns:
        0 when the replay matched, 1 when it diverged, 2 when the trace cannot be read.

    Raises:
        SystemExit: with status 2, through the parser, for an override the scheduler refuses.
    """
    overrides = {name: getattr(args, name) for name in CONFIG if hasattr(args, name)}
    logger = logging.getLogger(RolloutScheduler.__module__)
    level = logger.level
    # The replayed scheduler's long-wait warnings describe the replay, not the recorded run.
    logger.setLevel(logging.ERROR)
    try:
        result = replay(args.trace, **overrides)
    except (TraceError, OSError) as error:
        print(f"dew replay: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        args.parser.error(str(error))
    finally:
        logger.setLevel(level)
    print(result)
    return 0 if result.matched else 1
