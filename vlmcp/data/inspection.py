"""`vlmcp inspect`: one sample as training sees it, with its targets marked.

A `Sample` (token ids, unshifted labels, image grids) is cut into segments: maximal runs of
prompt text (label -100), of target text (label = token) and of one image's placeholders. Text
segments are decoded with special tokens kept; an image segment shows as ``<|image_pad|>xN``
(N placeholders), so a rendering reads like
``<|vision_start|><|image_pad|>x256<|vision_end|>``.

The report is plain JSON data (`inspect_sample`); `format_report` prints it for a terminal with
target spans in ``[[...]]`` (or green, with `color`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.data.formats import EMPTY_THINK, Sample
from vlmcp.data.processor import IMAGE_PAD, VLProcessor

TARGET_OPEN, TARGET_CLOSE = "[[", "]]"
_GREEN, _CYAN, _RESET = "\x1b[1;32m", "\x1b[36m", "\x1b[0m"


@dataclass
class Segment:
    """A maximal run of tokens of one kind: "text" (prompt or target) or "image" (one image)."""

    kind: str
    text: str
    is_target: bool
    num_tokens: int
    image: int | None = None


def _kind(token: int, label: int, processor: VLProcessor) -> tuple[str, bool]:
    if token == processor.image_token_id:
        return "image", False
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
    images = 0
    for kind, is_target, ids in runs:
        if kind == "image":
            out.append(Segment("image", f"{IMAGE_PAD}x{len(ids)}", False, len(ids), images))
            images += 1
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


def inspect_sample(sample: Sample, processor: VLProcessor) -> dict[str, Any]:
    """JSON-able report of one sample.

    Keys: source ("file:line"), pair ("chosen" or "rejected" for a half of a preference pair,
    else null), num_tokens, num_targets, images (path, grid_thw [t, h, w],
    patches t*h*w, tokens t*h*w // merge**2), segments (kind, text, is_target, num_tokens, image),
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
        "segments": [asdict(p) for p in parts],
        "chat_template_kwargs": dict(processor.chat_template_kwargs),
        "notes": _notes(parts),
    }


def format_report(report: dict[str, Any], color: bool = False) -> str:
    """The report for a terminal: a summary, then the rendering with targets marked (``[[...]]``,
    or green with `color`) and each image collapsed to ``<|image_pad|>xN``."""
    share = report["num_targets"] / max(report["num_tokens"], 1)
    half = f" ({report['pair']} half of a preference pair)" if report.get("pair") else ""
    lines = [f"sample {report['source']}{half}",
             f"tokens {report['num_tokens']}, targets {report['num_targets']} ({share:.1%}), "
             f"images {len(report['images'])}"]
    for i, image in enumerate(report["images"]):
        t, h, w = image["grid_thw"]
        lines.append(f"  image {i}: {image['path']} grid {t}x{h}x{w} = {image['patches']} patches"
                     f" -> {image['tokens']} tokens")
    lines.append(f"chat_template_kwargs: {report['chat_template_kwargs']}")
    lines += [f"note: {note}" for note in report["notes"]]
    lines.append("targets: " + (f"{_GREEN}green{_RESET}" if color
                                else f"{TARGET_OPEN}...{TARGET_CLOSE}"))
    lines.append("-" * 72)
    body = []
    for part in report["segments"]:
        text = part["text"]
        if part["kind"] == "image":
            body.append(f"{_CYAN}{text}{_RESET}" if color else text)
        elif part["is_target"]:
            body.append(f"{_GREEN}{text}{_RESET}" if color else f"{TARGET_OPEN}{text}{TARGET_CLOSE}")
        else:
            body.append(text)
    return "\n".join(lines) + "\n" + "".join(body)
