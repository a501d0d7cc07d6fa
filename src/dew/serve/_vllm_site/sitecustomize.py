"""Imported by every Python process of a vLLM server dew starts (its folder leads PYTHONPATH).

vLLM's CPU build pulls in torchvision/torchaudio/torchcodec builds that cannot load beside torch's
CPU release, and vLLM imports them in each process it spawns (the model inspector, the engine
core), not only in the one dew starts: each process hides them first (`dew._torch_media`).
"""

from dew._torch_media import hide_broken_media_packages

hide_broken_media_packages()
