"""The small transformer: config validation and the packed-attention guarantees the objective
relies on (segments isolated, causal, padding inert, positions restarting per segment)."""

import functools

import jax
import numpy as np
import pytest

from dew import models

CONFIG = models.TransformerConfig(vocab=32, d_model=32, heads=2, layers=2, d_ff=64, max_len=64)
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def params():
    return models.init(jax.random.key(0), CONFIG)


apply = jax.jit(models.model(CONFIG))


def logits(params, tokens, positions, segment_ids) -> np.ndarray:
    """The model's logits as numpy, for rows given as nested lists or arrays."""
    arrays = (np.asarray(rows, np.int32) for rows in (tokens, positions, segment_ids))
    return np.asarray(apply(params, *arrays))


@pytest.mark.parametrize("field", ["vocab", "d_model", "heads", "layers", "d_ff", "max_len"])
def test_config_refuses_sizes_below_one(field):
    with pytest.raises(ValueError, match=f"{field} must be an int >= 1, got 0"):
        models.TransformerConfig(**{field: 0})


def test_config_refuses_heads_that_do_not_divide_d_model():
    with pytest.raises(ValueError, match="d_model 30 must divide by heads 4"):
        models.TransformerConfig(d_model=30, heads=4)


def test_config_head_dim():
    assert models.TransformerConfig(d_model=48, heads=3).head_dim == 16


def test_logits_shape_and_dtype(params):
    out = logits(params, np.ones((3, 7)), np.zeros((3, 7)), np.ones((3, 7)))
    assert out.shape == (3, 7, CONFIG.vocab)
    assert out.dtype == np.float32


# One row of three segments (lengths 4, 5, 3) and three padding slots.
SEGMENTS = np.array([1] * 4 + [2] * 5 + [3] * 3 + [0] * 3)
POSITIONS = np.concatenate([np.arange(4), np.arange(5), np.arange(3), np.zeros(3, int)])


def test_attention_never_crosses_a_segment(params):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab, SEGMENTS.shape)
    changed = tokens.copy()
    middle = SEGMENTS == 2
    changed[middle] = (tokens[middle] + 1 + rng.integers(0, CONFIG.vocab - 1, middle.sum())) % (
        CONFIG.vocab
    )
    before = logits(params, [tokens], [POSITIONS], [SEGMENTS])[0]
    after = logits(params, [changed], [POSITIONS], [SEGMENTS])[0]
    np.testing.assert_allclose(after[~middle], before[~middle], **TOLERANCE)
    assert not np.allclose(after[middle], before[middle], **TOLERANCE)


def test_attention_is_causal(params):
    rng = np.random.default_rng(1)
    width = 10
    tokens = rng.integers(0, CONFIG.vocab, width)
    changed = tokens.copy()
    changed[6] = (tokens[6] + 1) % CONFIG.vocab
    row = ([np.arange(width)], [np.ones(width)])
    before = logits(params, [tokens], *row)[0]
    after = logits(params, [changed], *row)[0]
    np.testing.assert_allclose(after[:6], before[:6], **TOLERANCE)
    assert not np.allclose(after[6:], before[6:], **TOLERANCE)


def test_padding_does_not_affect_real_tokens(params):
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, CONFIG.vocab, SEGMENTS.shape)
    padding = SEGMENTS == 0
    changed_tokens, changed_positions = tokens.copy(), POSITIONS.copy()
    changed_tokens[padding] = (tokens[padding] + 7) % CONFIG.vocab
    changed_positions[padding] = [5, 9, 2]
    before = logits(params, [tokens], [POSITIONS], [SEGMENTS])[0]
    after = logits(params, [changed_tokens], [changed_positions], [SEGMENTS])[0]
    np.testing.assert_allclose(after[~padding], before[~padding], **TOLERANCE)


@pytest.mark.parametrize("offset", [1, 5, 9])
def test_chain_at_an_offset_scores_as_alone(params, offset):
    rng = np.random.default_rng(offset)
    length, width = 6, 20
    chain = rng.integers(0, CONFIG.vocab, length)
    alone = logits(params, [chain], [np.arange(length)], [np.ones(length)])[0]
    # A different chain fills the row before the offset, padding after the chain.
    tokens = rng.integers(0, CONFIG.vocab, width)
    tokens[offset : offset + length] = chain
    positions = np.zeros(width, int)
    positions[:offset] = np.arange(offset)
    positions[offset : offset + length] = np.arange(length)
    segments = np.zeros(width, int)
    segments[:offset] = 4
    segments[offset : offset + length] = 9
    packed = logits(params, [tokens], [positions], [segments])[0]
    np.testing.assert_allclose(packed[offset : offset + length], alone, **TOLERANCE)


def test_positions_matter(params):
    """The guard on the test above: shifting a chain's positions does change its logits."""
    chain = np.arange(6) % CONFIG.vocab
    ones = [np.ones(6)]
    at_zero = logits(params, [chain], [np.arange(6)], ones)[0]
    shifted = logits(params, [chain], [np.arange(6) + 3], ones)[0]
    assert not np.allclose(at_zero, shifted, **TOLERANCE)


@pytest.mark.parametrize(
    ("max_len", "blocks"),
    [
        (64, [(0, 32), (32, 64)]),
        (256, [(0, 32), (32, 64), (64, 128), (128, 256)]),
        (100, [(0, 32), (32, 64), (64, 100)]),
        (20, [(0, 20)]),
    ],
)
def test_cache_blocks_double_from_32_and_stop_at_max_len(max_len, blocks):
    assert models.cache_blocks(max_len) == blocks


@pytest.mark.medium
def test_decoding_across_cache_blocks_equals_full_recomputation(params):
    """Slots whose positions lie in different blocks, each crossing a block boundary, decode to
    `apply`'s logits over their whole sequences; so every branch of the block-limited attention
    (one block in use, then two) reads what it must and nothing stale."""
    rng = np.random.default_rng(2)
    prefill = jax.jit(functools.partial(models.prefill, config=CONFIG))
    decode = jax.jit(functools.partial(models.decode, config=CONFIG))
    sequences = [rng.integers(0, CONFIG.vocab, 44) for _ in range(3)]
    prompts = (3, 26, 29)  # slot 0 stays in the first block; slots 1 and 2 cross into the second
    cache = models.init_cache(CONFIG, slots=3, max_len=CONFIG.max_len)
    for slot, (sequence, length) in enumerate(zip(sequences, prompts, strict=True)):
        padded = np.zeros(32, np.int32)
        padded[:length] = sequence[:length]
        cache, _ = prefill(params, cache, padded, np.int32(slot))
    full = [
        logits(params, [sequence], [np.arange(len(sequence))], [np.ones(len(sequence))])[0]
        for sequence in sequences
    ]
    position = np.array(prompts, np.int32)
    for _ in range(14):
        tokens = np.array([s[p] for s, p in zip(sequences, position, strict=True)], np.int32)
        cache, step = decode(params, cache, tokens, position)
        for slot in range(3):
            np.testing.assert_allclose(step[slot], full[slot][position[slot]], **TOLERANCE)
        position = position + 1
    assert position.max() > 32 > position.min()
