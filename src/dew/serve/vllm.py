"""vLLM as dew's engine: servers started on loopback or attached by URL, token ids in and out,
weight pushes into every server, each call versioned by the weights that drew it.

See docs/vllm.md.
"""

from dew.serve._failure import CallFailed
from dew.serve._vllm import VLLMEngine
from dew.serve._vllm_process import SERVER_ENVIRONMENT, ServerProcess, VLLMError

__all__ = ["SERVER_ENVIRONMENT", "CallFailed", "ServerProcess", "VLLMEngine", "VLLMError"]
