"""dew.models.hf against checkpoint configs as published ones spell them.

Each case is a tiny random checkpoint written by `transformers` itself (a family's config with
one variation real checkpoints use, `save_pretrained`), sometimes with its `config.json` or
tensors edited afterwards as older releases, users or conversion scripts leave them. dew must
give `transformers`' float32 logits to 1e-4, or refuse before reading any tensor, naming the
field (or tensor) and its value. Above all, no variation may load and then compute something
else: a RoPE scaling or sliding window silently dropped gives the right logits on short
sequences and wrong ones past them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from _bpe import train_bpe
from _checkpoint import CHAT_TEMPLATE
from _hf_folders import randomize_params
from dew._torch_media import hide_broken_media_packages
from dew.models import hf
from dew.serve.tokenizer import TemplateTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
hide_broken_media_packages()
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64
MAX_LEN = 64
LENGTH = 60  # past every scaled RoPE's original length (16) and every window that cuts
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": MAX_LEN,
}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig,
    "mistral": lambda: transformers.MistralConfig,
    "qwen2": lambda: transformers.Qwen2Config,
    "qwen3": lambda: transformers.Qwen3Config,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
DELETE = object()
"""In a config edit: remove the field."""


def _config(family: str, **changes):
    return CONFIGS[family]()(**{**SHAPE, **changes})


def _checkpoint(folder: Path, family: str, *, dtype=None, save=None, **changes) -> Path:
    """A random `family` checkpoint (norms and biases drawn too, so each takes part) of the
    shape with `changes`, in `dtype`, written by transformers into `folder`."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _config(family, **changes), attn_implementation="eager"
    )
    randomize_params(model)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, **(save or {}))
    return folder


def _edit_config(folder: Path, changes: dict) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for name, value in changes.items():
        if value is DELETE:
            config.pop(name, None)
        else:
            config[name] = value
    path.write_text(json.dumps(config))


def _edit_tensors(folder: Path, change) -> None:
    """Rewrite `folder`'s model.safetensors with `change(tensors)` applied."""
    weights = folder / "model.safetensors"
    with safe_open(weights, "numpy") as opened:
        tensors = {name: opened.get_tensor(name) for name in opened.keys()}
    change(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


def _reference(folder: Path, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        return model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()


def _dew_logits(model, params, tokens: np.ndarray) -> np.ndarray:
    length = len(tokens)
    return np.asarray(
        model(
            params,
            jnp.asarray(tokens[None], jnp.int32),
            jnp.arange(length, dtype=jnp.int32)[None],
            jnp.ones((1, length), jnp.int32),
        )[0]
    )


def _assert_transformers_logits(folder: Path, *, dtype: str | None = None) -> hf.HFModel:
    model, params = hf.load(folder, dtype=dtype)
    assert model.dtype == "float32"
    tokens = np.random.default_rng(1).integers(0, VOCAB, LENGTH)
    want = _reference(folder, tokens)
    np.testing.assert_allclose(_dew_logits(model, params, tokens), want, atol=1e-4, rtol=0)
    assert np.abs(want).max() > 1  # logits large enough that 1e-4 is a real bound
    return model


def _head_copy_of_embedding(tensors: dict) -> None:
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()


def _rope_buffers(tensors: dict) -> None:
    tensors["model.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    tensors["model.layers.0.self_attn.rotary_emb.cos_cached"] = np.ones((MAX_LEN, 8), np.float32)


# (family, transformers config changes, config.json edits afterwards, tensor edit)
MATCHES = {
    **{
        f"{family}-tied-{tied}": (family, {"tie_word_embeddings": tied}, {}, None)
        for family in CONFIGS
        for tied in (True, False)
    },
    **{
        f"{family}-head_dim-16": (family, {"head_dim": 16}, {}, None)  # not hidden / heads
        for family in CONFIGS
    },
    **{
        f"{family}-kv_heads-{kv}": (family, {"num_key_value_heads": kv}, {}, None)
        for family in CONFIGS
        for kv in (1, 4)  # multi-query, multi-head
    },
    "qwen3-rope_theta-1e6": (
        "qwen3",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        {},
        None,
    ),
    "mistral-rms_norm_eps-1e-2": ("mistral", {"rms_norm_eps": 1e-2}, {}, None),
    "llama-attention_bias": ("llama", {"attention_bias": True}, {}, None),
    "qwen3-attention_bias": ("qwen3", {"attention_bias": True}, {}, None),
    "llama-llama3": ("llama", {"rope_parameters": {"rope_theta": 5e5, **LLAMA3}}, {}, None),
    "llama-llama3-older-spelling": (
        "llama",
        {},
        {"rope_parameters": DELETE, "rope_theta": 5e5, "rope_scaling": LLAMA3},
        None,
    ),
    # transformers takes a top-level original_max_position_embeddings over the scaling's own,
    # and max_position_embeddings where neither is given.
    "llama-llama3-top-level-original": (
        "llama",
        {"rope_parameters": {"rope_theta": 5e5, **LLAMA3}},
        {"original_max_position_embeddings": 8},
        None,
    ),
    "llama-llama3-without-original": (
        "llama",
        {},
        {
            "rope_parameters": DELETE,
            "rope_scaling": {k: v for k, v in LLAMA3.items() if "original" not in k},
        },
        None,
    ),
    "llama-rope_scaling-agreeing-with-rope_parameters": (
        "llama",
        {"rope_parameters": {"rope_theta": 5e5, **LLAMA3}},
        {"rope_scaling": LLAMA3, "rope_theta": 5e5},
        None,
    ),
    "qwen2-empty-rope_scaling": ("qwen2", {}, {"rope_scaling": {}}, None),
    "mistral-window-of-the-context": ("mistral", {"sliding_window": MAX_LEN}, {}, None),
    "mistral-no-window": ("mistral", {"sliding_window": None}, {}, None),
    # Qwen's window applies only under use_sliding_window, false where absent.
    "qwen2-window-switched-off": (
        "qwen2",
        {},
        {"use_sliding_window": False, "sliding_window": 16},
        None,
    ),
    "qwen3-window-without-switch": (
        "qwen3",
        {},
        {"use_sliding_window": DELETE, "layer_types": DELETE, "sliding_window": 16},
        None,
    ),
    **{
        f"{family}-no-architectures": (family, {}, {"architectures": DELETE}, None)
        for family in CONFIGS
    },
    "qwen2-null-architectures": ("qwen2", {}, {"architectures": None}, None),
    "mistral-empty-architectures": ("mistral", {}, {"architectures": []}, None),
    "qwen2-tied-with-its-head-saved-too": (
        "qwen2",
        {"tie_word_embeddings": True},
        {},
        _head_copy_of_embedding,
    ),
    "llama-rope-buffers": ("llama", {}, {}, _rope_buffers),
}


@pytest.mark.parametrize("case", list(MATCHES))
def test_a_variation_gives_transformers_logits(tmp_path, case):
    family, changes, edits, tensors = MATCHES[case]
    folder = _checkpoint(tmp_path / case, family, **changes)
    _edit_config(folder, edits)
    if tensors is not None:
        _edit_tensors(folder, tensors)
    model = _assert_transformers_logits(folder)
    assert hf.FAMILIES[model.config.architecture].model_type == family


@pytest.mark.parametrize(
    ("family", "dtype", "save"),
    [
        ("llama", "bfloat16", None),
        ("qwen3", "float16", None),
        ("qwen2", "bfloat16", {"max_shard_size": "4KB"}),
        ("mistral", "float16", {"max_shard_size": "4KB"}),
    ],
)
def test_half_precision_weights_load_as_float32_exactly(tmp_path, family, dtype, save):
    folder = _checkpoint(
        tmp_path, family, dtype=getattr(torch, dtype), save=save, tie_word_embeddings=True
    )
    if save:
        assert len(list(folder.glob("model-*.safetensors"))) > 2
    _assert_transformers_logits(folder, dtype="float32")


def test_a_float16_checkpoint_names_the_dtype_it_needs(tmp_path):
    folder = _checkpoint(tmp_path, "llama", dtype=torch.float16)
    message = r"is float16 \(config.json's dtype\), which dew does not train: pass dtype="
    with pytest.raises(hf.CheckpointError, match=message):
        hf.load(folder)
    with pytest.raises(hf.CheckpointError, match=message):
        hf.model_of(folder)
    _edit_config(folder, {"dtype": DELETE, "torch_dtype": "float16"})  # the older spelling
    with pytest.raises(hf.CheckpointError, match=message):
        hf.load(folder)
    assert hf.load(folder, dtype="bfloat16")[0].dtype == "bfloat16"


def test_a_config_without_architectures_is_saved_with_them(tmp_path):
    folder = _checkpoint(tmp_path / "in", "qwen3")
    _edit_config(folder, {"architectures": DELETE})
    model, params = hf.load(folder)
    hf.save(tmp_path / "out", model, params)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3ForCausalLM"]  # vLLM picks its model by them


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict[str, Path]:
    """One untied checkpoint of each family, for the refusals to edit."""
    return {family: _checkpoint(tmp_path_factory.mktemp(family), family) for family in CONFIGS}


def _transformers_config(family: str, **changes) -> dict:
    """config.json as transformers writes a config of `changes`."""
    return json.loads(_config(family, **changes).to_json_string())


ROPES = [
    ("linear", {"factor": 2.0}),
    ("dynamic", {"factor": 2.0}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 16}),
    (
        "longrope",
        {
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4,
            "original_max_position_embeddings": 16,
        },
    ),
]
# (family, config.json edits, the message's pattern)
REFUSALS = {
    **{
        f"{family}-rope-{kind}": (
            family,
            _transformers_config(family, rope_parameters={"rope_type": kind, **fields}),
            f"field rope_parameters: RoPE type '{kind}' is not supported",
        )
        for family in ("llama", "qwen3")
        for kind, fields in ROPES
    },
    **{
        f"qwen2-rope-{kind}-older-spelling": (
            "qwen2",
            {"rope_parameters": DELETE, "rope_theta": 1e6, "rope_scaling": {"type": kind, **f}},
            f"field rope_scaling: RoPE type '{kind}' is not supported",
        )
        for kind, f in ROPES
    },
    # A transformers 5 config.json a user added rope_scaling to, as model cards say to for long
    # contexts: transformers reads rope_scaling alone, with theta 10000, not 1e6.
    "qwen3-rope_scaling-added-to-rope_parameters": (
        "qwen3",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": LLAMA3},
        "fields rope_scaling .* and rope_parameters .* disagree: transformers reads "
        "rope_scaling alone \\(RoPE theta 10000.0",
    ),
    "llama-yarn-added-to-rope_parameters": (
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        "field rope_scaling: RoPE type 'yarn' is not supported",
    ),
    "llama-partial_rotary_factor": (
        "llama",
        {"partial_rotary_factor": 0.5},
        r"field partial_rotary_factor: partial RoPE \(0.5\)",
    ),
    "qwen2-rope-per-layer-type": (
        "qwen2",
        {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
        r"field rope_parameters: RoPE parameters per layer type \['full_attention'\] are not",
    ),
    "llama-gelu": ("llama", {"hidden_act": "gelu"}, "field hidden_act must be 'silu'"),
    # transformers computes swish as SiLU, vLLM's Llama-family MLPs refuse it.
    "qwen2-swish": ("qwen2", {"hidden_act": "swish"}, r"field hidden_act .* got 'swish'"),
    "llama-mlp_bias": ("llama", {"mlp_bias": True}, "field mlp_bias: MLP biases"),
    # transformers' Mistral applies a window whatever use_sliding_window says.
    "mistral-window-switched-off": (
        "mistral",
        {"use_sliding_window": False, "sliding_window": 16},
        "field sliding_window: a window of 16 < max_position_embeddings 64",
    ),
    "llama-window": ("llama", {"sliding_window": 32}, "field sliding_window: a window of 32"),
    **{
        f"{family}-sliding-window": (
            family,
            _transformers_config(
                family, use_sliding_window=True, sliding_window=16, max_window_layers=1
            ),
            r"field layer_types: \['sliding_attention'\] layers are not supported",
        )
        for family in ("qwen2", "qwen3")
    },
    "qwen2-window-switched-on": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 16, "layer_types": DELETE},
        "field use_sliding_window: sliding-window attention is not supported",
    ),
    "qwen3-quantized": (
        "qwen3",
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
        r"field quantization_config: quantized weights \('fp8'\) are not supported",
    ),
    "mistral-unknown-model_type": (
        "mistral",
        {"architectures": DELETE, "model_type": "gemma"},
        "field architectures is missing and field model_type 'gemma' is not one dew computes",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_variation_dew_does_not_compute_is_refused_naming_the_field(plain, tmp_path, case):
    family, edits, message = REFUSALS[case]
    folder = tmp_path / case
    shutil.copytree(plain[family], folder)
    _edit_config(folder, edits)
    with pytest.raises(ValueError, match=f"{folder / 'config.json'}: {message}"):
        hf.load(folder)
    with pytest.raises(ValueError, match=message):
        hf.model_of(folder)


def test_a_tied_checkpoint_with_another_head_saved_is_refused(tmp_path):
    """transformers unties a model whose saved head is not its embedding, vLLM ties it: the two
    engines would compute different logits from the folder."""
    folder = _checkpoint(tmp_path, "qwen2", tie_word_embeddings=True)

    def other_head(tensors):
        embedding = tensors["model.embed_tokens.weight"]
        tensors["lm_head.weight"] = embedding[::-1].copy()

    _edit_tensors(folder, other_head)
    with pytest.raises(
        hf.CheckpointError,
        match="tensor lm_head.weight in .* is not model.embed_tokens.weight, but config.json's "
        "tie_word_embeddings is true",
    ):
        hf.load(folder)


def test_a_missing_head_points_at_tie_word_embeddings(tmp_path):
    folder = _checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)
    _edit_config(folder, {"tie_word_embeddings": DELETE})  # transformers' default: false
    with pytest.raises(
        hf.CheckpointError,
        match="tensor lm_head.weight is missing from .*tie_word_embeddings is false or absent",
    ):
        hf.load(folder)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> tuple[Path, object]:
    """A checkpoint folder's tokenizer files as transformers saves them, without a chat
    template, and transformers' tokenizer."""
    folder = tmp_path_factory.mktemp("tokenizer")
    train_bpe(folder / "tokenizer.json")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), bos_token="<bos>", eos_token="<|im_end|>"
    )
    tokenizer.save_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    return folder, tokenizer


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_folders_chat_template_gives_transformers_ids(
    tokenizer_folder, tmp_path, where, add_generation_prompt
):
    source, reference = tokenizer_folder
    folder = tmp_path / "folder"
    shutil.copytree(source, folder)
    if where == "chat_template.jinja":  # transformers 5
        (folder / where).write_text(CHAT_TEMPLATE)
    else:  # older releases
        config = json.loads((folder / where).read_text())
        (folder / where).write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    messages = [{"role": "user", "content": "what is 6 x 7?"}]
    want = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )["input_ids"]
    ours = TemplateTokenizer.from_folder(folder)
    got = ours.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert list(got) == list(want)
    assert ours.decode(list(ours.generation_prompt())) == "<|im_start|>assistant\n"
    assert ours.eos_id == reference.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.medium
def test_a_folder_without_a_chat_template_says_how_to_give_one(tokenizer_folder):
    folder, reference = tokenizer_folder
    with pytest.raises(ValueError, match="has no chat template .*: pass chat_template="):
        TemplateTokenizer.from_folder(folder)
    given = TemplateTokenizer.from_folder(folder, chat_template=CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "hello"}]
    want = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert list(given.encode_chat(messages)) == list(want["input_ids"])
