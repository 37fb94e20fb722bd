"""An image's patch grid from its file header, without decoding its pixels.

`Image.open` reads only the header (format, mode, width x height); the pixels are decoded by
`load()`, which is never called here. The grid follows the image processor's own geometry:
with do_resize, `smart_resize` (transformers' function, the one `Qwen2VLImageProcessorPil.resize`
calls) of (height, width) to multiples of patch_size * merge_size within the processor's
{shortest_edge, longest_edge} pixel bounds; then (1, height // patch, width // patch). The PIL
processor always gives t = 1 for an image (temporal_patch_size copies the frame).
`tests/test_stream.py` checks the result against `VLProcessor.process_images` on many sizes.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
    smart_resize,
)

from vlmcp.data.media_paths import is_file
from vlmcp.errors import DataError


def header_size(path: Path, source: str, what: str = "image") -> tuple[int, int]:
    """(width, height) of the image at `path` from its header; DataError naming `source` and
    the file as `what` ("image", "video frame")."""
    if not is_file(path):
        raise DataError(f"{source}: {what} not found: {path}")
    try:
        with Image.open(path) as image:
            return image.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"{source}: cannot decode {what} {path}: {e}") from e


def grid_for_size(width: int, height: int, image_processor: Qwen2VLImageProcessorPil
                  ) -> tuple[int, int, int]:
    """(t, h, w) patch grid the processor gives an image of width x height pixels.

    Raises ValueError where the processor would reject the image (aspect ratio over 200, or,
    without resizing, sides that are not multiples of patch_size * merge_size).
    """
    patch, merge = image_processor.patch_size, image_processor.merge_size
    if image_processor.do_resize:
        size = image_processor.size
        height, width = smart_resize(height, width, factor=patch * merge,
                                     min_pixels=size.shortest_edge, max_pixels=size.longest_edge)
    elif height % (patch * merge) or width % (patch * merge):
        raise ValueError(f"{width}x{height} is not a multiple of patch_size * merge_size "
                         f"{patch * merge} and the processor does not resize")
    return 1, height // patch, width // patch


def header_grid(path: Path, source: str, image_processor: Qwen2VLImageProcessorPil
                ) -> tuple[int, int, int]:
    """(t, h, w) patch grid of the image at `path`, from its header; DataError naming `source`."""
    width, height = header_size(path, source)
    try:
        return grid_for_size(width, height, image_processor)
    except ValueError as e:
        raise DataError(f"{source}: image processor rejects {path}: {e}") from e
