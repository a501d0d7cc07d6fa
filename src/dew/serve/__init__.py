"""Serving: an in-process JAX sampling engine, the sampling settings every engine takes, and
tokenizers with their chat templates."""

from dew.serve import chat_template, tokenizer
from dew.serve._draw import sample
from dew.serve._engine import EngineStats, RolloutServer
from dew.serve._failure import CallFailed
from dew.serve._sampling import Sampling
from dew.serve._served import ServedSource

__all__ = [
    "CallFailed",
    "EngineStats",
    "RolloutServer",
    "Sampling",
    "ServedSource",
    "chat_template",
    "sample",
    "tokenizer",
]
