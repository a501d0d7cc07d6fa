"""The small files a user points dew at (a `--config` TOML or JSON file, a run folder's
`config.json`, a checkpoint's `config.json`, index and tokenizer config), read within bounds.

Such a file is kilobytes, a checkpoint's index or tokenizer config a few megabytes. A path to
something else (`/dev/zero`, a log, a tensor file) must be refused, not read until memory runs
out; and a document nested deeper than the parser's recursion allows (a TOML array 100,000
deep) must be refused, not end in a RecursionError's traceback. Traces are bounded likewise, a
line at a time (`dew.replay.MAX_LINE`).
"""

from __future__ import annotations

import json
import os
import tomllib
from typing import Any

MAX_BYTES = 64 * 2**20
"""The most bytes read of one such file: past it the file is refused (the largest real one, a
big checkpoint's safetensors index or tokenizer config, is about a tenth of it)."""


def read_text(path: str | os.PathLike, *, limit: int = MAX_BYTES) -> str:
    """The UTF-8 text of the file at `path`, read to at most `limit` bytes.

    Raises:
        OSError: as `open` raises it.
        ValueError: (the message without the path, for the caller to name it) when the file
            holds more than `limit` bytes or is not UTF-8.
    """
    with open(path, "rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"it holds more than {limit} bytes, more than any such file (is it one?)")
    return data.decode("utf-8")


def read_document(path: str | os.PathLike, *, toml: bool = False) -> Any:
    """The JSON (or, with `toml`, TOML) value of the file at `path`, read within `MAX_BYTES`.

    Raises:
        OSError: as `open` raises it.
        ValueError: (the message without the path) for a file too long, not UTF-8, not JSON or
            TOML, or nested too deep to parse.
    """
    text = read_text(path)
    try:
        return tomllib.loads(text) if toml else json.loads(text)
    except RecursionError:
        raise ValueError("it is nested too deep to read (past Python's recursion limit)") from None
