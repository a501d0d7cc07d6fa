"""Serving: an in-process JAX sampling engine, and tokenizers with their chat templates."""

from dew.serve import chat_template, tokenizer
from dew.serve._engine import EngineStats, RolloutServer, sample
from dew.serve._failure import CallFailed
from dew.serve._served import ServedSource

__all__ = [
    "CallFailed",
    "EngineStats",
    "RolloutServer",
    "ServedSource",
    "chat_template",
    "sample",
    "tokenizer",
]
