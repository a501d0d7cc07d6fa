"""Serving: an in-process JAX sampling engine and a byte-level tokenizer with a chat template."""

from dew.serve import tokenizer
from dew.serve._engine import EngineStats, RolloutServer, sample
from dew.serve._served import ServedSource

__all__ = ["EngineStats", "RolloutServer", "ServedSource", "sample", "tokenizer"]
