"""The videos of a data record, and how they appear in its tokens.

A record's videos are ``"videos"``, a list of videos, or ``"video"``, one video (a record with both
is an error). A video is a container path (mp4, mkv, webm, ...) or a non-empty list of frame image
paths in order; so ``"video": ["f0.jpg", "f1.jpg"]`` is one video of two frames and ``"videos":
["a.mp4", ["f0.jpg", "f1.jpg"]]`` two videos. Paths are relative to data.image_root when it is set,
else to the data file's directory. A frame list's native fps is the record's ``"fps"`` (a number for
all its frame lists, or a list with one entry per video, null for containers), else the job's
`data.video.frame_list_fps`. Video placeholders are the ``<video>`` markers of string content and
``{"type": "video"}`` entries of typed content, each taking the next video.

The prompt form (`video_tokens`): the chat template renders a video as
``<|vision_start|><|video_pad|><|vision_end|>``; those three tokens of the rendering become, per
temporal group, the tokens of ``<{t:.1f} seconds>`` (tokenized on their own), then
``<|vision_start|>``, the group's h*w/merge**2 ``<|video_pad|>`` and ``<|vision_end|>``. The
text around the block tokenizes as in the rendering. This is what vLLM's Qwen3-VL processor
does at inference (it matches the block's text and replaces it with those ids) and the form
Qwen's own processor produced in transformers 4.57; transformers 5.x replaces only the pad and
leaves an extra outer vision start/end pair around the groups.

In the tokens format the placeholders are already expanded: every maximal run of
``<|video_pad|>`` is one temporal group, the groups of a video follow one another, the videos in
order.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from vlmcp.data import json_text
from vlmcp.data.media_paths import media_path
from vlmcp.data.processor import VIDEO_PAD, VISION_END, VISION_START, VLProcessor
from vlmcp.errors import DataError
from vlmcp.data.video import VideoSource, probe_video
from vlmcp.data.video_plan import VideoPlan, plan_video

#: How the chat template renders one video, before its groups are spelled out.
VIDEO_BLOCK = VISION_START + VIDEO_PAD + VISION_END


def _fail(source: str, message: str) -> DataError:
    return DataError(f"{source}: {message}")


def _frame_list_fps(record: dict[str, Any], index: int, default: float | None, source: str
                    ) -> tuple[float, str]:
    """(native fps, where it was given) of the record's video `index`, a frame list."""
    fps = record.get("fps")
    where = '"fps"'
    if isinstance(fps, list):
        fps, where = fps[index], f'"fps"[{index}]'
    if fps is None:
        if default is None:
            raise _fail(source, f"video {index} is a frame list and has no frame rate: set "
                                '"fps" in the record or data.video.frame_list_fps in the job')
        return float(default), "data.video.frame_list_fps"
    rate = json_text.finite(fps)
    if rate is None or rate <= 0:
        raise _fail(source, f"{where} must be a number > 0, got {json_text.brief(fps)}")
    return rate, where


def record_videos(record: dict[str, Any], base_dir: Path, source: str,
                  frame_list_fps: float | None) -> list[VideoSource]:
    """The record's videos, in placeholder order (see the module docstring); no file is read."""
    if "video" in record and "videos" in record:
        raise _fail(source, 'both "video" and "videos" are set; use one of them')
    key = "video" if "video" in record else "videos"
    raw = record.get(key, [])
    if key == "video":
        raw = [] if raw is None else [raw]
    if not isinstance(raw, list):
        raise _fail(source, f'"{key}" must be a list of videos (a path, or a list of frame paths)')
    fps = record.get("fps")
    if isinstance(fps, list) and len(fps) != len(raw):
        raise _fail(source, f'"fps" has {len(fps)} entries for {len(raw)} videos')
    videos = []
    for index, item in enumerate(raw):
        if isinstance(item, str) and item:
            if isinstance(fps, list) and fps[index] is not None:
                raise _fail(source, f'"fps"[{index}] must be null: video {index} is a file, '
                                    "whose frame rate is its own")
            where = f'"{key}"[{index}]'
            videos.append(VideoSource(path=media_path(base_dir, item, source, where)))
        elif isinstance(item, list) and all(isinstance(p, str) and p for p in item):
            if not item:
                raise _fail(source, f'"{key}"[{index}] is an empty frame list')
            rate, where = _frame_list_fps(record, index, frame_list_fps, source)
            frames = tuple(media_path(base_dir, p, source, f'"{key}"[{index}]') for p in item)
            videos.append(VideoSource(frames=frames, fps=rate, fps_source=where))
        else:
            raise _fail(source, f'"{key}"[{index}] must be a path string or a list of frame path '
                                f"strings, got {json_text.brief(item)}")
    if "fps" in record and not any(v.path is None for v in videos):
        raise _fail(source, '"fps" is set but the record has no frame-list video (a video '
                            "file's frame rate is its own)")
    return videos


def plan_videos(record: dict[str, Any], base_dir: Path, source: str, processor: VLProcessor
                ) -> list[VideoPlan]:
    """The `VideoPlan` of each of the record's videos, from their metadata (no frame decoded)."""
    videos = record_videos(record, base_dir, source,
                           processor.video.frame_list_fps if processor.video else None)
    if videos and processor.video is None:
        raise _fail(source, f"the record has videos but {processor.no_video}")
    plans = []
    for video in videos:
        meta = probe_video(video, source)
        try:
            plans.append(plan_video(video, meta, processor.video))
        except ValueError as e:
            raise _fail(source, f"video {video.label}: {e}") from e
    return plans


def timestamp_text(timestamp: float) -> str:
    """A temporal group's timestamp as the prompt shows it: ``<12.5 seconds>``."""
    return f"<{timestamp:.1f} seconds>"


#: A temporal group's timestamp text at the end of the text before it: ``<1.5 seconds>``.
_SHOWN_TIMESTAMP = re.compile(r"<\s*([0-9]+(?:\.([0-9]*))?)\s*seconds\s*>\s*$")
#: Tokens before a temporal group's vision start that are decoded to find its timestamp text.
_TIMESTAMP_WINDOW = 32


def timestamp_problems(input_ids: list[int], group_runs: list[tuple[int, int]],
                       groups: list[tuple[VideoPlan, int]], processor: VLProcessor) -> list[str]:
    """One line per temporal group of a tokens-format record whose ``<t seconds>`` text does not
    show the timestamp of vlmcp's frame plan for it (within the digits it shows), or that has no
    such text right before it. group_runs: (start, end) of each group's video pads in
    `input_ids`; groups: (plan, group index) of each, in the same order."""
    problems = []
    previous_end = 0
    for (start, end), (plan, k) in zip(group_runs, groups):
        block_start = start - (start > 0 and input_ids[start - 1] == processor.vision_start_id)
        window = input_ids[max(previous_end, block_start - _TIMESTAMP_WINDOW):block_start]
        previous_end = end + (end < len(input_ids) and input_ids[end] == processor.vision_end_id)
        expected = plan.timestamps[k]
        temporal = len(plan.indices) // plan.grid[0]
        frames = plan.indices[k * temporal:(k + 1) * temporal]
        planned = (f"vlmcp's plan samples frames {list(frames)} of it at "
                   f"{plan.meta.native_fps:g} fps: {timestamp_text(expected)}")
        shown = _SHOWN_TIMESTAMP.search(processor.tokenizer.decode(window))
        if shown is None:
            problems.append(f"temporal group {k} of video {plan.source.label} has no <t seconds> "
                            f"text before it ({planned})")
            continue
        allowed = 0.5 * 10.0 ** -len(shown.group(2) or "") + 1e-6
        if abs(float(shown.group(1)) - expected) > allowed:
            problems.append(f"temporal group {k} of video {plan.source.label} shows "
                            f"{shown.group(0).strip()}, {planned}")
    return problems


def check_video_blocks(text: str, count: int, source: str) -> None:
    """Raise unless the rendered `text` holds `count` video blocks and no other video pad."""
    blocks, pads = text.count(VIDEO_BLOCK), text.count(VIDEO_PAD)
    if blocks != count or pads != count:
        raise _fail(source, f"chat template rendered {blocks} video blocks {VIDEO_BLOCK} "
                            f"({pads} {VIDEO_PAD}) for {count} videos")


def video_tokens(plan: VideoPlan, processor: VLProcessor) -> list[int]:
    """The ids that replace one video's block: per temporal group, its timestamp's tokens,
    vision start, h*w/merge**2 video pads, vision end."""
    tokenizer = processor.tokenizer
    block = [processor.vision_start_id,
             *[processor.video_token_id] * plan.tokens_per_group(processor.merge_size),
             processor.vision_end_id]
    return [token for t in plan.timestamps
            for token in tokenizer(timestamp_text(t), add_special_tokens=False)["input_ids"]
            + block]


def kept_videos(plans: list[VideoPlan], groups: int) -> list[VideoPlan]:
    """The plans of the first `groups` temporal groups of `plans` (videos in order): whole
    videos, then the first groups of a video the cut falls in."""
    kept = []
    for plan in plans:
        if groups <= 0:
            break
        kept.append(plan if plan.grid[0] <= groups else plan.kept(groups))
        groups -= plan.grid[0]
    return kept
