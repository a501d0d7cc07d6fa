"""dew: asynchronous reinforcement learning of language-model agents."""

__version__ = "0.1.0"
