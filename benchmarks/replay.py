"""How much faster `dew replay` is than the run it replays, both timed as the commands they are.

Records `dew train` on its default task and settings (400 steps) with `--record`, then replays
the trace `--replays` times with `dew replay`, each a process of its own timed from its start to
its exit, as a user waits for it; the recorded run is timed the same way. Prints the run's
seconds, each replay's, and the ratio of the run's to each replay's, min/median/max (target
>= 10x). Every replay must match its recording.

A replay runs the scheduler itself, without the engine or the trainer: every rollout is
submitted, admitted and packed again on a mock clock that jumps from one recorded instant to the
next. Its time is the scheduler's own cost over every rollout of the run (see
`scheduler_overhead.py`), beside reading and checking the trace; the run's is that plus the
engine's and the trainer's. So the ratio falls as the engine gets faster.

    python benchmarks/replay.py              # the default 400-step run, 3 replays
    python benchmarks/replay.py --smoke      # 2 steps of a tiny model, 1 replay
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The tests' tiny model and batch (as what_if.py's and train_step.py's smokes and most of
# tests/): in a test session one run compiles its programs and the others read JAX's cache.
SMOKE = {
    "steps": 2,  # a push between them: the replay meets a second weight version
    "batch-size": 2,
    "groups": 2,
    "d-model": 16,
    "heads": 2,
    "layers": 1,
    "d-ff": 32,
}


def timed(command: list[str]) -> tuple[float, str]:
    """Seconds from the command's start to its exit, and its standard output.

    Raises:
        SystemExit: naming the command and its error when it fails.
    """
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return seconds, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=3, help="replays of the trace (3)")
    parser.add_argument("--smoke", action="store_true", help="2 steps of a tiny model")
    args = parser.parse_args()
    if args.replays < 1:
        parser.error(f"--replays must be at least 1, got {args.replays}")
    options = SMOKE if args.smoke else {}
    replays = 1 if args.smoke else args.replays
    dew = [sys.executable, "-m", "dew"]
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "run.trace"
        train = [*dew, "train", "--run", str(Path(folder) / "run"), "--record", str(trace)]
        train += [f"--{name}={value}" for name, value in options.items()]
        print(f"dew {' '.join(train[3:])}")
        run, _ = timed(train)
        print(f"  recorded run: {run:.2f} s")
        seconds = []
        for _ in range(replays):
            replayed, verdict = timed([*dew, "replay", str(trace)])
            if "replay matched" not in verdict:
                raise SystemExit(f"the replay did not match its recording:\n{verdict}")
            seconds.append(replayed)
            print(f"  dew replay:   {replayed:.2f} s  ({run / replayed:.1f}x)")
    ratios = sorted(run / s for s in seconds)
    print(
        f"replay against the run it replays: {ratios[0]:.1f}/{statistics.median(ratios):.1f}/"
        f"{ratios[-1]:.1f}x min/median/max (target >= 10x)"
    )


if __name__ == "__main__":
    main()
