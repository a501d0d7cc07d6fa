"""LoRA adapters (dew.models.hf.lora) against transformers + PEFT: a fresh adapter gives the
base's logits exactly, the same adapter weights give PEFT's logits, dew's saved adapter folder
is PEFT's own and loads in `PeftModel.from_pretrained`, and targets that match no module are
refused naming those that exist."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from _hf_folders import randomize_params
from dew._torch_media import hide_broken_media_packages
from dew.models import hf
from dew.models.hf import lora

os.environ.setdefault("HF_HUB_OFFLINE", "1")
hide_broken_media_packages()
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 96
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
# Llama with attention biases (o_proj's too), Qwen2 with q/k/v biases and tied embeddings,
# Qwen3 with q/k norms and a head wider than hidden / heads.
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE, attention_bias=True),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=16),
}
EACH_FAMILY = pytest.mark.parametrize("family", list(FAMILIES))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    made = {}
    for family, config in FAMILIES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="eager")
        randomize_params(model)
        made[family] = tmp_path_factory.mktemp(family)
        model.save_pretrained(made[family])
    return made


def _peft_model(folder: Path, config: lora.LoRAConfig, seed: int):
    """transformers' float32 model of `folder` under a PEFT adapter of `config` whose B is
    drawn at random too (PEFT starts it at zero), so the adapter changes the logits."""
    base = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    wrapped = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,
            target_modules=list(config.targets),
            task_type="CAUSAL_LM",
        ),
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    return wrapped.eval()


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, variables, tokens):
    length = tokens.shape[0]
    return model(
        variables,
        tokens[None],
        jnp.arange(length, dtype=jnp.int32)[None],
        jnp.ones((1, length), jnp.int32),
    )[0]


def _sequence(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, 20).astype(np.int32)


@EACH_FAMILY
def test_a_fresh_adapter_gives_the_base_logits_exactly(folders, family):
    base, params = hf.load(folders[family])
    model = lora.LoRAModel(base, lora.LoRAConfig(rank=4, alpha=8))
    variables = model.variables(params, jax.random.key(0))
    assert np.abs(np.asarray(variables["adapter"]["layers"][0]["q_proj"]["lora_A"])).max() > 0
    tokens = jnp.asarray(_sequence(1))
    np.testing.assert_array_equal(
        np.asarray(_forward(model, variables, tokens)), np.asarray(_forward(base, params, tokens))
    )


@EACH_FAMILY
def test_the_same_adapter_gives_transformers_and_peft_logits(folders, family, tmp_path):
    config = lora.LoRAConfig(rank=4, alpha=8)  # every projection, the default targets
    reference = _peft_model(folders[family], config, seed=2)
    reference.save_pretrained(tmp_path / "adapter")
    base, params = hf.load(folders[family])
    loaded, adapter = lora.load_adapter(tmp_path / "adapter", base)
    assert loaded == _sorted_targets(config)
    model = lora.LoRAModel(base, loaded)
    sequence = _sequence(3)
    want = _torch_logits(reference, sequence)
    got = np.asarray(_forward(model, {"adapter": adapter, "base": params}, jnp.asarray(sequence)))
    # The adapter moves the logits well past the bound, so matching them is PEFT's delta.
    base_logits = np.asarray(_forward(base, params, jnp.asarray(sequence)))
    assert np.abs(want - base_logits).max() > 1e-2
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def _sorted_targets(config: lora.LoRAConfig) -> lora.LoRAConfig:
    """`config` with its targets in the sorted order a loaded adapter's come in."""
    return lora.LoRAConfig(config.rank, config.alpha, tuple(sorted(config.targets)))


def test_a_saved_adapter_is_peft_s_own_folder_and_loads_in_peft(folders, tmp_path):
    folder = folders["qwen2"]
    config = lora.LoRAConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    base, params = hf.load(folder)
    adapter = lora.init(jax.random.key(1), base, config)
    # B drawn too, so the saved adapter moves the logits.
    adapter = jax.tree.map(
        lambda leaf: leaf + 0.3 * jax.random.normal(jax.random.key(2), leaf.shape), adapter
    )
    lora.save_adapter(tmp_path / "dew", adapter, config, base_model=str(folder))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dew"]  # nothing left beside it
    _peft_model(folder, config, seed=0).save_pretrained(tmp_path / "peft")
    with (
        safe_open(tmp_path / "dew" / lora.ADAPTER_WEIGHTS, "numpy") as ours,
        safe_open(tmp_path / "peft" / lora.ADAPTER_WEIGHTS, "numpy") as theirs,
    ):
        assert sorted(ours.keys()) == sorted(theirs.keys())
        assert ours.metadata() == theirs.metadata()
        for name in theirs.keys():
            assert ours.get_slice(name).get_shape() == theirs.get_slice(name).get_shape()
            assert ours.get_slice(name).get_dtype() == theirs.get_slice(name).get_dtype()
    written = json.loads((tmp_path / "dew" / lora.ADAPTER_CONFIG).read_text())
    assert written["base_model_name_or_path"] == str(folder)
    transformers_base = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    loaded = peft.PeftModel.from_pretrained(transformers_base, tmp_path / "dew").eval()
    sequence = _sequence(4)
    want = _torch_logits(loaded, sequence)
    got = np.asarray(
        _forward(lora.LoRAModel(base, config), {"adapter": adapter, "base": params}, sequence)
    )
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # And back: dew reads its own folder to the same arrays.
    again_config, again = lora.load_adapter(tmp_path / "dew", base)
    assert again_config == _sorted_targets(config)
    for mine, read in zip(jax.tree.leaves(adapter), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(read))


def test_targets_that_match_no_module_are_refused_naming_those_that_exist():
    with pytest.raises(ValueError) as refused:
        lora.LoRAConfig(targets=("q_proj", "query_key_value"))
    message = str(refused.value)
    assert "\n" not in message
    assert "'query_key_value'" in message and "targets" in message
    for name in lora.TARGETS:
        assert name in message


def test_an_adapter_of_another_rank_or_targets_is_not_saved_under_a_config(folders, tmp_path):
    base, _ = hf.load(folders["qwen2"])
    config = lora.LoRAConfig(rank=4, targets=("q_proj",))
    adapter = lora.init(jax.random.key(0), base, config)
    with pytest.raises(ValueError, match="rank 4, its config's rank is 2"):
        lora.save_adapter(tmp_path / "a", adapter, lora.LoRAConfig(rank=2, targets=("q_proj",)))
    with pytest.raises(ValueError, match=r"adapts \['q_proj'\], its config's targets"):
        lora.save_adapter(tmp_path / "a", adapter, lora.LoRAConfig(rank=4, targets=("v_proj",)))
    assert not (tmp_path / "a").exists()
