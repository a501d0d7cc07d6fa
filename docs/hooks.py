"""The docs build's hook (mkdocs.yml `hooks:`): serve MathJax from the site itself.

The pages' formulas (pymdownx.arithmatex leaves them as `\\(...\\)` and `\\[...\\]` spans) are
typeset in the reader's browser by MathJax, which the site must carry: loaded from a CDN they
read as raw LaTeX offline, and a reader behind a firewall never sees them typeset. MathJax's
files come from a Python package of the docs extra, `jupyter-server-mathjax` (MathJax 2.7,
which the Jupyter server serves the same way); after each build they are copied into the site
under `assets/mathjax/`, where docs/javascripts/mathjax.js configures them.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from mkdocs.exceptions import PluginError

PACKAGE = "jupyter_server_mathjax"
SERVED = "assets/mathjax"
"""Where in the site MathJax's files go: mkdocs.yml's extra_javascript loads MathJax.js there."""


def mathjax_files() -> Path:
    """The installed package's folder of MathJax files; found without importing the package,
    whose own import starts on the Jupyter server it extends."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PluginError(
            f"the docs need MathJax from the package {PACKAGE.replace('_', '-')}: "
            "pip install -e '.[docs]'"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "static"


def on_pre_build(config, **kwargs) -> None:
    mathjax_files()  # a missing package is named before the pages are built, not after


def on_post_build(config, **kwargs) -> None:
    shutil.copytree(mathjax_files(), Path(config["site_dir"]) / SERVED, dirs_exist_ok=True)
