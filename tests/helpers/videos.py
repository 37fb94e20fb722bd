"""Test videos, written with PyAV: frame k of a clip is a pattern of k (so a test can tell which
frames a loader picked), in any container PyAV writes."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image


def frame_pixels(k: int, width: int, height: int) -> np.ndarray:
    """[height, width, 3] uint8 frame k: flat colour k*9 mod 256 with a bright bar at row k."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:] = ((9 * k) % 256, (5 * k + 40) % 256, 200)
    pixels[k % height] = 255
    return pixels


def write_video(path: Path, frames: int, fps: float | Fraction, width: int = 64,
                height: int = 48, codec: str = "libx264", container: str | None = None) -> Path:
    """A clip of `frames` frames at `fps` (an mp4 by default; mkv/webm report no frame count,
    raw "h264" neither a count nor a duration). libx264rgb and ffv1 are lossless."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rate = Fraction(fps).limit_denominator(100000)
    with av.open(str(path), "w", format=container) as output:
        stream = output.add_stream(codec, rate=rate)
        stream.width, stream.height = width, height
        stream.pix_fmt = {"libx264rgb": "rgb24", "ffv1": "bgr0"}.get(codec, "yuv420p")
        if codec.startswith("libx264"):
            stream.options = {"crf": "0", "preset": "ultrafast"}
        for k in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(k, width, height), format="rgb24")
            output.mux(stream.encode(frame))
        output.mux(stream.encode())
    return path


def write_frames(directory: Path, frames: int, width: int = 64, height: int = 48) -> list[Path]:
    """`frames` PNG frames (the same pattern as `write_video`), in order."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(frames):
        path = directory / f"frame{k:04d}.png"
        Image.fromarray(frame_pixels(k, width, height)).save(path)
        paths.append(path)
    return paths
