"""`vlmcp inspect`: one sample as training sees it, with its targets marked.

A `Sample` (token ids, unshifted labels, image grids, video plans) is cut into segments: maximal
runs of prompt text (label -100), of target text (label = token), of one image's placeholders
and of one video temporal group's placeholders. Text segments are decoded with special tokens
kept; an image segment shows as ``<|image_pad|>xN`` (N placeholders) and a video group as
``<|video_pad|>xN``, so a rendering reads like
``<|vision_start|><|image_pad|>x256<|vision_end|>`` and a video like
``<0.2 seconds><|vision_start|><|video_pad|>x64<|vision_end|><1.2 seconds>...``: the form
vlmcp trains on (`vlmcp.data.video_records`).

The report is plain JSON data (`inspect_sample`); `format_report` prints it for a terminal with
target spans in ``[[...]]`` (or green, with `color`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.data.formats import EMPTY_THINK, Sample
from vlmcp.data.processor import IMAGE_PAD, VIDEO_PAD, VLProcessor
from vlmcp.data.video_plan import VideoPlan

TARGET_OPEN, TARGET_CLOSE = "[[", "]]"
_GREEN, _CYAN, _RESET = "\x1b[1;32m", "\x1b[36m", "\x1b[0m"


@dataclass
class Segment:
    """A maximal run of tokens of one kind: "text" (prompt or target), "image" (one image, its
    number in `image`) or "video" (one temporal group, its number over the sample's groups in
    `image`)."""

    kind: str
    text: str
    is_target: bool
    num_tokens: int
    image: int | None = None


def _kind(token: int, label: int, processor: VLProcessor) -> tuple[str, bool]:
    if token == processor.image_token_id:
        return "image", False
    if token == processor.video_token_id:
        return "video", False
    return "text", label != IGNORE_INDEX


def segments(sample: Sample, processor: VLProcessor) -> list[Segment]:
    """The sample's tokens as prompt, target and image segments, in order.

    Every maximal run of image placeholders is one image (the template puts
    ``<|vision_end|><|vision_start|>`` between two images), numbered in order.
    """
    runs: list[tuple[str, bool, list[int]]] = []
    for token, label in zip(sample.input_ids, sample.labels):
        kind, is_target = _kind(token, label, processor)
        if runs and runs[-1][:2] == (kind, is_target):
            runs[-1][2].append(token)
        else:
            runs.append((kind, is_target, [token]))
    out: list[Segment] = []
    counters = {"image": 0, "video": 0}
    pads = {"image": IMAGE_PAD, "video": VIDEO_PAD}
    for kind, is_target, ids in runs:
        if kind in pads:
            out.append(Segment(kind, f"{pads[kind]}x{len(ids)}", False, len(ids),
                               counters[kind]))
            counters[kind] += 1
        else:
            text = processor.tokenizer.decode(ids, skip_special_tokens=False,
                                              clean_up_tokenization_spaces=False)
            out.append(Segment("text", text, is_target, len(ids)))
    return out


def _notes(parts: list[Segment]) -> list[str]:
    notes = []
    if any(p.is_target and p.text.startswith(EMPTY_THINK) for p in parts):
        notes.append("an assistant reply's targets start with the empty think block "
                     f"{EMPTY_THINK!r} the chat template rendered "
                     "(see docs/data.md#empty-think-blocks-qwen35)")
    return notes


def _video_report(plan: VideoPlan, merge_size: int) -> dict[str, Any]:
    groups, h, w = plan.grid
    return {"video": plan.source.label, "total_frames": plan.meta.total_frames,
            "frame_count_from": plan.meta.count_source, "native_fps": plan.meta.native_fps,
            "native_fps_from": plan.meta.fps_source,
            "frame_size": [plan.meta.width, plan.meta.height],
            "resized_to": [plan.width, plan.height], "frames_sampled": list(plan.indices),
            "sampled": plan.sampled,
            "timestamps": [round(t, 3) for t in plan.timestamps], "groups": groups,
            "group_grid_hw": [h, w], "patches": groups * h * w,
            "tokens": groups * plan.tokens_per_group(merge_size)}


def inspect_sample(sample: Sample, processor: VLProcessor) -> dict[str, Any]:
    """JSON-able report of one sample.

    Keys: source ("file:line"), pair ("chosen" or "rejected" for a half of a preference pair,
    else null), num_tokens, num_targets, images (path, grid_thw [t, h, w], patches t*h*w, tokens
    t*h*w // merge**2), videos (video, total_frames, frame_count_from, native_fps,
    native_fps_from, frame_size, resized_to, frames_sampled: the decoded frame indices, padded to
    whole groups, sampled: how many before that padding, timestamps per group, groups,
    group_grid_hw, patches, tokens), segments (kind, text, is_target, num_tokens, image),
    chat_template_kwargs, notes (lines worth a look, e.g. an empty think block as a target).
    """
    parts = segments(sample, processor)
    grids = sample.image_grid_thw.tolist() if sample.image_grid_thw is not None else []
    images = [{"path": path, "grid_thw": grid, "patches": grid[0] * grid[1] * grid[2],
               "tokens": processor.num_placeholders(grid)}
              for path, grid in zip(sample.image_paths, grids)]
    return {
        "source": sample.source,
        "pair": sample.pair,
        "num_tokens": len(sample.input_ids),
        "num_targets": sum(label != IGNORE_INDEX for label in sample.labels),
        "images": images,
        "videos": [_video_report(plan, processor.merge_size) for plan in sample.videos],
        "segments": [asdict(p) for p in parts],
        "chat_template_kwargs": dict(processor.chat_template_kwargs),
        "notes": _notes(parts),
    }


def format_report(report: dict[str, Any], color: bool = False) -> str:
    """The report for a terminal: a summary, then the rendering with targets marked (``[[...]]``,
    or green with `color`) and each image (video group) collapsed to ``<|image_pad|>xN``
    (``<|video_pad|>xN``)."""
    share = report["num_targets"] / max(report["num_tokens"], 1)
    half = f" ({report['pair']} half of a preference pair)" if report.get("pair") else ""
    lines = [f"sample {report['source']}{half}",
             f"tokens {report['num_tokens']}, targets {report['num_targets']} ({share:.1%}), "
             f"images {len(report['images'])}, videos {len(report['videos'])}"]
    for i, image in enumerate(report["images"]):
        t, h, w = image["grid_thw"]
        lines.append(f"  image {i}: {image['path']} grid {t}x{h}x{w} = {image['patches']} patches"
                     f" -> {image['tokens']} tokens")
    for i, video in enumerate(report["videos"]):
        h, w = video["group_grid_hw"]
        stamps = ", ".join(f"{t:.1f}" for t in video["timestamps"])
        lines += [f"  video {i}: {video['video']}: {video['total_frames']} frames "
                  f"({video['frame_count_from']}) at {video['native_fps']:g} fps "
                  f"({video['native_fps_from']}), {video['frame_size'][0]}x"
                  f"{video['frame_size'][1]} resized to {video['resized_to'][0]}x"
                  f"{video['resized_to'][1]}",
                  f"    frames sampled {video['frames_sampled']}"
                  + (f" ({video['sampled']}, the last repeated to fill the last group)"
                     if video["sampled"] < len(video["frames_sampled"]) else ""),
                  f"    {video['groups']} temporal groups of grid {h}x{w} "
                  f"({video['tokens'] // max(video['groups'], 1)} tokens each) at {stamps} s "
                  f"-> {video['tokens']} tokens"]
    lines.append(f"chat_template_kwargs: {report['chat_template_kwargs']}")
    lines += [f"note: {note}" for note in report["notes"]]
    lines.append("targets: " + (f"{_GREEN}green{_RESET}" if color
                                else f"{TARGET_OPEN}...{TARGET_CLOSE}"))
    lines.append("-" * 72)
    body = []
    for part in report["segments"]:
        text = part["text"]
        if part["kind"] in ("image", "video"):
            body.append(f"{_CYAN}{text}{_RESET}" if color else text)
        elif part["is_target"]:
            body.append(f"{_GREEN}{text}{_RESET}" if color else f"{TARGET_OPEN}{text}{TARGET_CLOSE}")
        else:
            body.append(text)
    return "\n".join(lines) + "\n" + "".join(body)
