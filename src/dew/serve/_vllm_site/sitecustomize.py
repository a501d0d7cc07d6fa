"""Imported by every Python process of a vLLM server dew starts (its folder leads PYTHONPATH).

vLLM's CPU build pulls in torchvision/torchaudio/torchcodec builds that cannot load beside torch's
CPU release, and vLLM imports them in each process it spawns (the model inspector, the engine
core), not only in the one dew starts: each process hides them first (`dew._torch_media`).

The server process itself (the one whose parent is `DEW_VLLM_PARENT`) also asks Linux to send it
SIGTERM when that parent ends, so that not even a killed dew leaves a server behind. It is done
here rather than between fork and exec in dew: a fork that runs Python code there is unsafe in a
process running JAX's threads.
"""

import os

from dew._torch_media import hide_broken_media_packages

hide_broken_media_packages()

_parent = os.environ.pop("DEW_VLLM_PARENT", None)  # vLLM's own processes do not inherit it
if _parent is not None:
    import ctypes
    import signal
    import sys

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(_parent):  # dew ended before the request: end too
        sys.exit(1)
