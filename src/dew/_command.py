"""The `dew` console command's entry point, light enough to run before the library loads.

Importing the library takes a second or two (JAX among it). A Ctrl-C pressed meanwhile, or in a
subcommand that does not handle it itself (`dew train` does: it stops after its step), ends the
command with one line and the shell's status for an interrupt, not a traceback.
"""

from __future__ import annotations

import signal
import sys

INTERRUPTED = 128 + signal.SIGINT
"""The exit status after a Ctrl-C: 128 + SIGINT, as a shell reports it (and `dew train`
returns when a Ctrl-C stops it after its step)."""


def main() -> int:
    """Run `dew` with the process's arguments; return the exit status."""
    try:
        from dew.cli import main as run

        status = run()
    except KeyboardInterrupt:
        print("dew: interrupted", file=sys.stderr, flush=True)
        status = INTERRUPTED
    if status == INTERRUPTED:
        # On its way out after a Ctrl-C, a later one would only interrupt the clean-up (and
        # print "Exception ignored in atexit callback").
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status
