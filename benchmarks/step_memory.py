"""The memory of one GRPO training step at a real vocabulary: whole logits, chunked, and remat.

Compiles (never runs) `GRPOObjective.update_fn(optax.adam)` for a Qwen2-0.5B-shaped model
(hidden 896, 14 heads over 2 key/value heads, 151,936-token vocabulary, tied head) over one
`[rows, width]` packed batch, and prints what XLA's buffer assignment reserves
(`compiled.memory_analysis()`): the arguments (params, Adam's two moments, the batch), the
scratch (activations, logits, gradients) and their sum, the step's peak, for three settings:

- whole: the model as a plain callable, so the objective scores the whole [rows, width, vocab]
  logits (every model before `logit_chunk`);
- chunked: `HFModel` as it is, scored `logit_chunk` positions at a time;
- chunked + remat: and each layer's activations recomputed in the backward pass.

No params are allocated (their shapes come from `jax.eval_shape`), so the figures are the
compiler's, for any machine, and the run takes only compilation time.

    python benchmarks/step_memory.py                     # 1 x 4096 and 8 x 512, 24 layers
    python benchmarks/step_memory.py --layers 4 --shapes 1x2048
    python benchmarks/step_memory.py --smoke             # a tiny model, for CI
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax

from dew.models import hf
from dew.objectives.rl.grpo import GRPOObjective

GIB = 2**30


def qwen2(layers: int, vocab: int, hidden: int = 896) -> hf.HFModel:
    """A Qwen2-0.5B-shaped model (its head tied to the embedding) of `layers` layers."""
    config = hf.HFConfig(
        "Qwen2ForCausalLM",
        vocab=vocab,
        hidden=hidden,
        intermediate=4864 * hidden // 896,
        layers=layers,
        heads=14,
        kv_heads=2,
        head_dim=hidden // 14,
        max_len=32768,
        qkv_bias=True,
        tied=True,
    )
    return hf.HFModel(config, "float32")


def batch_of(rows: int, width: int, vocab: int) -> dict[str, np.ndarray]:
    """One packed batch: each row a single chain over its whole width, every token trained."""
    rng = np.random.default_rng(0)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (rows, width)).copy()
    mask = (positions > 0).astype(np.float32)
    logprobs = np.where(mask > 0, np.float32(-3), np.float32(0)).astype(np.float32)
    return {
        "tokens": rng.integers(0, vocab, (rows, width)).astype(np.int32),
        "positions": positions,
        "segment_ids": np.ones((rows, width), np.int32),
        "loss_mask": mask,
        "advantages": rng.standard_normal((rows, width)).astype(np.float32),
        "behavior_logprobs": logprobs,
        "proximal_logprobs": logprobs,
    }


def whole(model):
    """The model as a plain callable: the objective scores its whole logits."""

    def logits(variables, tokens, positions, segment_ids):
        return model(variables, tokens, positions, segment_ids)

    return logits


def step_memory(model, objective_model, rows: int, width: int) -> dict[str, float]:
    """GiB the compiled update step reserves: arguments, scratch and their sum."""
    optimizer = optax.adam(1e-5)
    params = jax.eval_shape(model.init, jax.random.key(0))
    state = jax.eval_shape(optimizer.init, params)
    step = GRPOObjective(objective_model).update_fn(optimizer).update
    batch = batch_of(rows, width, model.vocab)
    # Abstract arrays are on no device: every leaf's layout is left to the compiler.
    layout = (None,) * len(jax.tree.leaves((params, state)))
    compiled = step.lower(params, state, batch, layout=layout).compile()
    memory = compiled.memory_analysis()
    arguments = memory.argument_size_in_bytes / GIB
    scratch = memory.temp_size_in_bytes / GIB
    return {"arguments": arguments, "scratch": scratch, "peak": arguments + scratch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2-0.5B: 24)")
    parser.add_argument(
        "--shapes", default="1x4096,8x512", help="the batches, ROWSxWIDTH, comma-separated"
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny model, for CI")
    args = parser.parse_args()
    vocab, hidden, layers = 151936, 896, args.layers
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    if args.smoke:
        vocab, hidden, layers, shapes = 4096, 56, 2, [(2, 128)]
    model = qwen2(layers, vocab, hidden)
    settings = {
        "whole": (model, whole(model)),
        "chunked": (model, model),
        "chunked + remat": (model.__class__(model.config, model.dtype, remat=True),) * 2,
    }
    print(
        f"Qwen2 shape: hidden {hidden}, {layers} layers, vocab {vocab}, float32, Adam; "
        f"GiB the compiled step reserves"
    )
    print(f"{'rows x width':>13} {'setting':>16} {'arguments':>10} {'scratch':>9} {'peak':>8}")
    for rows, width in shapes:
        logits = rows * width * vocab * 4 / GIB
        for name, (built, scored) in settings.items():
            figures = step_memory(built, scored, rows, width)
            print(
                f"{rows:>6} x {width:<5} {name:>16} {figures['arguments']:>10.3f} "
                f"{figures['scratch']:>9.3f} {figures['peak']:>8.3f}",
                flush=True,
            )
        print(f"{'':>13} {'(one logits array':>16} {'':>10} {logits:>9.3f})")


if __name__ == "__main__":
    main()
