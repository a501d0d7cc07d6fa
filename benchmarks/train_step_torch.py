"""One GRPO training step of a Qwen2-0.5B-shaped checkpoint on the CPU: dew (JAX) against
transformers + torch, in one run, float32 and bfloat16.

A random checkpoint of Qwen2.5-0.5B's shape (hidden 896, 14 heads over 2 key/value heads,
MLP 4864, a 151,936-token vocabulary, the head tied to the embedding) is written by
transformers (random weights, nothing downloaded), with `--layers` of its 24 decoder layers (the
embedding, 136 M of its 494 M params, is whole either way). Both sides load that folder and
train on the same tokens: `--rows` rows of `--width` tokens, one chain a row (a causal mask is
then the packed mask on both sides), every token after the first trained.

A step is one forward pass, the decoupled PPO loss (token mean, clip 0.2, importance cap 5) and
its backward pass, and one Adam update: dew's `GRPOObjective.update_fn(optax.adam, donate=True)`
(the trainer's step, which updates the weights and moments in their own buffers), and the same
loss written in torch over `AutoModelForCausalLM`'s logits with `torch.optim.Adam`. The
rescoring is the forward pass alone, to each token's log-prob: dew's `packed_log_probs`, torch's
forward under `no_grad` and a log-softmax. Each is run once untimed (dew compiles there: its time
is reported apart), then `--repeats` times, keeping the mean; dew / torch is the ratio of the
steady-state seconds.

    python benchmarks/train_step_torch.py                # 4 layers, 2 x 256 tokens
    python benchmarks/train_step_torch.py --layers 24 --rows 8 --width 512
    python benchmarks/train_step_torch.py --smoke        # a tiny model in bfloat16, for CI
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax

from dew._torch_media import hide_broken_media_packages
from dew.models import hf
from dew.objectives.rl.grpo import GRPOObjective

CLIP, CAP = 0.2, 5.0
QWEN2_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
SMOKE = QWEN2_05B | {"vocab_size": 512, "hidden_size": 56, "intermediate_size": 112}


def write_checkpoint(folder: Path, shape: dict, layers: int) -> Path:
    """A random float32 Qwen2 checkpoint of `shape` with `layers` layers, by transformers."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**shape, num_hidden_layers=layers, dtype="float32")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def batch_of(rows: int, width: int, vocab: int) -> dict[str, np.ndarray]:
    """One chain a row, every token after the first trained, log-probs near a uniform guess."""
    rng = np.random.default_rng(0)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (rows, width)).copy()
    mask = (positions > 0).astype(np.float32)
    guess = np.float32(-np.log(vocab))
    proximal = (guess + 0.1 * rng.standard_normal((rows, width))).astype(np.float32) * mask
    return {
        "tokens": rng.integers(0, vocab, (rows, width)).astype(np.int32),
        "positions": positions,
        "segment_ids": np.ones((rows, width), np.int32),
        "loss_mask": mask,
        "advantages": rng.standard_normal((rows, width)).astype(np.float32),
        "proximal_logprobs": proximal,
        "behavior_logprobs": (proximal + 0.1 * rng.standard_normal((rows, width)) * mask).astype(
            np.float32
        ),
    }


def timed(run, repeats: int) -> tuple[float, float]:
    """Seconds of the first call (a compile, for dew) and the mean of `repeats` more."""
    began = time.perf_counter()
    run()
    first = time.perf_counter() - began
    began = time.perf_counter()
    for _ in range(repeats):
        run()
    return first, (time.perf_counter() - began) / repeats


def dew_side(folder: Path, dtype: str, batch: dict, repeats: int) -> dict[str, tuple]:
    """dew's step and rescoring of the checkpoint in `dtype`: (first, steady) seconds each."""
    model, params = hf.load(folder, dtype=dtype)
    objective = GRPOObjective(model, clip=CLIP, importance_cap=CAP)
    optimizer = optax.adam(1e-5)
    state = {"params": params, "opt": optimizer.init(params)}
    # Donating, as dew's trainer steps: the update writes the new weights and moments into the
    # old ones' buffers, as torch's Adam does in place (without it Adam alone took 2.6 times
    # the CPU time, copying 196 M params and two moments a step).
    update = objective.update_fn(optimizer, donate=True)

    def step():
        state["params"], state["opt"], metrics = update(state["params"], state["opt"], batch)
        jax.block_until_ready(metrics["loss"])

    def rescore():
        jax.block_until_ready(objective.packed_log_probs(state["params"], batch))

    return {"step": timed(step, repeats), "rescore": timed(rescore, repeats)}


def torch_side(folder: Path, dtype: str, batch: dict, repeats: int) -> dict[str, tuple]:
    """transformers + torch: the same loss, backward and Adam step, and the forward alone."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    tokens = torch.from_numpy(batch["tokens"]).long()
    mask = torch.from_numpy(batch["loss_mask"])[:, 1:]
    advantages = torch.from_numpy(batch["advantages"])[:, 1:]
    proximal = torch.from_numpy(batch["proximal_logprobs"])[:, 1:]
    behavior = torch.from_numpy(batch["behavior_logprobs"])[:, 1:]

    def log_probs() -> torch.Tensor:
        logits = model(input_ids=tokens).logits[:, :-1].float()
        picked = torch.gather(logits, -1, tokens[:, 1:, None])[..., 0]
        return picked - torch.logsumexp(logits, -1)

    def step():
        current = log_probs()
        ratio = torch.exp((current - proximal) * mask)
        importance = torch.clamp(torch.exp((proximal - behavior) * mask), max=CAP)
        surrogate = torch.minimum(
            ratio * advantages, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * advantages
        )
        loss = -(importance * surrogate * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def rescore():
        with torch.no_grad():
            log_probs()

    return {"step": timed(step, repeats), "rescore": timed(rescore, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen2-0.5B: 24)")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls after the first")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, for CI")
    args = parser.parse_args()
    hide_broken_media_packages()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    shape, layers, rows, width = QWEN2_05B, args.layers, args.rows, args.width
    if args.smoke:
        # One dtype: both take the same path, bfloat16's also casting the float32 checkpoint's
        # weights as it loads them; the second dtype only doubled the smoke's compiles.
        shape, layers, rows, width, args.repeats = SMOKE, 1, 2, 32, 1
        args.dtypes = "bfloat16"
    batch = batch_of(rows, width, shape["vocab_size"])
    print(
        f"Qwen2-0.5B shape, {layers} layers, vocab {shape['vocab_size']}; {rows} x {width} "
        f"tokens; {torch.get_num_threads()} torch threads, JAX on {jax.devices()[0].platform}; "
        f"seconds, mean of {args.repeats} after a first call"
    )
    print(f"{'dtype':>9} {'pass':>8} {'dew':>9} {'torch':>9} {'dew/torch':>10} {'dew compile':>12}")
    with tempfile.TemporaryDirectory() as scratch:
        folder = write_checkpoint(Path(scratch) / "qwen2", shape, layers)
        for dtype in args.dtypes.split(","):
            dew = dew_side(folder, dtype, batch, args.repeats)
            theirs = torch_side(folder, dtype, batch, args.repeats)
            for name in ("step", "rescore"):
                (first, ours), (_, torch_seconds) = dew[name], theirs[name]
                print(
                    f"{dtype:>9} {name:>8} {ours:>9.3f} {torch_seconds:>9.3f} "
                    f"{ours / torch_seconds:>10.2f} {first - ours:>12.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
