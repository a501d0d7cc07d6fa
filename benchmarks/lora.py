"""Full fine-tuning against a LoRA adapter of the same checkpoint, side by side.

A random Qwen2 checkpoint of the shape asked for (transformers' `save_pretrained`, with the
tests' tokenizer and Qwen2.5's chat template) is trained by `dew train --model` twice, each in a
process of its own so that each peak RSS is its own: once every param, once `--lora`. For each
it prints the process's peak RSS, the seconds per step (the steps after the first, which
compiles), the bytes a push to an engine writes (the checkpoint folder's `model.safetensors`, or
the adapter's `adapter_model.safetensors`) and the seconds writing them takes, and the params,
adapter and optimizer state held.

    python benchmarks/lora.py                                # a small checkpoint, 3 steps
    python benchmarks/lora.py --hidden 896 --layers 24 --intermediate 4864 --heads 14 \\
        --kv-heads 2                                         # Qwen2-0.5B's shape
    python benchmarks/lora.py --smoke                        # a tiny checkpoint, 2 steps
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import jax

from dew.models import hf
from dew.models.hf import lora

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from _hf_folders import chat_checkpoint  # noqa: E402

# One `dew train` in this process, then its peak RSS on the last line.
CHILD = """
import json, resource, sys
import jax
from dew.cli import main
with jax.numpy_dtype_promotion("standard"):
    code = main(sys.argv[1:])
print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
sys.exit(code)
"""


def train(
    folder: pathlib.Path, run: pathlib.Path, steps: int, options: list[str], *, here: bool = False
) -> dict:
    """Peak RSS and seconds per step of one `dew train --model folder` process. `here`: in this
    process instead (`dew.cli.main`, its output dropped), as the smoke run trains the LoRA
    adapter: its peak is then this process's, and means nothing."""
    argv = ["train", "--model", str(folder), "--run", str(run), "--steps", str(steps)]
    argv += ["--batch-size", "2", "--groups", "4", "--tasks", "8", "--checkpoint-every", "1000"]
    if here:
        from dew.cli import main as dew

        with contextlib.redirect_stdout(io.StringIO()), jax.numpy_dtype_promotion("standard"):
            code = dew([*argv, *options])
        if code != 0:
            raise SystemExit(f"dew train {' '.join(options)} failed ({code})")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    else:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, *argv, *options],
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        if done.returncode != 0:
            raise SystemExit(f"dew train {' '.join(options)} failed:\n{done.stdout}\n{done.stderr}")
        peak = json.loads(done.stdout.strip().splitlines()[-1])["peak"]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    later = lines[1:] or lines

    def mean(key: str) -> float:
        return sum(line[key] for line in later) / len(later)

    return {
        "peak": peak,
        "step": mean("seconds/step"),
        "rollout": mean("seconds/rollout"),
        "update": mean("seconds/update"),
    }


def push(folder: pathlib.Path, scratch: pathlib.Path, config: lora.LoRAConfig) -> dict:
    """Bytes and seconds of writing what a push hands an engine: the full folder's tensors, or
    the adapter's (a fresh adapter: its size is its shape's)."""
    model, params = hf.load(folder)
    began = time.perf_counter()
    hf.save(scratch / "full", model, params)
    full_seconds = time.perf_counter() - began
    adapter = lora.init(jax.random.key(0), model, config)
    began = time.perf_counter()
    lora.save_adapter(scratch / "adapter", adapter, config)
    adapter_seconds = time.perf_counter() - began
    held = lora.footprint({"base": params, "adapter": adapter}, ())
    return {
        "full": ((scratch / "full" / hf.WEIGHTS).stat().st_size, full_seconds),
        "lora": ((scratch / "adapter" / lora.ADAPTER_WEIGHTS).stat().st_size, adapter_seconds),
        "params": held["base"],
        "adapter": held["adapter"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint, 2 steps")
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads = 64, 1, 128, 2, 1
        args.steps, args.rank = 2, 2
    shape = {
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": 256,
    }
    config = lora.LoRAConfig(rank=args.rank)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        folder = chat_checkpoint(scratch / "checkpoint", shape)
        pushed = push(folder, scratch, config)
        full = train(folder, scratch / "full-run", args.steps, [])
        # The smoke run trains the adapter in this process: the full tuning's process ran the
        # same code, and a second process would add only its start and imports.
        options = ["--lora", "--lora-rank", str(args.rank)]
        adapted = train(folder, scratch / "lora-run", args.steps, options, here=args.smoke)
    mib = 2**20
    print(f"checkpoint: {json.dumps(shape)}; LoRA rank {args.rank}, {', '.join(config.targets)}")
    print(f"{'':24}{'full':>14}{'LoRA':>14}")
    print(f"{'peak RSS':24}{full['peak'] / mib:>10.0f} MiB{adapted['peak'] / mib:>10.0f} MiB")
    for key in ("step", "rollout", "update"):
        print(f"{'seconds / ' + key:24}{full[key]:>14.3f}{adapted[key]:>14.3f}")
    print(
        f"{'push bytes':24}{pushed['full'][0] / mib:>10.2f} MiB{pushed['lora'][0] / mib:>10.2f} MiB"
    )
    print(f"{'push seconds (write)':24}{pushed['full'][1]:>14.4f}{pushed['lora'][1]:>14.4f}")
    print(
        f"{'trained params':24}{pushed['params'] / mib:>10.2f} MiB"
        f"{pushed['adapter'] / mib:>10.2f} MiB"
    )
    print(
        f"{'Adam state':24}{2 * pushed['params'] / mib:>10.2f} MiB"
        f"{2 * pushed['adapter'] / mib:>10.2f} MiB"
    )


if __name__ == "__main__":
    main()
