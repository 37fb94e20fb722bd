"""What a video becomes in Qwen3.5, decided from its metadata alone: the sampled frames, the
resized frame size, the patch grid and the timestamp of each temporal group.

Legend: n = frames sampled, T = temporal_patch_size (2), a *temporal group* = T consecutive
sampled frames, which the vision tower's Conv3d patch embedding fuses into one grid of patches.

The rules are those of transformers' `Qwen3VLVideoProcessor` and `Qwen3VLProcessor` (5.x), the
processor Qwen3.5 checkpoints name:

* sampling: ``n = int(total_frames / native_fps * fps)``, clamped to
  ``[min_frames, min(max_frames, total_frames)]``; frame indices ``linspace(0, total - 1, n)``
  rounded (numpy's round half to even). With ``do_sample_frames`` false every frame is used.
  An odd n is padded to a multiple of T by repeating the last index.
* size: qwen3_vl's ``smart_resize(n, height, width, temporal_factor=T, factor=patch * merge,
  min_pixels, max_pixels)``: the pixel bounds apply to all n frames together. With
  ``cap_pixels_per_frame`` the bound per frame is capped as that processor does.
* grid: ``(ceil(n / T), height / patch, width / patch)``; each group holds
  ``h * w / merge**2`` placeholder tokens.
* timestamps: frame index / native_fps, averaged over each group's T frames.

`VideoSettings` holds every field from the checkpoint's video_preprocessor_config.json (the
class defaults of `Qwen3VLVideoProcessor` where the file has none), with the job's
`data.video` keys on top. `tests/test_video.py` checks sampling, size and timestamps against
transformers' own functions.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    Qwen3VLVideoProcessor,
    smart_resize,
)

from vlmcp.data.video import VideoMeta, VideoSource
from vlmcp.errors import VideoConfigError

logger = logging.getLogger(__name__)

#: video_preprocessor_config.json fields that shape sampling and geometry.
_GEOMETRY_FIELDS = ("patch_size", "temporal_patch_size", "merge_size", "fps", "min_frames",
                    "max_frames", "do_sample_frames", "cap_pixels_per_frame", "max_video_tokens",
                    "do_resize", "resample")
#: Fields that normalise frame pixels, handed to the frame image processor.
FRAME_FIELDS = ("image_mean", "image_std", "do_rescale", "rescale_factor", "do_normalize",
                "do_convert_rgb")
#: Fields that name classes or only steer transformers' own batching and output.
_INERT_FIELDS = {"video_processor_type", "processor_class", "image_processor_type",
                 "return_metadata", "return_tensors", "data_format", "input_data_format",
                 "device", "default_to_square", "video_metadata", "do_center_crop", "crop_size",
                 "do_pad"}
#: The pixel bounds and the `size` keys they come from. Top-level min_pixels/max_pixels fields are
#: not read: transformers' Qwen3VLVideoProcessor (5.x) takes its bounds from `size` alone (only the
#: Qwen2-VL video processor lets those fields override `size`).
_PIXEL_EDGES = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}
#: `data.video` keys that override a field of the file (the pixel bounds as min/max_pixels).
OVERRIDE_KEYS = ("fps", "min_frames", "max_frames", "min_pixels", "max_pixels")


@dataclass(frozen=True)
class VideoSettings:
    """How videos are sampled, sized and normalised (see the module docstring).

    frame_kwargs: the normalisation fields (`FRAME_FIELDS`) for the frame image processor.
    frame_list_fps: native fps of frame-list videos without a record-level "fps" (None: such a
    record is an error). on_timestamp_mismatch: "error" or "warn", for a tokens-format record
    whose ``<t seconds>`` texts are not the timestamps of this plan (`data.video`).
    """

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    fps: float
    min_frames: int
    max_frames: int
    do_sample_frames: bool
    min_pixels: int
    max_pixels: int
    cap_pixels_per_frame: bool
    max_video_tokens: int
    do_resize: bool
    resample: int
    frame_kwargs: dict[str, Any]
    frame_list_fps: float | None = None
    on_timestamp_mismatch: str = "error"

    @property
    def factor(self) -> int:
        """Pixels per merged patch side: patch_size * merge_size."""
        return self.patch_size * self.merge_size


#: Class defaults of fields that transformers releases before 5.22 do not have (no cap then).
_LATER_DEFAULTS = {"cap_pixels_per_frame": False, "max_video_tokens": 768}


def _default(name: str) -> Any:
    """The `Qwen3VLVideoProcessor` class default of a field."""
    value = getattr(Qwen3VLVideoProcessor, name, _LATER_DEFAULTS.get(name))
    return _LATER_DEFAULTS[name] if value is None and name in _LATER_DEFAULTS else value


def video_settings(config: dict[str, Any], overrides: dict[str, Any] | None = None,
                   frame_list_fps: float | None = None,
                   on_timestamp_mismatch: str = "error") -> VideoSettings:
    """`VideoSettings` from a video_preprocessor_config.json dict and the job's `data.video`
    overrides (`OVERRIDE_KEYS`; None values are not overrides). Pixel bounds come from `size`
    ({"shortest_edge", "longest_edge"}; the class default where the file has none), as in
    transformers' Qwen3VLVideoProcessor; top-level min_pixels/max_pixels fields are ignored with
    a warning, as that processor ignores them. Raises VideoConfigError for a field vlmcp cannot
    honour (a fixed ``num_frames``) and for a `size` without both bounds; logs a warning per
    unknown field."""
    if config.get("num_frames") is not None:
        raise VideoConfigError("video_preprocessor_config.json sets num_frames; vlmcp samples "
                               "by fps only (set fps, or data.video.fps)")
    known = set(_GEOMETRY_FIELDS) | set(FRAME_FIELDS) | _INERT_FIELDS | {
        "size", "min_pixels", "max_pixels", "num_frames"}
    for name in sorted(set(config) - known):
        logger.warning("video_preprocessor_config.json field %r is not used by vlmcp", name)
    values = {name: config.get(name, _default(name)) for name in _GEOMETRY_FIELDS}
    size = config.get("size")
    size = dict(_default("size")) if size is None else size
    if not isinstance(size, dict):
        raise VideoConfigError(f"size must be an object {{shortest_edge, longest_edge}}, got "
                               f"{size!r}")
    for name, edge in _PIXEL_EDGES.items():
        if name in config:
            logger.warning("video_preprocessor_config.json field %r (%s) is ignored, as "
                           "transformers' Qwen3VLVideoProcessor ignores it: the pixel bounds "
                           "come from size[%r] (%s); data.video.%s sets them", name,
                           config[name], edge, size.get(edge), name)
    pixels = {name: size.get(edge) for name, edge in _PIXEL_EDGES.items()}
    for key, value in (overrides or {}).items():
        if key not in OVERRIDE_KEYS:
            raise VideoConfigError(f"unknown video setting {key!r}")
        if value is not None:
            (pixels if key.endswith("_pixels") else values)[key] = value
    lacking = [f"size[{_PIXEL_EDGES[name]!r}]" for name, value in pixels.items() if value is None]
    if lacking:
        raise VideoConfigError(f"size {size} lacks {' and '.join(lacking)}, which "
                               "Qwen3VLVideoProcessor needs (or set data.video.min_pixels and "
                               "max_pixels)")
    frame_kwargs = {name: config.get(name, _default(name)) for name in FRAME_FIELDS}
    settings = VideoSettings(
        patch_size=int(values["patch_size"]),
        temporal_patch_size=int(values["temporal_patch_size"]),
        merge_size=int(values["merge_size"]), fps=float(values["fps"]),
        min_frames=int(values["min_frames"]), max_frames=int(values["max_frames"]),
        do_sample_frames=bool(values["do_sample_frames"]),
        min_pixels=int(pixels["min_pixels"]), max_pixels=int(pixels["max_pixels"]),
        cap_pixels_per_frame=bool(values["cap_pixels_per_frame"]),
        max_video_tokens=int(values["max_video_tokens"]), do_resize=bool(values["do_resize"]),
        resample=int(values["resample"]), frame_kwargs=frame_kwargs,
        frame_list_fps=frame_list_fps, on_timestamp_mismatch=on_timestamp_mismatch)
    problems = [f"{name} must be > 0, got {getattr(settings, name)}"
                for name in ("fps", "min_frames", "max_frames", "max_pixels", "patch_size",
                             "temporal_patch_size", "merge_size") if getattr(settings, name) <= 0]
    if settings.min_frames > settings.max_frames:
        problems.append(f"min_frames {settings.min_frames} > max_frames {settings.max_frames}")
    if settings.min_pixels > settings.max_pixels:
        problems.append(f"min_pixels {settings.min_pixels} > max_pixels {settings.max_pixels}")
    if problems:
        raise VideoConfigError("video settings: " + "; ".join(problems))
    return settings


def sample_indices(total_frames: int, native_fps: float, settings: VideoSettings) -> list[int]:
    """Indices of the frames sampled from a video of `total_frames` frames at `native_fps`,
    ascending, before padding to a multiple of T."""
    if not settings.do_sample_frames:
        return list(range(total_frames))
    wanted = total_frames / native_fps * settings.fps
    if not math.isfinite(wanted):
        raise ValueError(f"{total_frames} frames at {native_fps:g} fps last longer than any "
                         "sampling can count")
    count = int(wanted)
    count = min(max(count, settings.min_frames), settings.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()


def padded(indices: list[int], temporal: int) -> list[int]:
    """`indices` padded to a multiple of `temporal` by repeating the last one."""
    return indices + indices[-1:] * (-len(indices) % temporal)


def group_timestamps(indices: list[int], native_fps: float, temporal: int) -> list[float]:
    """Seconds of each temporal group: the mean of its first and last frame's index / fps
    (`indices` padded like the frames)."""
    stamps = [index / native_fps for index in padded(indices, temporal)]
    return [(stamps[k] + stamps[k + temporal - 1]) / 2 for k in range(0, len(stamps), temporal)]


def resized_size(num_frames: int, height: int, width: int, settings: VideoSettings
                 ) -> tuple[int, int]:
    """(height, width) in pixels every sampled frame is resized to; ValueError where
    transformers' processor would reject the video."""
    if not settings.do_resize:
        if height % settings.factor or width % settings.factor:
            raise ValueError(f"{width}x{height} is not a multiple of patch_size * merge_size "
                             f"{settings.factor} and the video processor does not resize")
        return height, width
    max_pixels = settings.max_pixels
    if settings.cap_pixels_per_frame:
        frame_cap = settings.max_video_tokens * settings.factor**2
        per_frame = max(min(frame_cap, settings.max_pixels // num_frames),
                        int(settings.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    return smart_resize(num_frames, height, width, temporal_factor=settings.temporal_patch_size,
                        factor=settings.factor, min_pixels=settings.min_pixels,
                        max_pixels=max_pixels)


@dataclass(frozen=True)
class VideoPlan:
    """One video as the model will see it, from its metadata alone.

    indices:    the frames to decode, padded to groups * T (the last sampled one repeated).
    sampled:    n, the frames sampled before padding.
    height, width: the size (pixels) every frame is resized to.
    grid:       (groups, h, w) patch grid: `video_grid_thw`'s row.
    timestamps: seconds of each group, as the prompt shows them.
    """

    source: VideoSource
    meta: VideoMeta
    indices: tuple[int, ...]
    sampled: int
    height: int
    width: int
    grid: tuple[int, int, int]
    timestamps: tuple[float, ...]

    def tokens_per_group(self, merge_size: int) -> int:
        """Placeholder tokens of one temporal group: h * w // merge**2."""
        return self.grid[1] * self.grid[2] // merge_size**2

    def kept(self, groups: int) -> VideoPlan:
        """The plan of the video's first `groups` temporal groups (a truncation between groups):
        the same frame size, fewer frames."""
        temporal = len(self.indices) // self.grid[0]
        return replace(self, indices=self.indices[:groups * temporal],
                       sampled=min(self.sampled, groups * temporal),
                       grid=(groups, *self.grid[1:]), timestamps=self.timestamps[:groups])


def plan_video(video: VideoSource, meta: VideoMeta, settings: VideoSettings) -> VideoPlan:
    """The `VideoPlan` of a video with metadata `meta`; ValueError where transformers' processor
    would reject it (fewer than T frames sampled, an aspect ratio over 200, ...)."""
    indices = sample_indices(meta.total_frames, meta.native_fps, settings)
    temporal = settings.temporal_patch_size
    if len(indices) < temporal:
        raise ValueError(f"{len(indices)} frame(s) sampled, Qwen3.5 needs at least "
                         f"temporal_patch_size {temporal}")
    height, width = resized_size(len(indices), meta.height, meta.width, settings)
    groups = math.ceil(len(indices) / temporal)
    grid = (groups, height // settings.patch_size, width // settings.patch_size)
    return VideoPlan(video, meta, tuple(padded(indices, temporal)), len(indices), height, width,
                     grid, tuple(group_timestamps(indices, meta.native_fps, temporal)))
