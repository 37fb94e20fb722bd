"""One data record -> one tokenized `Sample` with labels and processed images and videos.

Records come from `vlmcp.data.sources` (JSON Lines or JSON arrays). Image and video paths are
relative to data.image_root when it is set, else to the data file's directory; absolute paths
stay as they are. ``"image"`` (one path or a list) is an alias of ``"images"``; a record with
both is an error. Videos (``"videos"``/``"video"``, ``<video>`` markers, typed video entries, a
record-level ``"fps"`` for frame lists) are read as `vlmcp.data.video_records` describes, and may
mix with images in one sample. Audio (``"audios"``/``"audio"``, ``<audio>`` markers, typed audio
entries) is an error: vlmcp trains text, images and video.

Accepted record formats:

* messages: ``{"messages": [{"role": "user", "content": "<image>What digit is this?"},
  {"role": "assistant", "content": "7"}], "images": ["img/1.png"]}``. Each ``<image>`` marker in
  string content takes the next path of "images", each ``<video>`` marker the next video of
  "videos". Content may instead be typed: ``[{"type": "image"}, {"type": "video"},
  {"type": "text", "text": "..."}]``; each image (video) entry takes the next image (video).
* LLaVA / ShareGPT: ``{"conversations": [{"from": "human", "value": "<image>..."},
  {"from": "gpt", "value": "..."}], "images": [...]}``; "from" is human/user, gpt/assistant or
  system.
* tokens: ``{"input_ids": [...], "labels": [...], "images": [...], "videos": [...]}`` with image
  and video placeholders already expanded. labels use the unshifted HF convention (labels[t] is
  input_ids[t] or -100); every maximal run of image tokens is one image and must hold
  t*h*w // merge**2 tokens; every maximal run of video tokens is one temporal group of the
  videos in order and must hold h*w // merge**2 tokens (the timestamp text between groups is the
  record's own).
  Optional per-token arrays for the token-level objectives (`loss.type`): ``"loss_weights"``,
  ``"advantages"``, ``"old_logprobs"``, ``"ref_logprobs"``, ``"inference_logprobs"`` (the
  inference engine's logprob of each sampled token; also for the train-inference mismatch
  metrics), ``"teacher_logprobs"`` and the weight arrays a job names (`loss.terms`); and
  ``"temperatures"`` (the temperature each token was sampled at: the trainer's logprob of it is
  then log_softmax(logits / temperature); > 0). Each is a list of numbers as long as "labels" and
  aligned with it: entry t belongs to the prediction of labels[t] (made at position t-1), so it
  is read only where labels[t] is a target. On targets every entry must be a finite number; where
  labels[t] is -100 (and on image placeholders) an entry may be any number or null and is
  ignored. Chat formats carry no per-token arrays (they train with `ce` only).
  Optional ``"routed_experts"``: the MoE experts each token was routed to, for routing replay, as
  a nested list [T][L_moe][K] or the compact base64 form (`vlmcp.data.routes`); a chat record
  carrying it is an error.
* preference pairs (`vlmcp.data.pairs`): one record, two samples (chosen and rejected).

Chat formats are rendered once with the tokenizer's chat template, given the processor's
``chat_template_kwargs`` (``data.chat_template_kwargs``) as template variables (Qwen/ChatML:
``<|im_start|>role\\n...<|im_end|>\\n``; an image renders as
``<|vision_start|><|image_pad|><|vision_end|>`` and the single ``<|image_pad|>`` is expanded to
the image's t*h*w // merge**2 placeholders; a video's block
``<|vision_start|><|video_pad|><|vision_end|>`` is replaced by its temporal groups with their
timestamps, `vlmcp.data.video_records.video_tokens`).

Targets (label != -100) of chat formats, exactly: for every assistant turn, the tokens after its
``<|im_start|>assistant\\n`` header up to and including its closing ``<|im_end|>``; that is the
reply as the template renders it (for templates with reasoning blocks this includes the rendered
``<think>...</think>`` part) plus ``<|im_end|>``; with the processor's ``empty_think`` "prompt"
(``data.empty_think``), an empty ``<think>\\n\\n</think>\\n\\n`` opening a reply belongs to the
prompt instead. Not targets: the header, the ``\\n`` after ``<|im_end|>``, system and user turns,
and image and video placeholders anywhere. The rendered text is cut at each header end and at each
``<|im_end|>`` and the pieces are tokenized separately, so the prompt tokenizes exactly as it does
at generation time (prompt ending in the header). Spans are found in the full rendering rather than
by rendering message prefixes, because Qwen3.x templates rewrite earlier assistant turns (dropping
reasoning) depending on what follows them.

Length: a sample longer than max_seq_len is an error unless truncate is set; then it keeps its
first max_seq_len tokens, moved back to the start of an image block or a video's temporal group
(``<|vision_start|>``) that the cut would split, drops the images and temporal groups past the
cut (a video cut between groups keeps its first groups, at the same frame size), and is still an
error if no target is left.

Every bad input raises `DataError` whose message starts with the record's source label
("file:line", or "file[index] (line N)" in a JSON array).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from vlmcp.data import json_text
from vlmcp.data.batch import IGNORE_INDEX, TOKEN_ARRAYS
from vlmcp.data.media_paths import is_file, media_path
from vlmcp.data.positions import IMAGE, VIDEO, mrope_positions
from vlmcp.data.processor import IMAGE_PAD, VLProcessor
from vlmcp.data.routes import ROUTES_KEY, parse_routes
from vlmcp.data.video import decode_frames
from vlmcp.data.video_plan import VideoPlan
from vlmcp.data.video_records import (check_video_blocks, kept_videos, plan_videos,
                                      timestamp_problems, video_tokens)
from vlmcp.errors import DataError

logger = logging.getLogger(__name__)

IMAGE_MARKER = "<image>"
AUDIO_MARKER = "<audio>"
VIDEO_MARKER = "<video>"
ASSISTANT_HEADER = "<|im_start|>assistant\n"
TURN_END = "<|im_end|>"
#: What Qwen3.x templates render at the start of a reply that has no reasoning.
EMPTY_THINK = "<think>\n\n</think>\n\n"
#: ShareGPT "from" values -> chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
_CHAT_ROLES = {"system", "user", "assistant"}


@dataclass
class Sample:
    """One tokenized sample.

    input_ids:         L token ids, image and video placeholders expanded.
    labels:            L labels, unshifted: labels[t] = input_ids[t] on targets, else -100.
    image_paths:       resolved paths of the images, in placeholder order.
    pixel_values:      [N_patch, C*T*P*P] float32 patches of the images, or None.
    image_grid_thw:    [I, 3] patch grid of each image, or None.
    mm_token_type_ids: [L] 1 on image placeholders, 2 on video placeholders, else 0.
    position_ids:      [3, L] MRoPE positions of the sample alone.
    source:            "file:line".
    token_arrays:      the optional per-token arrays of the tokens format by name, each [L] fp32
                       aligned with labels (0 where labels is -100).
    pair:              "chosen" or "rejected" for a half of a preference pair, else None.
    values:            per-sample values by name (`vlmcp.data.batch.REF_LOGP`).
    videos:            the plan of each video (kept groups only), in placeholder order.
    pixel_values_videos: [N_vpatch, C*T*P*P] float32 patches of the videos, group after group,
                       or None.
    video_grid_thw:    [V, 3] (groups, h, w) patch grid of each video, or None.
    routes:            [L, L_moe, K] uint8/uint16 host routes of its tokens (`vlmcp.data.routes`,
                       NO_ROUTE rows where it has none), or None without `routed_experts`.
    """

    input_ids: list[int]
    labels: list[int]
    image_paths: list[str]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    mm_token_type_ids: torch.Tensor
    position_ids: torch.Tensor
    source: str
    token_arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    pair: str | None = None
    values: dict[str, float] = field(default_factory=dict)
    videos: list[VideoPlan] = field(default_factory=list)
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    routes: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


def _fail(source: str, message: str) -> DataError:
    return DataError(f"{source}: {message}")


def _load_image(path: Path, source: str) -> Image.Image:
    if not is_file(path):
        raise _fail(source, f"image not found: {path}")
    try:
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _fail(source, f"cannot decode image {path}: {e}") from e


def _reject_audio(record: dict[str, Any], source: str) -> None:
    """Audio records are errors: vlmcp trains text, images and video."""
    present = [k for k in ("audios", "audio") if record.get(k)]
    if present:
        raise _fail(source, f'"{present[0]}": audio is not supported (vlmcp trains text, images '
                            "and video)")


def _image_paths(record: dict[str, Any], base_dir: Path, source: str) -> list[Path]:
    """Resolved image paths of a record: "images", or its alias "image" (a path or a list).

    Relative paths are taken relative to base_dir (data.image_root, else the data file's
    directory); absolute paths are kept.
    """
    _reject_audio(record, source)
    if "image" in record and "images" in record:
        raise _fail(source, 'both "image" and "images" are set; use one of them')
    key = "image" if "image" in record else "images"
    images = record.get(key, [])
    if key == "image" and isinstance(images, str):
        images = [images]
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise _fail(source, f'"{key}" must be a list of path strings'
                            + (" or one path string" if key == "image" else ""))
    return [media_path(base_dir, p, source, f'"{key}"') for p in images]


def process_images(
    paths: list[Path], source: str, processor: VLProcessor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pixel_values [N_patch, C*T*P*P], image_grid_thw [I, 3]) of the images at `paths`, or
    (None, None) without images; DataError naming `source` when one cannot be read."""
    if not paths:
        return None, None
    images = [_load_image(p, source) for p in paths]
    try:
        return processor.process_images(images)
    except ValueError as e:
        raise _fail(source, f"image processor rejected {[str(p) for p in paths]}: {e}") from e


_MARKERS = {IMAGE_MARKER: "image", VIDEO_MARKER: "video"}


def _typed_content(text: str) -> str | list[dict[str, str]]:
    """String content with <image>/<video> markers -> typed content; plain strings stay
    strings."""
    if not any(marker in text for marker in _MARKERS):
        return text
    parts: list[dict[str, str]] = []
    for piece in re.split(f"({'|'.join(map(re.escape, _MARKERS))})", text):
        if piece in _MARKERS:
            parts.append({"type": _MARKERS[piece]})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _normalize_content(content: Any, source: str
                       ) -> tuple[str | list[dict[str, str]], int, int]:
    """Content in template form and its number of images and of videos."""
    if isinstance(content, str):
        if AUDIO_MARKER in content:
            raise _fail(source, f"{AUDIO_MARKER} marker: audio is not supported (vlmcp trains "
                                "text, images and video)")
        return (_typed_content(content), content.count(IMAGE_MARKER),
                content.count(VIDEO_MARKER))
    if not isinstance(content, list):
        raise _fail(source, "message content must be a string or a list of typed entries")
    parts: list[dict[str, str]] = []
    for entry in content:
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind == "text" and isinstance(entry.get("text"), str):
            parts.append({"type": "text", "text": entry["text"]})
        elif kind in ("image", "video"):
            parts.append({"type": kind})
        elif kind in ("audio", "input_audio"):
            raise _fail(source, f'content entry of type "{kind}": audio is not supported (vlmcp '
                                "trains text, images and video)")
        else:
            raise _fail(source, f"content entry {json_text.brief(entry)} is not "
                                "{type: text|image|video}")
    return (parts, sum(p["type"] == "image" for p in parts),
            sum(p["type"] == "video" for p in parts))


def _chat_messages(record: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """[{"role", "content"}] of a messages or conversations (ShareGPT) record."""
    sharegpt = "messages" not in record
    raw = record["conversations" if sharegpt else "messages"]
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    roles = SHAREGPT_ROLES if sharegpt else {r: r for r in _CHAT_ROLES}
    if not isinstance(raw, list) or not raw:
        raise _fail(source, "conversation must be a non-empty list of messages")
    messages = []
    for message in raw:
        if not isinstance(message, dict) or role_key not in message or content_key not in message:
            raise _fail(source, f'each message needs "{role_key}" and "{content_key}"')
        role = message[role_key]
        if not isinstance(role, str) or role not in roles:
            raise _fail(source, f"unknown role {json_text.brief(role)}")
        messages.append({"role": roles[role], "content": message[content_key]})
    return messages


def _segments(text: str, source: str, num_assistant: int,
              empty_think_target: bool) -> list[tuple[str, bool]]:
    """Split rendered text into (piece, is_target) at assistant header ends and turn ends.

    Without `empty_think_target`, an `EMPTY_THINK` that opens a reply stays with the prompt.
    """
    pieces: list[tuple[str, bool]] = []
    cursor = 0
    found = 0
    while (header := text.find(ASSISTANT_HEADER, cursor)) != -1:
        start = header + len(ASSISTANT_HEADER)
        if not empty_think_target and text.startswith(EMPTY_THINK, start):
            start += len(EMPTY_THINK)
        end = text.find(TURN_END, start)
        if end == -1:
            raise _fail(source, "an assistant turn has no closing <|im_end|> in the rendering")
        end += len(TURN_END)
        pieces += [(text[cursor:start], False), (text[start:end], True)]
        cursor = end
        found += 1
    pieces.append((text[cursor:], False))
    if found != num_assistant:
        raise _fail(source, f"chat template rendered {found} assistant turns for "
                            f"{num_assistant} assistant messages")
    return [(piece, target) for piece, target in pieces if piece]


def _expand(ids: list[int], is_target: bool, processor: VLProcessor, counts: list[int],
            blocks: list[list[int]], used: dict[str, int]) -> tuple[list[int], list[int]]:
    """Expand each image pad to its image's `counts` placeholders, and each rendered video block
    (vision start, video pad, vision end) to its video's `blocks` ids; `used` counts the images
    and videos seen so far. Labels -100 off target and on placeholders."""
    out_ids: list[int] = []
    out_labels: list[int] = []
    closing = False
    for token in ids:
        if closing:  # the rendered block's vision end, already part of the video's ids
            closing = False
            continue
        if token == processor.image_token_id:
            n = counts[used["image"]] if used["image"] < len(counts) else 1
            used["image"] += 1
            out_ids += [token] * n
            out_labels += [IGNORE_INDEX] * n
        elif token == processor.video_token_id:
            # The rendered block is the vision start just kept, this pad and the vision end
            # that follows (`check_video_blocks`): all three become the video's ids.
            block = blocks[used["video"]]
            used["video"] += 1
            out_ids.pop()
            out_labels.pop()
            out_ids += block
            out_labels += [IGNORE_INDEX if t == token or not is_target else t for t in block]
            closing = True
        else:
            out_ids.append(token)
            out_labels.append(token if is_target else IGNORE_INDEX)
    return out_ids, out_labels


def _marker_problem(kind: str, markers: int, given: int, key: str, items: str) -> str | None:
    """The mismatch of a record's `kind` markers and its `given` `items` (in `key`), or None."""
    if markers == given:
        return None
    if given == 0:
        return (f"{markers} {kind} markers (<{kind}> or typed {kind} entries) but the record has "
                f'no "{key}" (or "{kind}")')
    return (f"{markers} {kind} markers (<{kind}> or typed {kind} entries) for {given} "
            f'{items} in "{key}" (or "{kind}")')


def _tokenize_chat(
    record: dict[str, Any], source: str, processor: VLProcessor, counts: list[int],
    videos: list[VideoPlan],
) -> tuple[list[int], list[int]]:
    messages = _chat_messages(record, source)
    num_images = num_videos = 0
    for message in messages:
        message["content"], n_images, n_videos = _normalize_content(message["content"], source)
        num_images += n_images
        num_videos += n_videos
    problems = [_marker_problem("image", num_images, len(counts), "images", "paths"),
                _marker_problem("video", num_videos, len(videos), "videos", "videos")]
    if any(problems):
        raise _fail(source, "; ".join(p for p in problems if p))
    tokenizer = processor.tokenizer
    if tokenizer.chat_template is None:
        raise _fail(source, "the tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             **processor.chat_template_kwargs)
    except Exception as e:  # the template itself may raise on content it rejects
        raise _fail(source, f"chat template failed: {e}") from e
    if processor.video_token_id is not None:
        check_video_blocks(text, len(videos), source)
    blocks = [video_tokens(plan, processor) for plan in videos]
    num_assistant = sum(m["role"] == "assistant" for m in messages)
    input_ids: list[int] = []
    labels: list[int] = []
    used = {"image": 0, "video": 0}
    for piece, is_target in _segments(text, source, num_assistant,
                                      processor.empty_think == "target"):
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        piece_ids, piece_labels = _expand(ids, is_target, processor, counts, blocks, used)
        input_ids += piece_ids
        labels += piece_labels
    if used["image"] != len(counts):
        raise _fail(source, f"rendered text has {used['image']} {IMAGE_PAD} for {len(counts)} "
                            "images")
    return input_ids, labels


def _image_runs(input_ids: list[int], image_token_id: int | None) -> list[tuple[int, int]]:
    """(start, end) of every maximal run of `image_token_id` (an image's, or a video temporal
    group's placeholders)."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(input_ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _int_list(value: Any, name: str, source: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                              for x in value):
        raise _fail(source, f'"{name}" must be a list of integers')
    return value


def _check_timestamps(problems: list[str], source: str, processor: VLProcessor) -> None:
    """Raise, or log a warning under data.video.on_timestamp_mismatch "warn", for the temporal
    groups of a tokens-format record whose timestamps are not vlmcp's."""
    if not problems:
        return
    more = f" (and {len(problems) - 1} more temporal groups)" if len(problems) > 1 else ""
    message = (f"{source}: {problems[0]}{more}; the record's frames are not the ones vlmcp "
               "decodes and trains on (an engine that samples frames differently?)")
    if processor.video.on_timestamp_mismatch == "error":
        raise DataError(message + "; data.video.on_timestamp_mismatch=\"warn\" trains it anyway")
    logger.warning("%s (data.video.on_timestamp_mismatch=warn: trained anyway)", message)


def _check_tokens(
    record: dict[str, Any], source: str, processor: VLProcessor, counts: list[int],
    paths: list[Path], videos: list[VideoPlan],
) -> tuple[list[int], list[int]]:
    input_ids = _int_list(record["input_ids"], "input_ids", source)
    if "labels" not in record:
        raise _fail(source, 'tokens format needs "labels" (input_ids value or -100 per token)')
    labels = _int_list(record["labels"], "labels", source)
    if len(labels) != len(input_ids):
        raise _fail(source, f"{len(labels)} labels for {len(input_ids)} input_ids")
    vocab = len(processor.tokenizer)
    bad = next((t for t in input_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise _fail(source, f"token id {json_text.brief(bad)} outside the tokenizer vocabulary "
                            f"[0, {vocab})")
    wrong = next((t for t, (i, l) in enumerate(zip(input_ids, labels))
                  if l != IGNORE_INDEX and l != i), None)
    if wrong is not None:
        raise _fail(source, f"labels[{wrong}] is neither -100 nor input_ids[{wrong}] "
                            "(labels must be unshifted)")
    runs = _image_runs(input_ids, processor.image_token_id)
    if len(runs) != len(counts):
        raise _fail(source, f"{len(runs)} image placeholder runs for {len(counts)} images")
    for (start, end), count, path in zip(runs, counts, paths):
        if end - start != count:
            raise _fail(source, f"image {path} has {end - start} placeholders at token {start}, "
                                f"its grid needs {count}")
    group_runs = _image_runs(input_ids, processor.video_token_id)
    groups = [(plan, k) for plan in videos for k in range(plan.grid[0])]
    if len(group_runs) != len(groups):
        raise _fail(source, f"{len(group_runs)} video placeholder runs for the "
                            f"{len(groups)} temporal groups of {len(videos)} videos")
    for (start, end), (plan, k) in zip(group_runs, groups):
        if end - start != plan.tokens_per_group(processor.merge_size):
            raise _fail(source, f"temporal group {k} of video {plan.source.label} has "
                                f"{end - start} placeholders at token {start}, its grid needs "
                                f"{plan.tokens_per_group(processor.merge_size)}")
    _check_timestamps(timestamp_problems(input_ids, group_runs, groups, processor), source,
                      processor)
    placeholders = {i for start, end in runs + group_runs for i in range(start, end)}
    labels = [IGNORE_INDEX if i in placeholders else l for i, l in enumerate(labels)]
    return list(input_ids), labels


def _token_arrays(record: dict[str, Any], labels: list[int], source: str,
                  array_names: tuple[str, ...]) -> dict[str, list[float]]:
    """The per-token arrays `array_names` of a tokens record (see the module docstring), 0.0 off
    targets."""
    arrays: dict[str, list[float]] = {}
    for name in array_names:
        if name not in record:
            continue
        values = record[name]
        if not isinstance(values, list):
            raise _fail(source, f'"{name}" must be a list of numbers, one per label')
        if len(values) != len(labels):
            raise _fail(source, f'"{name}" has {len(values)} entries for {len(labels)} labels '
                                "(one per label, aligned with labels)")
        out = []
        for t, (value, label) in enumerate(zip(values, labels)):
            if label == IGNORE_INDEX:
                if not (json_text.is_number(value) or value is None):
                    raise _fail(source, f'"{name}"[{t}] is {json_text.brief(value)}, not a number '
                                        "or null")
                out.append(0.0)
                continue
            number = json_text.finite(value)
            if number is None:
                raise _fail(source, f'"{name}"[{t}] is {json_text.brief(value)} on a target token '
                                    "(labels[t] != -100); it must be a finite number")
            if name == "temperatures" and number <= 0:
                raise _fail(source, f'"temperatures"[{t}] is {json_text.brief(value)} on a target '
                                    "token; a sampling temperature must be > 0")
            out.append(number)
        arrays[name] = out
    return arrays


def _truncate_point(input_ids: list[int], processor: VLProcessor, max_len: int) -> int:
    """max_len, moved back to the start of an image block or video temporal group it would
    split."""
    runs = _image_runs(input_ids, processor.image_token_id) + \
        _image_runs(input_ids, processor.video_token_id)
    for start, end in runs:
        opens = start > 0 and input_ids[start - 1] == processor.vision_start_id
        closes = end < len(input_ids) and input_ids[end] == processor.vision_end_id
        block_start, block_end = start - opens, end + closes
        if block_start < max_len < block_end:
            return block_start
    return max_len


@dataclass
class Tokens:
    """A record tokenized against its images' patch grids, with no pixels touched.

    input_ids / labels: as in `Sample` (after truncation); paths: the images kept, in
    placeholder order; grids: their (t, h, w) patch grids; arrays: the tokens format's per-token
    arrays (`TOKEN_ARRAYS`), aligned with labels; videos: the plans of the videos kept (a video
    cut between temporal groups keeps its first groups); routes: [L, L_moe, K] host routes, or
    None (`vlmcp.data.routes`).
    """

    input_ids: list[int]
    labels: list[int]
    paths: list[Path]
    grids: list[tuple[int, int, int]]
    arrays: dict[str, list[float]] = field(default_factory=dict)
    videos: list[VideoPlan] = field(default_factory=list)
    routes: torch.Tensor | None = None

    @property
    def num_targets(self) -> int:
        """Tokens that are predicted: labels[1:] that are not -100 (targets are shifted)."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


def _cut(tokens: Tokens, source: str, processor: VLProcessor, max_seq_len: int,
         truncate: bool) -> Tokens:
    """Apply max_seq_len (failing, or truncating) and require a target."""
    input_ids, labels, paths, grids = tokens.input_ids, tokens.labels, tokens.paths, tokens.grids
    arrays, videos, routes = tokens.arrays, tokens.videos, tokens.routes
    if len(input_ids) > max_seq_len:
        if not truncate:
            raise _fail(source, f"{len(input_ids)} tokens, more than max_seq_len {max_seq_len} "
                                "(set data.truncate to cut long samples)")
        cut = _truncate_point(input_ids, processor, max_seq_len)
        input_ids, labels = input_ids[:cut], labels[:cut]
        arrays = {name: values[:cut] for name, values in arrays.items()}
        routes = None if routes is None else routes[:cut]
        kept = len(_image_runs(input_ids, processor.image_token_id))
        paths, grids = paths[:kept], grids[:kept]
        videos = kept_videos(videos, len(_image_runs(input_ids, processor.video_token_id)))
    if all(l == IGNORE_INDEX for l in labels[1:]):
        raise _fail(source, "no target tokens (no assistant reply, or all labels -100"
                            + (" after truncation)" if truncate else ")"))
    return Tokens(input_ids, labels, paths, grids, arrays, videos, routes)


def _process_videos(plans: list[VideoPlan], source: str, processor: VLProcessor
                    ) -> torch.Tensor | None:
    """pixel_values_videos [N_vpatch, C*T*P*P] of the kept groups of `plans`, decoding only
    their frames; None without videos."""
    if not plans:
        return None
    pixels = []
    for plan in plans:
        frames = decode_frames(plan.source, plan.meta, list(plan.indices), source)
        try:
            pixels.append(processor.process_video(frames, plan))
        except ValueError as e:
            raise _fail(source, f"video processor rejected {plan.source.label}: {e}") from e
    return torch.cat(pixels)


def sample_of(tokens: Tokens, pixel_values: torch.Tensor | None, source: str,
              processor: VLProcessor, pixel_values_videos: torch.Tensor | None = None) -> Sample:
    """The `Sample` of `tokens`; pixel_values [N_patch, C*T*P*P] cover at least its images,
    pixel_values_videos [N_vpatch, C*T*P*P] exactly its kept video groups."""
    grid = torch.tensor(tokens.grids, dtype=torch.long) if tokens.grids else None
    if grid is None:
        pixel_values = None
    elif pixel_values is not None:
        pixel_values = pixel_values[:int(grid.prod(-1).sum())]
    video_grid = torch.tensor([plan.grid for plan in tokens.videos], dtype=torch.long) \
        if tokens.videos else None
    ids = torch.tensor(tokens.input_ids, dtype=torch.long)
    mm = (ids == processor.image_token_id).long() * IMAGE
    if processor.video_token_id is not None:
        mm += (ids == processor.video_token_id).long() * VIDEO
    try:
        positions = mrope_positions(ids, mm, grid, processor.merge_size, video_grid)
    except ValueError as e:
        raise _fail(source, str(e)) from e
    return Sample(
        input_ids=tokens.input_ids, labels=tokens.labels,
        image_paths=[str(p) for p in tokens.paths], pixel_values=pixel_values,
        image_grid_thw=grid, mm_token_type_ids=mm, position_ids=positions, source=source,
        token_arrays={name: torch.tensor(values, dtype=torch.float32)
                      for name, values in tokens.arrays.items()},
        videos=list(tokens.videos), pixel_values_videos=pixel_values_videos,
        video_grid_thw=video_grid, routes=tokens.routes,
    )


def record_image_paths(record: Any, source: str, base_dir: Path) -> list[Path]:
    """The image paths of one decoded record, after checking that it has a known format."""
    if not isinstance(record, dict):
        raise _fail(source, "a record must be a JSON object")
    if "messages" not in record and "conversations" not in record and "input_ids" not in record:
        raise _fail(source, f"unknown format (keys {sorted(record)}); expected messages, "
                            "conversations or input_ids, or a preference pair (chosen and "
                            "rejected)")
    return _image_paths(record, base_dir, source)


def tokenize_record(
    record: Any, source: str, base_dir: Path, processor: VLProcessor,
    grids: list[tuple[int, int, int]], max_seq_len: int, truncate: bool = False,
    array_names: tuple[str, ...] = TOKEN_ARRAYS, videos: list[VideoPlan] | None = None,
) -> Tokens:
    """Tokens of one decoded record whose images have the (t, h, w) patch `grids` (one per
    path of `record_image_paths`, e.g. read from the image file headers) and whose videos have
    the plans `videos` (`plan_videos`, from their metadata). Decodes no image or frame.
    array_names: the per-token arrays read from a tokens record (a chat record carrying one of
    them is an error)."""
    paths = record_image_paths(record, source, base_dir)
    videos = list(videos or [])
    if len(grids) != len(paths):
        raise ValueError(f"{len(grids)} grids for {len(paths)} images")
    counts = [processor.num_placeholders(row) for row in grids]
    arrays: dict[str, list[float]] = {}
    routes = None
    if "messages" in record or "conversations" in record:
        present = [name for name in (*array_names, ROUTES_KEY) if name in record]
        if present:
            raise _fail(source, f"per-token arrays {present} need the tokens format "
                                "(input_ids/labels); chat formats carry none")
        input_ids, labels = _tokenize_chat(record, source, processor, counts, videos)
    else:
        input_ids, labels = _check_tokens(record, source, processor, counts, paths, videos)
        arrays = _token_arrays(record, labels, source, array_names)
        if ROUTES_KEY in record:
            routes = parse_routes(record[ROUTES_KEY], len(input_ids), processor.routes, source)
    tokens = Tokens(input_ids, labels, paths, [tuple(int(x) for x in g) for g in grids], arrays,
                    videos, routes)
    return _cut(tokens, source, processor, max_seq_len, truncate)


def parse_record(
    record: Any, source: str, base_dir: Path, processor: VLProcessor, max_seq_len: int,
    truncate: bool = False, array_names: tuple[str, ...] = TOKEN_ARRAYS,
) -> Sample:
    """Turn one decoded record into a `Sample` (images decoded and patchified, and the sampled
    frames of the videos' kept temporal groups); raises `DataError` naming `source`.

    base_dir: what relative image and video paths are relative to (data.image_root, else the
    data file's directory). See the module docstring for formats and targets.
    """
    paths = record_image_paths(record, source, base_dir)
    plans = plan_videos(record, base_dir, source, processor)
    pixel_values, grid = process_images(paths, source, processor)
    grids = [] if grid is None else [tuple(row) for row in grid.tolist()]
    tokens = tokenize_record(record, source, base_dir, processor, grids, max_seq_len, truncate,
                             array_names, plans)
    return sample_of(tokens, pixel_values, source, processor,
                     _process_videos(tokens.videos, source, processor))
