"""A small byte-level BPE tokenizer trained in the test session, so nothing is downloaded."""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SENTENCES = [
    "what is 6 x 7? the answer is 42",
    "count to three: 1 2 3",
    "the cat sat on the mat, and the dog sat on the log",
    "hello world, hello there",
    "user assistant system",
]
SPECIALS = ["<bos>", "<|im_start|>", "<|im_end|>"]


def train_bpe(path: Path, *, specials=SPECIALS, vocab_size: int = 320) -> Path:
    """Train a byte-level BPE tokenizer on `SENTENCES` with `specials` as its special tokens and
    save it at `path` (a tokenizer.json); every byte has a token, so any text encodes."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SENTENCES, trainer)
    tokenizer.save(str(path))
    return path
