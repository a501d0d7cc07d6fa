"""vLLM as dew's engine: servers started on loopback or attached by URL, token ids in and out,
weight pushes into every server, each call versioned by the weights that drew it.

See docs/vllm.md.
"""

from dew.serve._failure import CallFailed
from dew.serve._vllm import VLLMEngine
from dew.serve._vllm_nccl import NCCL_SERVER_FLAGS, NCCLPublisher
from dew.serve._vllm_process import SERVER_ENVIRONMENT, ServerProcess, VLLMError, free_port

__all__ = [
    "NCCL_SERVER_FLAGS",
    "SERVER_ENVIRONMENT",
    "CallFailed",
    "NCCLPublisher",
    "ServerProcess",
    "VLLMEngine",
    "VLLMError",
    "free_port",
]
