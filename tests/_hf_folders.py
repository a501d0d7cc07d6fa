"""A tiny Hugging Face checkpoint folder with a tokenizer and chat template of its own, for the
tests that train one with `dew train --model`."""

from __future__ import annotations

import json
from pathlib import Path

from _bpe import train_bpe
from dew._torch_media import hide_broken_media_packages

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"


def chat_checkpoint(folder: Path, shape: dict) -> Path:
    """A random Qwen2 checkpoint of `shape` in `folder` (made by transformers), with a
    byte-level BPE trained here (its embedding rows eight past the tokenizer's ids, as real
    checkpoints pad them) and Qwen2.5's real chat template."""
    hide_broken_media_packages()
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe(folder / "tokenizer.json")
    vocab = json.loads(tokenizer.read_text())["model"]["vocab"]
    (folder / "chat_template.jinja").write_text((TEMPLATES / "qwen2.5-instruct.jinja").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**shape, "vocab_size": len(vocab) + 8})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def answer_with_digits(folder: Path) -> Path:
    """Make the checkpoint in `folder` (`chat_checkpoint`'s, untied) answer with digits: one
    embedding dimension large for every token, and the output projection reading it as +1 for
    the digits' tokens and -1 for the rest. A random digit copies the copy task's right one a
    tenth of the time, so its groups differ in reward and a run has something to learn (a
    random checkpoint's replies all earn 0)."""
    from safetensors.numpy import load_file, save_file

    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    digits = [vocab[str(digit)] for digit in range(10)]
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.embed_tokens.weight"][:, 0] = 30.0
    tensors["lm_head.weight"][:, 0] = -1.0
    tensors["lm_head.weight"][digits, 0] = 1.0
    save_file(tensors, weights, metadata={"format": "pt"})
    return folder


def randomize_params(model) -> None:
    """Draw every param of a transformers `model` at random, in place, from torch's generator:
    norms near 1, the rest N(0, 0.2), so biases and norms take part in what a test compares."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0, 0.2)
