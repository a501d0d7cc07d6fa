"""Why a verifiers taskset package does not load, in one line with the real cause first.

verifiers' own loader says "not found" for a package whose own import fails (a dependency of
its own missing: the package is installed, its `No module named ...` was hidden behind "is not
installed"), and raises an AttributeError traceback for a package written for its older API (no
`__all__` exporting a `vf.Taskset`). `taskset_class` resolves the taskset's class as verifiers
does and says which of these it is. `_import_verifiers` is verifiers itself, or one line saying
how to install it (or that the installed release is one dew does not run).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

from dew.envs._releases import check_release


def _module(name: str) -> str:
    """The module verifiers imports for taskset id `name` (a hub id's `owner/` and `@version`
    dropped, dashes as underscores)."""
    return name.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def taskset_class(name: str) -> type[Any]:
    """The `vf.Taskset` subclass of taskset package `name`.

    Raises:
        ImportError: naming the package to install when it is not installed, or the module
            its own import misses (or the error it raises) when it is.
        ValueError: naming the package and verifiers' API when it exports no `vf.Taskset`
            (a package for verifiers' older API).
    """
    import verifiers
    from verifiers.v1.utils import loaders

    try:
        return loaders.taskset_class(name)
    except ModuleNotFoundError as error:
        missing = error.__cause__ if isinstance(error.__cause__, ModuleNotFoundError) else error
        module = _module(name)
        if missing.name is not None and missing.name.split(".")[0] not in (module, "verifiers"):
            raise ImportError(
                f"verifiers environment {name!r} does not import: No module named "
                f"{missing.name!r}, which its package imports (install it)"
            ) from error
        raise ImportError(
            f"verifiers environment {name!r} is not installed: install its taskset package (a "
            f"package named {module!r} exporting a vf.Taskset)"
        ) from error
    except (AttributeError, TypeError) as error:
        raise ValueError(
            f"verifiers environment {name!r} is not a taskset package of the verifiers API dew "
            f"runs (verifiers.v1, verifiers {verifiers.__version__} installed; a package for "
            f"an older API, with load_environment(), is not one): {error}"
        ) from None
    except Exception as error:
        spec = importlib.util.find_spec(_module(name))
        where = f" ({spec.origin})" if spec is not None and spec.origin else ""
        raise ImportError(
            f"verifiers environment {name!r} does not import{where}: "
            f"{type(error).__name__}: {error}"
        ) from error


def _import_verifiers():
    try:
        check_release("verifiers")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            "verifiers environments need the verifiers package: pip install 'dew[verifiers]'"
        ) from None
    import verifiers.v1 as vf

    return vf
