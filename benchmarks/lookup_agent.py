"""The built-in lookup agent trained through the recording gateway: reward per step on the CPU.

The agent (`dew.envs.lookup`) is an ordinary `openai`-client program; `ServedGateway` serves the
engine and the gateway in the scheduler's rollout thread, and `Trainer` drives the synchronous
facade, as `dew train --harness lookup` will. Prints each step's mean reward and its parts, and
the first and last five steps' means.

    python benchmarks/lookup_agent.py              # 40 steps of a 2-layer, 64-wide model
    python benchmarks/lookup_agent.py --smoke      # 2 steps of a tiny model, for CI
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import optax

from dew import models
from dew.envs import Sampling
from dew.envs.lookup import HARNESSES
from dew.gateway import ServedGateway
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.serve import RolloutServer
from dew.train import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 steps of a tiny model, for CI")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    shape = {"d_model": 64, "heads": 4, "layers": 2, "d_ff": 256}
    if args.smoke:
        args.steps, args.groups, args.batch_size = 2, 2, 2
        shape = {"d_model": 32, "heads": 2, "layers": 1, "d_ff": 64}
    harness = HARNESSES["lookup"]
    config = models.TransformerConfig(max_len=harness.max_len, **shape)
    params = models.init(jax.random.key(0), config)
    server = RolloutServer(config, params, slots=args.groups * args.batch_size)
    options = {
        "max_context": harness.max_len,
        "max_tokens": harness.max_tokens,
        "sampling": Sampling(seed=0),
        "announce": False,
    }
    source = ServedGateway(server, harness.source, options)
    objective = GRPOObjective(models.model(config))
    scheduler = RolloutScheduler(
        objective,
        source,
        server,
        width=harness.max_len,
        rows=args.groups * args.batch_size,
        groups=args.groups,
        ahead=0,
        truncation="score",
    )
    rewards = []
    start = time.perf_counter()

    def on_step(line) -> None:
        rewards.append(line["reward/mean"])
        print(
            f"{time.perf_counter() - start:7.1f}s step {line['updates']:3d} reward "
            f"{line['reward/mean']:.4f} format {line.get('reward/format', 0.0):.4f} "
            f"answer {line.get('reward/answer', 0.0):.3f}",
            flush=True,
        )

    with tempfile.TemporaryDirectory() as run:
        trainer = Trainer(objective, optax.adam(3e-3), params, directory=run, on_step=on_step)
        dataset = harness.dataset(batch_size=args.batch_size)
        try:
            trainer.run(scheduler, scheduler.tasks(dataset), steps=args.steps, ahead=0)
        finally:
            scheduler.close()
    window = min(5, len(rewards))
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    print(f"lookup agent: mean reward of the first {window} steps {first:.4f}, last {last:.4f}")


if __name__ == "__main__":
    main()
