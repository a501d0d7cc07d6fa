"""The run's reward and lag curves, drawn into a PNG by a tiny writer of its own."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from dew.train._checkpoint import _write_atomically

# A 3x5 bitmap font for the plot's labels: each glyph is five rows of three bits, top row first.
_FONT = {
    "0": "75557", "1": "26227", "2": "71747", "3": "71717", "4": "55711", "5": "74717",
    "6": "74757", "7": "71111", "8": "75757", "9": "75717", ".": "00002", "-": "00700",
    " ": "00000", "a": "06357", "d": "13557", "e": "07763", "g": "35316", "l": "22223",
    "p": "07574", "r": "06544", "s": "03636", "t": "27222", "w": "05577",
}  # fmt: skip


def _png(pixels: np.ndarray) -> bytes:
    """Encode uint8[height, width, 3] RGB pixels as a PNG file."""
    height, width, _ = pixels.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels.reshape(height, -1)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
        + chunk(b"IEND", b"")
    )


def _text(canvas: np.ndarray, x: int, y: int, text: str, scale: int = 2) -> None:
    """Draw `text` in the bitmap font, in black, its top-left corner at (x, y)."""
    for char in text:
        glyph = _FONT.get(char, _FONT[" "])
        for row, bits in enumerate(glyph):
            for column in range(3):
                if int(bits, 16) >> (2 - column) & 1:
                    top, left = y + row * scale, x + column * scale
                    canvas[top : top + scale, left : left + scale] = 0
        x += 4 * scale


def _trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Each value's mean with the `window - 1` before it, over the finite ones (NaN if none)."""
    finite = np.isfinite(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(finite)])
    end = np.arange(1, len(values) + 1)
    begin = np.maximum(end - window, 0)
    count = counts[end] - counts[begin]
    return np.where(count > 0, (sums[end] - sums[begin]) / np.maximum(count, 1), np.nan)


def _line(
    canvas: np.ndarray, box: tuple[int, int, int, int], xs: np.ndarray, ys: np.ndarray,
    colour: tuple[int, int, int],
) -> None:  # fmt: skip
    """Draw the polyline through (xs, ys), two pixels thick, clipped to the box; NaNs break it."""
    left, top, right, bottom = box
    finite = np.isfinite(ys)
    for x0, y0, x1, y1, ok in zip(
        xs[:-1], ys[:-1], xs[1:], ys[1:], finite[:-1] & finite[1:], strict=True
    ):
        if not ok:
            continue
        count = int(max(abs(x1 - x0), abs(y1 - y0))) + 2
        px = np.rint(np.linspace(x0, x1, count)).astype(int)
        py = np.rint(np.linspace(y0, y1, count)).astype(int)
        for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
            canvas[np.clip(py + dy, top, bottom), np.clip(px + dx, left, right)] = colour


def _panel(
    canvas: np.ndarray, box: tuple[int, int, int, int], steps: np.ndarray, values: np.ndarray,
    title: str, colour: tuple[int, int, int],
) -> None:  # fmt: skip
    """Plot `values` over `steps` in the box (left, top, right, bottom): each step's value in a
    pale tint, their trailing mean (over a 25th of the run) over it in `colour`; framed, with the
    title and the y range written beside it."""
    left, top, right, bottom = box
    canvas[top : bottom + 1, [left, right]] = 160
    canvas[[top, bottom], left : right + 1] = 160
    finite = np.isfinite(values)
    low, high = (values[finite].min(), values[finite].max()) if finite.any() else (0.0, 1.0)
    if high - low < 1e-9:
        low, high = low - 0.5, high + 0.5
    _text(canvas, left + 6, top + 6, title)
    _text(canvas, 4, top, f"{high:.2f}")
    _text(canvas, 4, bottom - 10, f"{low:.2f}")
    if len(steps) < 2:
        return
    xs = left + (steps - steps.min()) / max(steps.max() - steps.min(), 1) * (right - left)
    smooth = _trailing_mean(values, max(1, len(values) // 25))
    pale = tuple(255 - (255 - c) // 3 for c in colour)
    for series, shade in ((values, pale), (smooth, colour)):
        _line(canvas, box, xs, bottom - (series - low) / (high - low) * (bottom - top), shade)


def write_curves(metrics: str | os.PathLike, path: str | os.PathLike) -> None:
    """Draw the reward (`reward/mean`) and lag of each step of a metrics log into a PNG.

    Two panels over the step axis: reward on top, lag below, each scaled to its own range.
    """
    steps, rewards, lags = [], [], []
    with open(metrics, encoding="utf-8") as log:
        for text in log:
            line = json.loads(text)
            steps.append(line["step"])
            rewards.append(line.get("reward/mean"))
            lags.append(line.get("lag"))

    def array(values: list) -> np.ndarray:
        return np.array([np.nan if v is None else v for v in values], np.float64)

    width, height = 640, 400
    canvas = np.full((height, width, 3), 255, np.uint8)
    steps_array = np.array(steps, np.float64)
    _panel(canvas, (56, 10, 630, 190), steps_array, array(rewards), "reward", (31, 119, 180))
    _panel(canvas, (56, 210, 630, 370), steps_array, array(lags), "lag", (255, 127, 14))
    if steps:
        _text(canvas, 56, 378, f"step {steps[0]}")
        last = f"step {steps[-1]}"
        _text(canvas, 630 - 8 * len(last), 378, last)
    _write_atomically(Path(path), lambda file: file.write(_png(canvas)))
