"""LoRA adapters of a Hugging Face checkpoint (or of dew's own transformer): trained in JAX,
saved as PEFT saves them.

An adapter adds to each targeted projection W (torch's [out, in]) the low-rank delta
`alpha / rank * B @ A`, A [rank, in] and B [out, rank], as PEFT's `LoraLayer` does; B starts at
zero, so an adapter's first logits are the base model's exactly. The adapter is kept in PEFT's
own layout (`lora_A`, `lora_B` per module, float32), so saving it is writing its arrays under
PEFT's names and loading PEFT's is reading them: nothing to transpose either way.

Hand-written, not a library: qwix (LoRA for JAX models) is not installed here, and dew's HF
decoder is plain functions over a params pytree, which a library that rewrites a flax module's
calls cannot wrap. The delta is added to the params before the unchanged forward runs
(`merged`), so every family, the packed rows, the engine's prefill and decode and the saved
merged folder go through one code path, and dew's logits are the merged model's that PEFT's
`merge_and_unload` gives. The price: each forward builds the targeted weights afresh (one
[in, out] matmul of rank `rank` per weight, and the weights' size in transient memory), where
a fused `x @ A @ B` beside each projection would not; the optimizer holds state for the adapter
alone either way (`LoRAModel.frozen`).

Dropout on the adapter branch's input (`LoRAConfig.dropout`, PEFT's `lora_dropout`) cannot be
merged: a training step's forward, handed a dropout key, runs each targeted projection unmerged
(`dew.models._adapted`), x W + alpha / rank * (dropout(x) A^T) B^T as PEFT computes it in
train mode. Every other forward (rescoring, sampling, evaluation) is the merged one, without
dropout, as PEFT's in eval mode; so is a training step's where the dropout is 0.

`LoRAModel` serves and trains base + adapter as a `dew.models.Model`: its variables are
`{"adapter": ..., "base": ...}`, the base under `stop_gradient`. Its base is a checkpoint's
`HFModel` (targets by the checkpoint's module names, `TARGETS`) or dew's own `Transformer`
(targets by its block weights' names, `TRANSFORMER_TARGETS`); PEFT and vLLM know only the
first, so only its adapters are saved as PEFT folders.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dew._checks import in_range, int_at_least
from dew._documents import read_document
from dew.models import Transformer
from dew.models._adapted import Adapted, dropout_mask
from dew.models.hf import _params
from dew.models.hf._modeling import HFModel

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "TARGETS",
    "TRANSFORMER_TARGETS",
    "LoRAConfig",
    "LoRAModel",
    "dropout_mask",
    "footprint",
    "frozen",
    "init",
    "load_adapter",
    "merged",
    "save_adapter",
]

ADAPTER_CONFIG = "adapter_config.json"
"""The adapter folder's config, PEFT's `LoraConfig` as JSON."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""The adapter folder's tensors, under PEFT's names (`_tensor_name`)."""
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""A checkpoint's modules an adapter targets unless told: every attention and MLP projection."""
TRANSFORMER_TARGETS = ("qkv", "out", "up", "down")
"""dew's transformer's modules (`dew.models.Transformer`'s block weights) an adapter can
target, all of them unless told: attention's input and output projections, the MLP's two."""

# PEFT's name of a module's tensors inside a causal LM it wraps: base_model.model is PEFT's
# wrapper and the transformers model; the rest is the checkpoint's own module path.
_PEFT_PREFIX = "base_model.model."
_WEIGHT = ".weight"


def _projections() -> dict[str, _params.Entry]:
    """Each module an adapter can target (a block's projection, by its checkpoint name:
    `q_proj`, ...) and its row of the params table."""
    return {
        entry.name.split(".")[-2]: entry
        for entry in _params.LAYER
        if entry.name.endswith("_proj" + _WEIGHT)
    }


@attrs.frozen
class _Module:
    """A weight an adapter can target: its name in a block of the params, the layout torch's
    [out, in] delta takes as it, and how many of its leading axes the input fills."""

    leaf: str
    layout: _params.Layout
    in_axes: int = 1


def _modules() -> dict[str, _Module]:
    """Every module an adapter can target, by its name: a checkpoint block's projections
    (`q_proj`, ...: their rows of the params table) and dew's transformer's block weights."""
    checkpoint = {
        name: _Module(entry.path[-1], entry.layout, 2 if entry.layout is _params.FROM_HEADS else 1)
        for name, entry in _projections().items()
    }
    return checkpoint | {name: _Module(name, _params.TRANSPOSED) for name in TRANSFORMER_TARGETS}


def _family(model: HFModel | Transformer) -> tuple[tuple[str, ...], str]:
    """The modules an adapter of `model` can target, and what the model is, in words."""
    if isinstance(model, Transformer):
        return TRANSFORMER_TARGETS, "dew's transformer"
    return tuple(_projections()), "the checkpoint"


def _blocks(params: dict) -> str:
    """The key of the params' list of blocks: a checkpoint's "layers", dew's "blocks"."""
    return "layers" if "layers" in params else "blocks"


def _no_module(field: str, unknown: list[str], known: tuple[str, ...], model: str) -> ValueError:
    return ValueError(
        f"{field} {', '.join(map(repr, unknown))} "
        f"match{'es' if len(unknown) == 1 else ''} no module of {model}; "
        f"the modules an adapter can target are {', '.join(known)}"
    )


def _module_path(target: str) -> str:
    """The module of `target` inside a block: "self_attn.q_proj", "mlp.gate_proj"."""
    return _projections()[target].name.removesuffix(_WEIGHT)


def _tensor_name(index: int, target: str, factor: str) -> str:
    """PEFT's saved name of `factor` ("lora_A" or "lora_B") of `target` in block `index`."""
    block = _params.LAYER_PREFIX.format(i=index)
    return f"{_PEFT_PREFIX}{block}{_module_path(target)}.{factor}{_WEIGHT}"


def _targets(instance, attribute, value) -> None:
    """Module names of one model: a checkpoint's (`TARGETS`) or dew's transformer's; a name
    of neither is refused listing the modules of the model the others name."""
    if not value:
        raise ValueError(f"{attribute.name} must name at least one module")
    families = [
        family
        for family in (tuple(_projections()), TRANSFORMER_TARGETS)
        if set(value) & set(family)
    ]
    if len(families) > 1:
        raise ValueError(
            f"{attribute.name} {list(value)} mixes a checkpoint's modules with dew's "
            f"transformer's ({', '.join(TRANSFORMER_TARGETS)}): name one model's"
        )
    known = families[0] if families else tuple(_modules())
    unknown = [name for name in value if name not in known]
    if unknown:
        raise _no_module(attribute.name, unknown, known, "the model")
    if len(set(value)) != len(value):
        raise ValueError(f"{attribute.name} names a module twice: {list(value)}")


def _positive(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{attribute.name} must be a number > 0, got {value!r}")


@attrs.frozen
class LoRAConfig:
    """An adapter's shape: PEFT's `LoraConfig` fields dew trains.

    Args:
        rank: the adapter's rank r (PEFT's `r`).
        alpha: its scale's numerator (PEFT's `lora_alpha`): the delta is alpha / rank * B @ A.
        targets: the modules adapted in every block, by their checkpoint names
            (PEFT's `target_modules`); `TARGETS` unless given.
        dropout: the probability that a training step drops each feature of an adapter
            branch's input (PEFT's `lora_dropout`), in [0, 1); 0: none.
    """

    rank: int = attrs.field(default=8, validator=int_at_least(1))
    alpha: float = attrs.field(default=16.0, validator=_positive)
    targets: tuple[str, ...] = attrs.field(default=TARGETS, converter=tuple, validator=_targets)
    dropout: float = attrs.field(default=0.0, validator=in_range(0, 1, high_open=True))

    @property
    def scale(self) -> float:
        """The delta's factor, alpha / rank (PEFT's `scaling`)."""
        return self.alpha / self.rank

    def to_peft(self, base_model: str | None = None) -> dict[str, Any]:
        """The config as PEFT writes `adapter_config.json` for it (fields left out take PEFT's
        and vLLM's defaults, which are what dew computes)."""
        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": alpha,
            "lora_dropout": self.dropout,
            "target_modules": list(self.targets),
            "bias": "none",
            "lora_bias": False,
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
            "init_lora_weights": True,
            "inference_mode": True,
        }

    @classmethod
    def from_peft(cls, document: Mapping[str, Any], where: str) -> LoRAConfig:
        """The config of a PEFT `adapter_config.json` read from `where`.

        Raises:
            ValueError: naming `where` and the field, for an adapter dew does not compute
                (another PEFT method, DoRA, rsLoRA, per-module ranks, trained biases).
        """
        unsupported = {
            "peft_type": "LORA",
            "use_dora": False,
            "use_rslora": False,
            "bias": "none",
            "lora_bias": False,
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "layers_to_transform": None,
        }
        for field, plain in unsupported.items():
            if document.get(field, plain) != plain:
                raise ValueError(
                    f"{where}: {field} = {document[field]!r}, which dew does not compute "
                    f"(it computes {field} = {plain!r})"
                )
        targets = document.get("target_modules")
        if isinstance(targets, str) or not isinstance(targets, list):
            raise ValueError(f"{where}: target_modules must be a list of module names")
        try:
            return cls(
                document["r"],
                document["lora_alpha"],
                tuple(sorted(targets)),
                document.get("lora_dropout", 0.0),
            )
        except KeyError as missing:
            raise ValueError(f"{where} has no {missing.args[0]}") from None
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None


def _shapes(model: HFModel | Transformer, target: str) -> tuple[int, int]:
    """The (in, out) widths of `target`'s weight in torch's [out, in] layout."""
    if isinstance(model, Transformer):
        d, f = model.config.d_model, model.config.d_ff
        return {"qkv": (d, 3 * d), "out": (d, d), "up": (d, f), "down": (f, d)}[target]
    entry = _projections()[target]
    out, width = entry.layout.tensor_shape(entry.leaf_shape(model.config))
    return width, out


def init(key: jax.Array, model: HFModel | Transformer, lora: LoRAConfig) -> dict[str, Any]:
    """A fresh adapter of `model`: per block and target, `lora_A` float32[rank, in] drawn as
    PEFT draws it (uniform within +-1/sqrt(in), the Kaiming bound of a=sqrt(5)) from `key`,
    and `lora_B` float32[out, rank] zeros, so the adapted model starts as the base.

    Returns:
        `{"layers": [{target: {"lora_A": ..., "lora_B": ...}}]}`, one dict per block.
    """
    keys = jax.random.split(key, model.config.layers * len(lora.targets))
    layers, drawn = [], iter(keys)
    for _ in range(model.config.layers):
        block = {}
        for target in lora.targets:
            width, out = _shapes(model, target)
            bound = 1 / np.sqrt(width)
            block[target] = {
                "lora_A": jax.random.uniform(
                    next(drawn), (lora.rank, width), jnp.float32, -bound, bound
                ),
                "lora_B": jnp.zeros((out, lora.rank), jnp.float32),
            }
        layers.append(block)
    return {"layers": layers}


def merged(params: dict, adapter: dict, lora: LoRAConfig) -> dict:
    """`params` with each targeted weight plus its adapter's delta alpha / rank * B @ A
    (computed in float32, added in float32, then in the params' dtype): the params PEFT's
    `merge_and_unload` gives. Pure; jit it or call it inside a jitted function."""
    blocks = _blocks(params)
    out = {**params, blocks: [dict(layer) for layer in params[blocks]]}
    modules = _modules()
    for layer, block in zip(out[blocks], adapter["layers"], strict=True):
        for target, factors in block.items():
            module = modules[target]
            weight = layer[module.leaf]
            delta = lora.scale * (factors["lora_B"] @ factors["lora_A"])
            delta = module.layout.to_leaf(delta, weight.shape)
            layer[module.leaf] = (weight.astype(jnp.float32) + delta).astype(weight.dtype)
    return out


def frozen(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer` over a `LoRAModel`'s variables' adapter, the base left as it is with no
    state (its updates are zeros): the base's gradient is zero anyway (`stop_gradient`), and
    Adam's state for it would cost twice the base's memory for nothing."""
    return optax.multi_transform(
        {"adapter": optimizer, "base": optax.set_to_zero()},
        lambda variables: {name: name for name in variables},
    )


def _bytes(tree: Any) -> int:
    return sum(
        int(np.prod(np.shape(leaf))) * jnp.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves(tree)
    )


def footprint(variables: dict, opt_state: Any) -> dict[str, int]:
    """What a LoRA run holds against full fine-tuning of the same checkpoint with Adam, in
    bytes: `base` (the checkpoint's params), `adapter`, `optimizer` (the run's optimizer
    state: the adapter's alone) and `full_optimizer` (Adam's two moments of every param,
    what training them all would hold besides their gradients, as large as the params)."""
    base = _bytes(variables["base"])
    return {
        "base": base,
        "adapter": _bytes(variables["adapter"]),
        "optimizer": _bytes(opt_state),
        "full_optimizer": 2 * base,
    }


def save_adapter(
    folder: str | os.PathLike,
    adapter: dict,
    config: LoRAConfig,
    *,
    base_model: str | None = None,
) -> None:
    """Write `adapter` as the folder PEFT's `save_pretrained` writes: `adapter_config.json`
    and `adapter_model.safetensors` (float32, PEFT's tensor names), which
    `PeftModel.from_pretrained` and vLLM's `--lora-modules` / `load_lora_adapter` load as
    they are. Written whole or not at all: into a fresh folder beside it, renamed over it.

    vLLM caches prefixes by an adapter's path: write each new version to a new folder.

    Args:
        folder: where to write; replaced when it exists.
        adapter: `init`'s layout (as trained: a `LoRAModel`'s variables' "adapter").
        config: the adapter's config.
        base_model: the checkpoint it adapts, written as `base_model_name_or_path`.

    Raises:
        ValueError: when the adapter's targets or rank are not `config`'s, naming the module;
            when `folder` is a file.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file, not an adapter folder to write")
    tensors = dict(_adapter_tensors(adapter, config))
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.partial")
    staging.mkdir()
    try:
        document = json.dumps(config.to_peft(base_model), indent=2) + "\n"
        (staging / ADAPTER_CONFIG).write_text(document, encoding="utf-8")
        save_file(tensors, staging / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        old = None
        if folder.exists():
            old = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.old")
            os.replace(folder, old)
        os.replace(staging, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _adapter_tensors(adapter: dict, config: LoRAConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Each adapter tensor under PEFT's name, as float32 numpy, checked against `config`."""
    if set(config.targets) <= set(TRANSFORMER_TARGETS):
        raise ValueError(
            "an adapter of dew's transformer has no PEFT folder (PEFT knows checkpoints' "
            "modules): a run's checkpoints keep it"
        )
    for index, block in enumerate(adapter["layers"]):
        if sorted(block) != sorted(config.targets):
            raise ValueError(
                f"the adapter's block {index} adapts {sorted(block)}, its config's "
                f"targets are {sorted(config.targets)}"
            )
        for target, factors in block.items():
            a, b = (
                np.asarray(jax.device_get(factors[f]), np.float32) for f in ("lora_A", "lora_B")
            )
            if a.shape[0] != config.rank or b.shape[1] != config.rank:
                raise ValueError(
                    f"the adapter's {_tensor_name(index, target, 'lora_A')} is rank "
                    f"{a.shape[0]}, its config's rank is {config.rank}"
                )
            yield _tensor_name(index, target, "lora_A"), np.ascontiguousarray(a)
            yield _tensor_name(index, target, "lora_B"), np.ascontiguousarray(b)


def load_adapter(folder: str | os.PathLike, model: HFModel) -> tuple[LoRAConfig, dict]:
    """The config and adapter of a PEFT adapter folder of `model`'s checkpoint (one PEFT or
    `save_adapter` wrote).

    Raises:
        ValueError: naming the folder's file and field or tensor: a config dew does not
            compute, every tensor missing, extra or of another shape, at once.
    """
    folder = Path(folder)
    config_path = folder / ADAPTER_CONFIG
    try:
        document = read_document(config_path)
    except (OSError, ValueError) as error:
        raise ValueError(f"{config_path} is not an adapter config: {error}") from None
    if not isinstance(document, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    config = LoRAConfig.from_peft(document, str(config_path))
    weights = folder / ADAPTER_WEIGHTS
    try:
        with safe_open(weights, framework="numpy") as opened:
            held = {name: opened.get_tensor(name) for name in opened.keys()}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{weights} is missing, truncated or not safetensors: {error}") from None
    problems, layers = [], []
    for index in range(model.config.layers):
        block = {}
        for target in config.targets:
            width, out = _shapes(model, target)
            factors = {}
            for factor, shape in (("lora_A", (config.rank, width)), ("lora_B", (out, config.rank))):
                name = _tensor_name(index, target, factor)
                if name not in held:
                    problems.append(f"tensor {name} is missing")
                elif held[name].shape != shape:
                    problems.append(f"tensor {name} is {list(held[name].shape)}, not {list(shape)}")
                else:
                    factors[factor] = jnp.asarray(held.pop(name), jnp.float32)
            block[target] = factors
        layers.append(block)
    problems += [f"tensor {name} is not one this model's adapter has" for name in sorted(held)]
    if problems:
        raise ValueError(f"cannot load the adapter in {weights}: " + "; ".join(problems))
    return config, {"layers": layers}


@attrs.frozen
class LoRAModel:
    """A checkpoint's decoder (or dew's transformer) with a LoRA adapter, as a
    `dew.models.Model`: base + adapter.

    Its variables are `{"adapter": init's layout, "base": the checkpoint's params}`. Every
    function runs the base model on `merged` params, but a training forward with dropout
    (`key` given, `lora.dropout` > 0), which runs the targeted projections unmerged; the base
    is under `stop_gradient`, so a training step differentiates the adapter alone (and `frozen`
    keeps no optimizer state for the base).

    Args:
        base: the checkpoint's model, or dew's transformer.
        lora: the adapter's config, its targets among the base's modules.

    Raises:
        ValueError: naming the targets that match no module of the base, and those that do.
    """

    base: HFModel | Transformer = attrs.field(
        validator=attrs.validators.instance_of((HFModel, Transformer))
    )
    lora: LoRAConfig = attrs.field(validator=attrs.validators.instance_of(LoRAConfig))

    def __attrs_post_init__(self):
        known, model = _family(self.base)
        unknown = [name for name in self.lora.targets if name not in known]
        if unknown:
            raise _no_module("lora targets", unknown, known, model)

    @property
    def vocab(self) -> int:
        """The checkpoint's embedding rows."""
        return self.base.vocab

    @property
    def max_len(self) -> int:
        """The checkpoint's longest sequence."""
        return self.base.max_len

    @property
    def dtype(self) -> str:
        """The base params' dtype (the adapter is float32; dew's transformer is float32)."""
        return getattr(self.base, "dtype", "float32")

    def variables(self, params: dict, key: jax.Array) -> dict:
        """The variables of a fresh adapter (`init` from `key`) of the checkpoint's `params`."""
        return {"adapter": init(key, self.base, self.lora), "base": params}

    def init(self, key: jax.Array) -> dict:
        """Random base params and a fresh adapter of them."""
        base_key, adapter_key = jax.random.split(key)
        return self.variables(self.base.init(base_key), adapter_key)

    @property
    def stochastic(self) -> bool:
        """Whether its training forward draws at random (the adapter's dropout): a training
        step then hands `__call__` and `hidden_states` a key (`dew.models.Model`)."""
        return self.lora.dropout > 0

    def params(self, variables: dict) -> dict:
        """The base's params with the adapter merged in (the base under `stop_gradient`)."""
        base = jax.lax.stop_gradient(variables["base"])
        return merged(base, variables["adapter"], self.lora)

    def dropout_key(self, key: jax.Array, block: int, target: str) -> jax.Array:
        """The dropout key of `target`'s branch in block `block` in a training forward
        handed `key`: each branch draws its own mask."""
        return jax.random.fold_in(
            key, block * len(self.lora.targets) + self.lora.targets.index(target)
        )

    def training_params(self, variables: dict, key: jax.Array) -> dict:
        """The base's params (under `stop_gradient`) with each targeted weight beside its
        adapter, unmerged (`dew.models._adapted.Adapted`), its branch's input dropped out with
        `dropout_key(key, ...)`: what a training forward with dropout runs."""
        out = jax.lax.stop_gradient(variables["base"])
        blocks = _blocks(out)
        out = {**out, blocks: [dict(layer) for layer in out[blocks]]}
        modules = _modules()
        for index, (layer, block) in enumerate(
            zip(out[blocks], variables["adapter"]["layers"], strict=True)
        ):
            for target, factors in block.items():
                module = modules[target]
                layer[module.leaf] = Adapted(
                    layer[module.leaf],
                    factors["lora_A"],
                    factors["lora_B"],
                    self.dropout_key(key, index, target),
                    scale=self.lora.scale,
                    rate=self.lora.dropout,
                    in_axes=module.in_axes,
                )
        return out

    def _forward_params(self, variables: dict, key: jax.Array | None) -> dict:
        if key is None or not self.stochastic:
            return self.params(variables)
        return self.training_params(variables, key)

    def __call__(self, variables, tokens, positions, segment_ids, *, key=None) -> jax.Array:
        """Next-token logits of base + adapter over packed rows (`HFModel.__call__`); with a
        dropout `key`, a training forward's (see the class)."""
        return self.base(self._forward_params(variables, key), tokens, positions, segment_ids)

    def hidden_states(self, variables, tokens, positions, segment_ids, *, key=None) -> jax.Array:
        """The last layer's residual stream of base + adapter (`HFModel.hidden_states`); with
        a dropout `key`, a training forward's (see the class)."""
        params = self._forward_params(variables, key)
        return self.base.hidden_states(params, tokens, positions, segment_ids)

    def head(self, variables, hidden: jax.Array) -> jax.Array:
        """The next-token logits of `hidden_states`' output (`HFModel.head`)."""
        # The head (final norm and output projection) is never adapted.
        return self.base.head(jax.lax.stop_gradient(variables["base"]), hidden)

    def init_cache(self, *, slots: int, max_len: int) -> list[dict]:
        """An empty key/value cache, the checkpoint's (`HFModel.init_cache`)."""
        return self.base.init_cache(slots=slots, max_len=max_len)

    def prefill(self, variables, cache, tokens, slot):
        """Run a prompt into one slot of the cache under base + adapter (`HFModel.prefill`)."""
        return self.base.prefill(self.params(variables), cache, tokens, slot)

    def decode(self, variables, cache, tokens, positions):
        """Advance every slot by one token under base + adapter (`HFModel.decode`)."""
        return self.base.decode(self.params(variables), cache, tokens, positions)
