"""The built-in lookup agent trained through the recording gateway: its reward curve on the CPU.

Runs what `dew train --harness lookup` runs (`dew.train.train` with the task `harness:lookup`):
the agent (`dew.envs.lookup.LookupAgent`) is an ordinary `openai`-client program, which the
rollouts run against a gateway in front of the engine. Prints each step's mean reward and its
two parts (the lookup action, the answer), then the mean reward of the first 10 and the last 20
steps.

    python benchmarks/lookup_agent.py                 # 150 steps of dew train's defaults
    python benchmarks/lookup_agent.py --harness lookup-tools
    python benchmarks/lookup_agent.py --smoke         # 1 step of a tiny model, for CI

The smoke's model and batch have the shapes of tests/test_train_harness.py's run, so in a test
session one of them compiles the programs and the other reads them from JAX's cache.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from dew.train import TrainConfig, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="1 step of a tiny model, for CI")
    parser.add_argument("--harness", default="lookup", help="lookup or lookup-tools")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    options = {"task": f"harness:{args.harness}", "steps": args.steps, "seed": args.seed}
    options.update(learning_rate=1e-3)  # the rate docs/gateway.md's figures were measured at
    options.update(samples=0)  # the reward per step is printed here
    if args.smoke:
        options.update(steps=1, batch_size=2, groups=2, tasks=8)
        options.update(d_model=16, heads=2, layers=1, d_ff=32)
    config = TrainConfig(**options)
    print(f"dew train --harness {args.harness}: {config}", flush=True)
    rewards = []
    start = time.perf_counter()

    def on_step(line) -> None:
        rewards.append(line["reward/mean"])
        print(
            f"{time.perf_counter() - start:7.1f}s step {line['updates']:3d} reward "
            f"{line['reward/mean']:.4f} lookup {line.get('reward/lookup', 0.0):.4f} "
            f"answer {line.get('reward/answer', 0.0):.4f}",
            flush=True,
        )

    with tempfile.TemporaryDirectory() as run:
        train(config, run, on_step=on_step)
    first, last = rewards[:10], rewards[-20:]
    print(
        f"{args.harness}: {len(rewards)} steps in {time.perf_counter() - start:.0f}s; mean "
        f"reward of the first {len(first)} steps {sum(first) / len(first):.4f}, of the last "
        f"{len(last)} {sum(last) / len(last):.4f}"
    )


if __name__ == "__main__":
    main()
