"""Treat torch's vision, audio and codec packages as absent when they cannot load.

vLLM's CPU build depends on `torchvision`, `torchaudio` and `torchcodec`, and the package
registry serves builds of them made for torch's CUDA release: beside torch's CPU release their
compiled parts fail to load ("operator torchvision::nms does not exist"). `transformers` and vLLM
import them whenever they are installed, so a text model could not be loaded at all. Text models
need none of them: a package that fails to import is recorded in `sys.modules` as absent, which
makes `importlib.util.find_spec` (how both libraries ask) answer that it is not installed.
"""

import importlib
import sys

MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def hide_broken_media_packages() -> list[str]:
    """Mark each of `MEDIA_PACKAGES` that is installed but fails to import as not installed.

    Call it before importing `transformers` or vLLM. Returns the names it hid.
    """
    hidden = []
    for name in MEDIA_PACKAGES:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # not installed: nothing to hide
        except (RuntimeError, OSError):
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
    return hidden
