"""A tiny random Qwen2 checkpoint folder written by `transformers`, so nothing is downloaded.

Shaped for vLLM's CPU build: its attention refuses heads narrower than 64, so two heads of 64
make the hidden width 128. float32, so dew's JAX model and vLLM agree to float32 rounding.
"""

from pathlib import Path

from _bpe import train_bpe

# ChatML, as Qwen2 checkpoints render conversations.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen2(
    folder: Path,
    *,
    seed: int = 0,
    vocab: int = 320,
    max_len: int = 256,
    hidden: int = 128,
    layers: int = 2,
    tied: bool = False,
) -> Path:
    """Write a Qwen2 of `layers` layers and width `hidden` (heads of 64, one key/value head)
    with a byte-level BPE tokenizer and a ChatML chat template into `folder`, and return it.
    `tied` makes the output projection the embedding (`tie_word_embeddings`), as most small
    checkpoints people train have it: the folder then holds no `lm_head.weight`."""
    from dew._torch_media import hide_broken_media_packages

    hide_broken_media_packages()
    import torch
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train_bpe(folder / "tokenizer.json", vocab_size=vocab)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        bos_token="<bos>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=max_len,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder)
    return folder


def sharpened(params: dict) -> dict:
    """`params` with the layers' matrices scaled by 3 and the embedding (and the head, where
    separate) by 8: a tiny random model's logits are nearly uniform and its residual stream is
    mostly its embedding, so neither a stale head nor stale cached keys and values would show
    much; scaled, its next-token distributions are sharp (the most likely token 0.1 to 0.99)
    and a prompt's earlier tokens change them by nats."""
    import jax
    import jax.numpy as jnp

    out = dict(params, embed=params["embed"] * jnp.float32(8))
    if "lm_head" in out:
        out["lm_head"] = out["lm_head"] * jnp.float32(8)
    out["layers"] = [
        jax.tree.map(lambda leaf: leaf * jnp.float32(3) if leaf.ndim >= 2 else leaf, layer)
        for layer in params["layers"]
    ]
    return out
