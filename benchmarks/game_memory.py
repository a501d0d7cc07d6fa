"""The TextArena games' memory at `dew train`'s defaults: peak RSS of the whole process beside
the estimate the run prints at its start.

Each game trains `--steps` steps of dew's default model in a `dew train` process of its own, so
that its peak resident memory (`ru_maxrss`, as `/usr/bin/time -v` reports it) is its own; the
table gives that peak, the estimate (`memory: about ... GiB`, whose formula and parts
docs/checkpoints.md states) and the seconds of each step (the first compiles). Wordle reads
nltk's `words` corpus and tagger: install them (`python -m nltk.downloader words
averaged_perceptron_tagger_eng`) or point `NLTK_DATA` at a folder that holds them.

    python benchmarks/game_memory.py                   # Wordle and ConnectFour self-play, 3 steps
    python benchmarks/game_memory.py --games wordle    # one of them
    python benchmarks/game_memory.py --smoke           # TicTacToe-v0, a tiny model, 1 step
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# The games at their documented defaults (docs/environments.md's table).
GAMES = {
    "wordle": ("Wordle-v0", ["--env", "textarena:Wordle-v0", "--max-tokens", "8"]),
    "connect-four": (
        "ConnectFour-v0, self-play",
        ["--env", "textarena:ConnectFour-v0,self_play=true"],
    ),
}
SMOKE = (
    "TicTacToe-v0 (tiny)",
    ["--env", "textarena:TicTacToe-v0", "--d-model", "16", "--heads", "2", "--layers", "1"]
    + ["--d-ff", "32", "--batch-size", "1", "--groups", "2", "--tasks", "4"],
)
# One `dew train` in the process, then the process's peak RSS in KiB on the last line.
CHILD = (
    "import resource, sys; from dew.cli import main; code = main(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)"
)


def measure(argv: list[str], steps: int) -> dict:
    """The estimate printed, the peak RSS (GiB) and the seconds of each step of one run."""
    with tempfile.TemporaryDirectory() as scratch:
        run = Path(scratch) / "run"
        command = ["train", *argv, "--steps", str(steps), "--run", str(run), "--eval-every", "0"]
        done = subprocess.run(
            [sys.executable, "-c", CHILD, *command], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"dew {' '.join(command)} failed:\n{done.stderr[-3000:]}")
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    estimate = re.search(r"^memory: about ([\d.]+) GiB", done.stdout, re.M).group(1)
    return {
        "estimate": float(estimate),
        "peak": int(done.stdout.strip().splitlines()[-1]) / 2**20,
        "seconds": [line["seconds/step"] for line in lines],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", nargs="+", choices=sorted(GAMES), default=sorted(GAMES)[::-1])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="TicTacToe-v0, tiny, 1 step")
    options = parser.parse_args()
    games = [SMOKE] if options.smoke else [GAMES[name] for name in options.games]
    steps = 1 if options.smoke else options.steps

    print("| game | estimate at start | peak RSS | s/step |")
    print("| --- | --- | --- | --- |")
    for name, argv in games:
        figures = measure(argv, steps)
        seconds = ", ".join(f"{s:.0f}" for s in figures["seconds"])
        print(
            f"| {name} | {figures['estimate']:.2f} GiB | {figures['peak']:.2f} GiB | {seconds} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
