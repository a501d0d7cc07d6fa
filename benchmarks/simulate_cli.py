"""How long `dew simulate` takes at its defaults, and where the time goes.

Runs `python -m dew simulate` in a fresh process, as a user types it, and prints its wall
seconds and its CPU seconds (user + system, from the child's `getrusage`). The command is one
thread: on an idle machine its wall time is about its CPU time, while on a shared one the wall
time also counts the others' work, so both are printed with the load average. Then the parts:
importing `dew.cli` in a fresh process (and, within it, JAX, which the scheduler's and the
engine's modules import though the simulation runs no JAX), each setting's simulation timed in
this process, and the heavy packages the command's process has loaded (torch and transformers
must not be among them).

    python benchmarks/simulate_cli.py            # the default table (7 settings, 30 steps)
    python benchmarks/simulate_cli.py --smoke    # dew simulate --smoke
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time

HEAVY = ("jax", "torch", "transformers")
LOADED = (
    "import sys; from dew.cli import main; main({argv}); "
    "print('loaded:', ' '.join(m for m in {heavy} if m in sys.modules) or 'none', file=sys.stderr)"
)


def run_command(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, the heavy packages loaded) of `dew` with `argv`, in a fresh
    process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", LOADED.format(argv=argv, heavy=HEAVY)],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    loaded = re.search(r"^loaded: (.*)$", done.stderr, re.M).group(1)
    return wall, cpu, loaded


def import_seconds() -> tuple[float, float]:
    """(seconds importing `dew.cli`, of them importing `jax`), by `python -X importtime` in a
    fresh process (cumulative microseconds of each top-level import)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import dew.cli"],
        capture_output=True,
        text=True,
        check=True,
    )
    cumulative = {}
    for line in done.stderr.splitlines():
        fields = line.removeprefix("import time:").split("|")
        if len(fields) == 3 and fields[1].strip().isdigit():
            cumulative.setdefault(fields[2].strip(), int(fields[1]))
    return cumulative["dew.cli"] / 1e6, cumulative.get("jax", 0) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="dew simulate --smoke")
    options = parser.parse_args()
    argv = ["simulate", "--smoke"] if options.smoke else ["simulate"]

    from dew import simulate

    wall, cpu, loaded = run_command(argv)
    imported, jax_seconds = import_seconds()
    workload = simulate.Workload.smoke() if options.smoke else simulate.Workload()
    settings = []
    for setting in simulate.settings(workload):
        start = time.process_time()
        simulate.simulate(workload, setting)
        settings.append((setting.name, time.process_time() - start))

    load = os.getloadavg()[0]
    print(f"dew {' '.join(argv)}  (load average {load:.1f} on {os.cpu_count()} CPUs)")
    print(f"{'part':38}{'seconds':>10}")
    print(f"{'the command, wall':38}{wall:>10.2f}")
    print(f"{'the command, CPU':38}{cpu:>10.2f}")
    print(f"{'import dew.cli (wall)':38}{imported:>10.2f}")
    print(f"{'  of it import jax (wall)':38}{jax_seconds:>10.2f}")
    for name, seconds in settings:
        print(f"{'  simulate ' + name:38}{seconds:>10.2f}")
    print(f"{'simulation, all settings (CPU)':38}{sum(s for _, s in settings):>10.2f}")
    print(f"heavy packages the command loaded: {loaded}")


if __name__ == "__main__":
    main()
