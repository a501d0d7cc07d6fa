"""A checkpoint folder's `config.json`, read into the shape of the model it describes.

`config.json` is the Hugging Face `transformers` config of the checkpoint. Both of its spellings
are read: transformers 5 keeps RoPE's settings in `rope_parameters` and the dtype in `dtype`,
older releases in `rope_theta`, `rope_scaling` and `torch_dtype`; where they differ, as
`transformers` reads them (`rope_scaling` over `rope_parameters`, a top-level
`original_max_position_embeddings` over the scaling's own). Whatever dew does not compute
(sliding windows, experts, quantized weights, other RoPE scalings, other activations), and what
`transformers` and vLLM would compute differently, is refused here, naming the field, before any
tensor is read or anything compiled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from dew._checks import int_at_least
from dew._documents import read_document

CONFIG = "config.json"
"""A checkpoint folder's config file."""


@attrs.frozen
class _Family:
    """What an architecture adds to the shared Llama block.

    qkv_bias / o_bias: whether the attention's q, k, v / output projections have biases: a
    bool, or the config field that says (Llama's and Qwen3's `attention_bias`).
    qk_norm: whether queries and keys are RMS-normalised per head before RoPE (Qwen3).
    window_switch: whether `sliding_window` applies only under `use_sliding_window` (Qwen2,
        Qwen3; false when absent); else a `sliding_window` set is taken to apply to every
        layer, whatever `use_sliding_window` says (transformers' Mistral applies it so; its
        Llama ignores the field, which other engines read).
    """

    model_type: str
    qkv_bias: bool | str
    o_bias: bool | str
    qk_norm: bool
    window_switch: bool = False


FAMILIES = {
    "LlamaForCausalLM": _Family("llama", "attention_bias", "attention_bias", qk_norm=False),
    "MistralForCausalLM": _Family("mistral", False, False, qk_norm=False),
    "Qwen2ForCausalLM": _Family("qwen2", True, False, qk_norm=False, window_switch=True),
    "Qwen3ForCausalLM": _Family(
        "qwen3", "attention_bias", "attention_bias", qk_norm=True, window_switch=True
    ),
}
"""The architectures (`config.json`'s `architectures`) dew computes, and what each adds."""

MODEL_TYPES = {family.model_type: architecture for architecture, family in FAMILIES.items()}
"""The architecture of each `model_type`, for a `config.json` that names no `architectures`
(`transformers`' Auto classes go by `model_type`)."""

# Fields whose presence (with a true value) means a mixture of experts.
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_DTYPES = ("float32", "bfloat16")
# Llama 3's RoPE scaling's fields, in `Llama3Scaling`'s order.
_LLAMA3_FACTORS = ("factor", "low_freq_factor", "high_freq_factor")


def _positive_float(instance, attribute, value):
    if not (isinstance(value, float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive finite float, got {value!r}")


@attrs.frozen
class Llama3Scaling:
    """Llama 3's RoPE scaling (`rope_type: llama3`): long wavelengths slowed by `factor`, short
    ones kept, those between interpolated.

    Args:
        factor: how much the longest wavelengths are stretched.
        low_freq_factor, high_freq_factor: the wavelength band (original_max_len over each)
            between which frequencies are interpolated.
        original_max_len: the context length the model was pretrained on.
    """

    factor: float = attrs.field(validator=_positive_float)
    low_freq_factor: float = attrs.field(validator=_positive_float)
    high_freq_factor: float = attrs.field(validator=_positive_float)
    original_max_len: int = attrs.field(validator=int_at_least(1))

    def __attrs_post_init__(self):
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor {self.high_freq_factor} must exceed low_freq_factor "
                f"{self.low_freq_factor}"
            )


def _architecture(instance, attribute, value):
    if value not in FAMILIES:
        raise ValueError(
            f"architecture {value!r} is not supported; dew computes {', '.join(FAMILIES)}"
        )


@attrs.frozen
class HFConfig:
    """The shape of a Llama-family decoder, as a checkpoint's `config.json` gives it.

    Args:
        architecture: one of `FAMILIES`.
        vocab: embedding rows (`vocab_size`).
        hidden: residual width (`hidden_size`).
        intermediate: the MLP's hidden width (`intermediate_size`).
        layers: decoder blocks (`num_hidden_layers`).
        heads: query heads (`num_attention_heads`).
        kv_heads: key/value heads (`num_key_value_heads`); heads must divide by it.
        head_dim: each head's width (`head_dim`, else hidden / heads).
        max_len: the longest sequence (`max_position_embeddings`).
        rope_theta: RoPE's base wavelength.
        rope_scaling: Llama 3's RoPE scaling, or None.
        rms_eps: RMSNorm's epsilon (`rms_norm_eps`).
        qkv_bias, o_bias: whether the attention projections have biases.
        qk_norm: whether queries and keys are normalised per head (Qwen3).
        tied: whether the output projection is the embedding (`tie_word_embeddings`).
        source: the `config.json` read, kept so a saved checkpoint keeps every field dew does
            not use (token ids, generation settings); not part of equality.
    """

    architecture: str = attrs.field(validator=_architecture)
    vocab: int = attrs.field(validator=int_at_least(1))
    hidden: int = attrs.field(validator=int_at_least(1))
    intermediate: int = attrs.field(validator=int_at_least(1))
    layers: int = attrs.field(validator=int_at_least(1))
    heads: int = attrs.field(validator=int_at_least(1))
    kv_heads: int = attrs.field(validator=int_at_least(1))
    head_dim: int = attrs.field(validator=int_at_least(2))
    max_len: int = attrs.field(validator=int_at_least(2))
    rope_theta: float = attrs.field(default=10000.0, validator=_positive_float)
    rope_scaling: Llama3Scaling | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.instance_of(Llama3Scaling)),
    )
    rms_eps: float = attrs.field(default=1e-6, validator=_positive_float)
    qkv_bias: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    o_bias: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    qk_norm: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    tied: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    source: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    def __attrs_post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must divide by kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    def inverse_frequencies(self) -> np.ndarray:
        """float32[head_dim / 2]: RoPE's angle per position of each rotated pair, computed in
        float32 step by step as `transformers` does, so angles agree to the last bit."""
        exponents = np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32)
        inverse = np.float32(1.0) / (
            np.float32(self.rope_theta) ** (exponents / np.float32(self.head_dim))
        )
        scaling = self.rope_scaling
        if scaling is None:
            return inverse.astype(np.float32)
        low = scaling.original_max_len / scaling.low_freq_factor
        high = scaling.original_max_len / scaling.high_freq_factor
        wavelength = np.float32(2 * math.pi) / inverse
        slowed = np.where(wavelength > low, inverse / np.float32(scaling.factor), inverse)
        smooth = (np.float32(scaling.original_max_len) / wavelength - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * slowed / np.float32(scaling.factor) + smooth * slowed
        medium = (wavelength >= high) & (wavelength <= low)
        return np.where(medium, smoothed, slowed).astype(np.float32)

    def to_json(self, dtype: str) -> dict[str, Any]:
        """The `config.json` of a checkpoint of this shape in `dtype`: the one read with the
        dtype updated, or (for a config made in code) the fields transformers 5 writes."""
        if self.source:
            written = dict(self.source)
            written["dtype"] = dtype
            # vLLM picks its model by `architectures`, where transformers went by `model_type`.
            if not written.get("architectures"):
                written["architectures"] = [self.architecture]
            if "torch_dtype" in written:
                written["torch_dtype"] = dtype
            return written
        family = FAMILIES[self.architecture]
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope = {
                "rope_theta": self.rope_theta,
                "rope_type": "llama3",
                "factor": self.rope_scaling.factor,
                "low_freq_factor": self.rope_scaling.low_freq_factor,
                "high_freq_factor": self.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": self.rope_scaling.original_max_len,
            }
        written = {
            "architectures": [self.architecture],
            "model_type": family.model_type,
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_len,
            "rms_norm_eps": self.rms_eps,
            "rope_parameters": rope,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tied,
            "dtype": dtype,
        }
        if family.model_type in ("llama", "qwen3"):
            written["attention_bias"] = self.qkv_bias
        if family.model_type == "llama":
            written["mlp_bias"] = False
        if family.model_type in ("mistral", "qwen2", "qwen3"):
            written["sliding_window"] = None
        return written


def read_config(folder: Path) -> tuple[HFConfig, str | None]:
    """The config of the checkpoint in `folder`, and the dtype its `config.json` names (None
    when it names none).

    Raises:
        ValueError: naming the folder when it has no `config.json`, or `config.json` and the
            field it cannot take: not JSON, an unsupported architecture (listing the supported
            ones), a sliding window, experts, quantized weights, another RoPE scaling or
            activation, RoPE fields that disagree, a size out of bounds.
    """
    path = folder / CONFIG
    if not folder.is_dir():
        raise ValueError(
            f"{folder} is not a folder (a checkpoint is a folder with {CONFIG}, or a .gguf file)"
        )
    if not path.is_file():
        raise ValueError(f"{folder} has no {CONFIG}: not a Hugging Face checkpoint folder")
    try:
        data = read_document(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} cannot be read as JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    try:
        return _parse(data), _named_dtype(data)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}: {error}") from None


def _named_dtype(data: Mapping[str, Any]) -> str | None:
    named = data.get("dtype", data.get("torch_dtype"))
    return named if isinstance(named, str) else None


def _field(
    data: Mapping[str, Any], name: str, kind: type, default: Any = attrs.NOTHING, *, low: int = 1
) -> Any:
    """`data[name]`, which must be of `kind` (an int counts as a float): an int at least `low`,
    a float positive and finite (every size and float `config.json` holds is one), checked
    here so that a bad value is refused by the file's own field name.
    """
    if name not in data or data[name] is None:
        if default is attrs.NOTHING:
            raise ValueError(f"field {name} is missing")
        return default
    value = data[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"field {name} must be {kind.__name__}, got {value!r}")
    if kind is int and value < low:
        raise ValueError(f"field {name} must be an int >= {low}, got {value!r}")
    if kind is float and not (math.isfinite(value) and value > 0):
        raise ValueError(f"field {name} must be a positive finite number, got {value!r}")
    return value


def _architecture_of(data: Mapping[str, Any]) -> Any:
    """`architectures`' one entry; where the field is absent, null or empty, the architecture
    of `model_type` (as transformers' Auto classes find the model)."""
    architectures = data.get("architectures")
    if architectures is None or architectures == []:
        model_type = data.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"field architectures is missing and field model_type {model_type!r} is not "
                f"one dew computes ({', '.join(MODEL_TYPES)}); dew computes {', '.join(FAMILIES)}"
            )
        return MODEL_TYPES[model_type]
    if not (isinstance(architectures, list) and len(architectures) == 1):
        raise ValueError(
            f"field architectures must list one architecture, got {architectures!r}; dew "
            f"computes {', '.join(FAMILIES)}"
        )
    return architectures[0]


def _parse(data: Mapping[str, Any]) -> HFConfig:
    architecture = _architecture_of(data)
    experts = [name for name in _EXPERT_FIELDS if data.get(name)]
    if experts:
        raise ValueError(
            f"field {experts[0]}: mixture-of-experts models are not supported; dew computes "
            f"the dense {', '.join(FAMILIES)}"
        )
    if architecture not in FAMILIES:
        raise ValueError(
            f"field architectures: {architecture!r} is not supported; dew computes "
            f"{', '.join(FAMILIES)}"
        )
    family = FAMILIES[architecture]
    quantization = data.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ValueError(
            f"field quantization_config: quantized weights ({method!r}) are not supported; "
            "dew loads float32, bfloat16 and float16 weights"
        )
    max_len = _field(data, "max_position_embeddings", int, low=2)
    _refuse_sliding_window(data, family, max_len)
    activation = data.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"field hidden_act must be 'silu' (SwiGLU), got {activation!r}")
    if data.get("mlp_bias"):
        raise ValueError("field mlp_bias: MLP biases are not supported")
    hidden = _field(data, "hidden_size", int)
    heads = _field(data, "num_attention_heads", int)
    kv_heads = _field(data, "num_key_value_heads", int, heads)
    if heads % kv_heads:
        raise ValueError(
            f"field num_attention_heads {heads} must divide by field num_key_value_heads {kv_heads}"
        )
    head_dim = _head_dim(data, hidden, heads)
    theta, scaling = _rope(data, max_len)

    def flag(setting: bool | str) -> bool:
        return setting if isinstance(setting, bool) else _field(data, setting, bool, False)

    return HFConfig(
        architecture=architecture,
        vocab=_field(data, "vocab_size", int),
        hidden=hidden,
        intermediate=_field(data, "intermediate_size", int),
        layers=_field(data, "num_hidden_layers", int),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_len=max_len,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_eps=_field(data, "rms_norm_eps", float, 1e-6),
        qkv_bias=flag(family.qkv_bias),
        o_bias=flag(family.o_bias),
        qk_norm=family.qk_norm,
        tied=_field(data, "tie_word_embeddings", bool, False),
        source=dict(data),
    )


def _head_dim(data: Mapping[str, Any], hidden: int, heads: int) -> int:
    """Each head's width: `head_dim`, else `hidden_size // num_attention_heads` (as
    `transformers` computes it); even, as RoPE rotates pairs."""
    if data.get("head_dim") is None:
        head_dim, named = hidden // heads, f"hidden_size {hidden} // num_attention_heads {heads}"
    else:
        head_dim, named = _field(data, "head_dim", int, low=2), "field head_dim"
    if head_dim < 2 or head_dim % 2:
        raise ValueError(
            f"{named} = {head_dim}: each head's width must be even and at least 2 (RoPE "
            "rotates pairs)"
        )
    return head_dim


def _refuse_sliding_window(data: Mapping[str, Any], family: _Family, max_len: int) -> None:
    """A window that never cuts (none, or one at least the context) is full attention.

    Where the family has no switch (Llama, Mistral), `use_sliding_window: false` does not turn
    a window off: transformers' Mistral applies the window all the same.
    """
    layer_types = data.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise ValueError(f"field layer_types must be a list, got {layer_types!r}")
    if any(kind != "full_attention" for kind in layer_types):
        others = sorted({str(kind) for kind in layer_types} - {"full_attention"})
        raise ValueError(
            f"field layer_types: {others} layers are not supported, only full attention"
        )
    if family.window_switch and data.get("use_sliding_window") is True:
        raise ValueError("field use_sliding_window: sliding-window attention is not supported")
    window = data.get("sliding_window")
    uses_window = data.get("use_sliding_window", False) if family.window_switch else True
    if uses_window and window is not None:
        if not isinstance(window, int) or isinstance(window, bool):
            raise ValueError(f"field sliding_window must be int or null, got {window!r}")
        if window < max_len:
            raise ValueError(
                f"field sliding_window: a window of {window} < max_position_embeddings "
                f"{max_len} (sliding-window attention) is not supported"
            )


def _rope(data: Mapping[str, Any], max_len: int) -> tuple[float, Llama3Scaling | None]:
    """RoPE's theta and scaling as transformers reads them: from `rope_scaling` (older
    releases) where it is a non-empty object, else from `rope_parameters` (transformers 5);
    theta from that object, else `rope_theta`, else 10000.

    A `config.json` with both objects (a transformers 5 config a user added `rope_scaling` to,
    as model cards say to for long contexts) is refused where they disagree: transformers then
    reads `rope_scaling` alone, with the default theta unless `rope_theta` is beside it, which
    is rarely what was meant.
    """
    objects = {}
    for where in ("rope_scaling", "rope_parameters"):
        rope = data.get(where)
        if not (rope is None or isinstance(rope, dict)):
            raise ValueError(f"field {where} must be an object or null, got {rope!r}")
        objects[where] = rope or {}
    if objects["rope_scaling"] and objects["rope_parameters"]:
        read = _rope_of(data, "rope_scaling", objects["rope_scaling"], max_len)
        written = _rope_of(data, "rope_parameters", objects["rope_parameters"], max_len)
        if read != written:
            raise ValueError(
                f"fields rope_scaling {objects['rope_scaling']} and rope_parameters "
                f"{objects['rope_parameters']} disagree: transformers reads rope_scaling "
                f"alone (RoPE theta {read[0]}, scaling {read[1]}), not rope_parameters' "
                f"(theta {written[0]}, scaling {written[1]}); keep one of the two fields"
            )
        return read
    if objects["rope_scaling"]:
        return _rope_of(data, "rope_scaling", objects["rope_scaling"], max_len)
    return _rope_of(data, "rope_parameters", objects["rope_parameters"], max_len)


def _rope_of(
    data: Mapping[str, Any], where: str, rope: Mapping[str, Any], max_len: int
) -> tuple[float, Llama3Scaling | None]:
    """RoPE's theta and scaling from the object `data[where]`."""
    nested = sorted(key for key, value in rope.items() if isinstance(value, dict))
    if nested:
        raise ValueError(
            f"field {where}: RoPE parameters per layer type {nested} are not supported"
        )
    theta = _field(rope, "rope_theta", float, _field(data, "rope_theta", float, 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    # transformers moves a top-level partial_rotary_factor into the RoPE parameters.
    for field, partial in (
        (f"{where}.partial_rotary_factor", rope.get("partial_rotary_factor")),
        ("partial_rotary_factor", data.get("partial_rotary_factor")),
    ):
        if partial not in (None, 1, 1.0):
            raise ValueError(f"field {field}: partial RoPE ({partial!r}) is not supported")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(
            f"field {where}: RoPE type {kind!r} is not supported, only 'default' and 'llama3'"
        )
    try:
        factors = [_field(rope, name, float) for name in _LLAMA3_FACTORS]
        own = _field(rope, "original_max_position_embeddings", int, max_len)
    except ValueError as error:
        raise ValueError(f"{where}'s {error}") from None
    # transformers takes a top-level original_max_position_embeddings over the scaling's own,
    # and max_position_embeddings where neither is given.
    original = _field(data, "original_max_position_embeddings", int, own)
    try:
        return theta, Llama3Scaling(*factors, original_max_len=original)
    except ValueError as error:
        raise ValueError(f"{where}'s {error}") from None


def check_dtype(dtype: str) -> str:
    """`dtype`, one of the params' dtypes dew trains (float32, bfloat16)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    return dtype
