"""Image files for tests: random RGB PNGs of a given size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def save_png(path: Path, width: int, height: int, seed: int = 0) -> Path:
    """Write a random RGB PNG of width x height."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path
