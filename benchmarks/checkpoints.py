"""Loading a checkpoint folder: the host's peak memory against the params' bytes, and the time of
one training step of the loaded model.

Writes a random checkpoint of Qwen2.5-0.5B's shape (494 M params: vocab 151936, hidden 896,
24 layers, 14 query and 2 key/value heads, tied embeddings) into a temporary folder, tensor by
tensor with dew's safetensors writer (transformers is not needed, nor the time it takes), then
loads it with `dew.models.hf.load` in a fresh process that reports its resident memory before
loading and its peak during it (`ru_maxrss`). Streaming tensor by tensor, the peak above the
baseline is the params plus about one tensor (the embedding, the largest); a loader that held
the file's tensors and then the converted params would show twice the params.

The same process then times one GRPO training step (`GRPOObjective.update_fn`, Adam) of the
loaded model on packed rows of random tokens: the first call (compiling) and the next.

    python benchmarks/checkpoints.py [--smoke] [--dtype float32|bfloat16] [--rows N --width W]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

QWEN_05B = {
    "architecture": "Qwen2ForCausalLM",
    "vocab": 151936,
    "hidden": 896,
    "intermediate": 4864,
    "layers": 24,
    "heads": 14,
    "kv_heads": 2,
    "head_dim": 64,
    "max_len": 32768,
    "rope_theta": 1000000.0,
    "qkv_bias": True,
    "tied": True,
}
SMOKE = {**QWEN_05B, "vocab": 512, "hidden": 64, "intermediate": 128, "layers": 1, "heads": 4}
SMOKE["head_dim"] = 16


def write_checkpoint(folder: Path, shape: dict, dtype: str) -> int:
    """A random checkpoint of `shape` in `folder`, each tensor drawn as it is written; returns
    the params' count."""
    import jax.numpy as jnp
    import ml_dtypes

    from dew.models import hf
    from dew.models.hf import _params

    model = hf.HFModel(hf.HFConfig(**shape), dtype=dtype)
    rng = np.random.default_rng(0)
    stored = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    leaves = list(_params.leaves(model.config))

    def tensors():
        for leaf in leaves:
            values = rng.standard_normal(leaf.tensor_shape, np.float32) * np.float32(0.02)
            if leaf.entry.kind == "ones":
                values += np.float32(1)
            yield leaf.name, values.astype(stored)

    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_json(dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    hf._write_safetensors(folder / hf.WEIGHTS, tensors(), model)
    del jnp
    return sum(int(np.prod(leaf.tensor_shape)) for leaf in leaves)


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def load_and_step(folder: str, rows: int, width: int, *, step: bool = True) -> dict:
    """In this (fresh) process: load `folder`, measuring memory; then time a training step."""
    import jax
    import jax.numpy as jnp
    import optax

    from dew.models import hf
    from dew.objectives.rl.grpo import GRPOObjective

    jnp.zeros(1).block_until_ready()  # the backend started before the baseline
    baseline = resident_bytes()
    started = time.perf_counter()
    model, params = hf.load(folder)
    jax.block_until_ready(params)
    loaded = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    figures = {
        "params": sum(leaf.size for leaf in jax.tree.leaves(params)),
        "dtype": model.dtype,
        "params_bytes": params_bytes,
        "baseline_bytes": baseline,
        "peak_bytes": peak,
        "load_seconds": loaded,
    }
    if not step:
        return figures
    rng = np.random.default_rng(1)
    half = width // 2
    batch = {
        "tokens": rng.integers(0, model.vocab, (rows, width)).astype(np.int32),
        "positions": np.tile(
            np.concatenate([np.arange(half), np.arange(width - half)]), (rows, 1)
        ).astype(np.int32),
        "segment_ids": np.tile(np.repeat([1, 2], [half, width - half]), (rows, 1)).astype(np.int32),
    }
    trained = (batch["positions"] > 0).astype(np.float32)
    batch["loss_mask"] = trained
    batch["advantages"] = rng.standard_normal((rows, width)).astype(np.float32) * trained
    # A random model's log-probs are near a uniform draw's.
    uniform = -np.log(np.float32(model.vocab))
    batch["behavior_logprobs"] = np.full((rows, width), uniform, np.float32) * trained
    batch["proximal_logprobs"] = batch["behavior_logprobs"]
    optimizer = optax.adam(1e-5)
    update = GRPOObjective(model).update_fn(optimizer)
    opt_state = optimizer.init(params)
    for name in ("first_step_seconds", "step_seconds"):
        started = time.perf_counter()
        params, opt_state, metrics = update(params, opt_state, batch)
        jax.block_until_ready((params, metrics))
        figures[name] = time.perf_counter() - started
    figures["tokens"] = rows * width
    figures["loss"] = float(metrics["loss"])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint, for CI")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rows", type=int, default=2, help="packed rows of the step's batch")
    parser.add_argument("--width", type=int, default=256, help="tokens a packed row")
    parser.add_argument(
        "--no-step", dest="step", action="store_false", help="measure the loading only"
    )
    parser.add_argument("--load", metavar="FOLDER", help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    for name in ("rows", "width"):
        if getattr(args, name) < 2:
            parser.error(f"--{name} must be >= 2, got {getattr(args, name)}")
    if args.load is not None:
        print(json.dumps(load_and_step(args.load, args.rows, args.width, step=args.step)))
        return
    shape = SMOKE if args.smoke else QWEN_05B
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "checkpoint"
        started = time.perf_counter()
        count = write_checkpoint(folder, shape, args.dtype)
        written = time.perf_counter() - started
        child = [sys.executable, __file__, "--load", str(folder)]
        child += ["--rows", str(args.rows), "--width", str(args.width)]
        child += [] if args.step else ["--no-step"]
        done = subprocess.run(child, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"the loading process failed:\n{done.stderr[-3000:]}")
        figures = json.loads(done.stdout.strip().splitlines()[-1])
    gib = 2**30
    above = figures["peak_bytes"] - figures["baseline_bytes"]
    print(
        f"{shape['architecture']} of {count / 1e6:.1f} M params, {figures['dtype']}: "
        f"{figures['params_bytes'] / gib:.3f} GiB of params (written in {written:.1f}s)"
    )
    baseline, peak = figures["baseline_bytes"] / gib, figures["peak_bytes"] / gib
    print(
        f"load: {figures['load_seconds']:.1f}s; resident before {baseline:.3f} GiB, peak "
        f"{peak:.3f} GiB: {above / gib:.3f} GiB above, {above / figures['params_bytes']:.2f} x "
        "the params' bytes"
    )
    if not args.step:
        return
    print(
        f"one GRPO step (Adam) on {figures['tokens']} tokens ({args.rows} rows x {args.width}): "
        f"{figures['first_step_seconds']:.1f}s compiling and stepping, then "
        f"{figures['step_seconds']:.2f}s a step; loss {figures['loss']:.4f}"
    )


if __name__ == "__main__":
    main()
