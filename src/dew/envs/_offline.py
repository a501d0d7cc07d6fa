"""Other packages' environments, kept offline: what they would download is refused by name.

verifiers tasksets load Hugging Face datasets, and textarena's word games call nltk's
downloader, which reaches the network even for data already in place (it fetches its index
first). Inside `no_downloads()`, in every thread, Hugging Face's datasets and hub are offline
(`HF_DATASETS_OFFLINE`, `HF_HUB_OFFLINE`) and `nltk.download` answers from the data in place:
True for a package nltk finds, else a `ValueError` naming it and how to install it. Nested and
concurrent uses share one guard, lifted when the last ends.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_HF = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
# Where nltk keeps each kind of package (`nltk.data.find` wants the path, `download` the id).
_KINDS = ("corpora", "taggers", "tokenizers", "chunkers", "models", "stemmers", "misc")

_lock = threading.Lock()
_users = 0
_saved: dict[str, object] = {}


def nltk_has(package: str) -> bool:
    """Whether nltk finds data package `package` (e.g. `words`) in `nltk.data.path`."""
    import nltk

    for kind in _KINDS:
        for suffix in ("", ".zip"):
            try:
                nltk.data.find(f"{kind}/{package}{suffix}")
                return True
            except LookupError:
                pass
    return False


def _download(info_or_id=None, *args, **kwargs) -> bool:
    """`nltk.download` offline: the data in place, or a refusal naming the package."""
    if isinstance(info_or_id, str) and nltk_has(info_or_id):
        return True
    raise ValueError(
        f"nltk data {info_or_id!r} is not installed and dew runs offline: install it with "
        f"`python -m nltk.downloader {info_or_id}` (or point NLTK_DATA at a folder holding it)"
    )


@contextlib.contextmanager
def no_downloads() -> Iterator[None]:
    """Refuse downloads while inside (see the module)."""
    global _users
    with _lock:
        if _users == 0:
            _saved.update({name: os.environ.get(name) for name in _HF})
            os.environ.update(dict.fromkeys(_HF, "1"))
            with contextlib.suppress(ImportError):
                import nltk

                _saved["nltk"] = nltk.download
                nltk.download = _download
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                for name in _HF:
                    value = _saved.pop(name)
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
                if "nltk" in _saved:
                    import nltk

                    nltk.download = _saved.pop("nltk")
