"""Tokenizer, image processor and video settings for a local Qwen3.5 checkpoint, without
torchvision.

A published Qwen3.5 checkpoint directory holds config.json, *.safetensors, tokenizer.json,
tokenizer_config.json (+ chat_template.jinja), preprocessor_config.json and
video_preprocessor_config.json. `AutoProcessor` cannot build `Qwen3VLProcessor` there without
torchvision (the video slot fails), and the preprocessor config names the torchvision-backed
`Qwen2VLImageProcessorFast`. `load_processor` instead builds the tokenizer with `AutoTokenizer`
and the PIL-backed `Qwen2VLImageProcessorPil`, taking every geometry and normalisation field from
preprocessor_config.json (the PIL class defaults are Qwen2-VL's, not Qwen3.5's).

Videos take their sampling, geometry and normalisation from video_preprocessor_config.json
(`vlmcp.data.video_plan.VideoSettings`, the job's `data.video` keys on top). Their frames go
through the same PIL/numpy image path as images: each sampled frame is resized with PIL to the
video's size, then rescaled, normalised and patchified by a `Qwen2VLImageProcessorPil` built with
the video file's normalisation fields, and each temporal group's T frames are interleaved into
one patch row (`VLProcessor.process_video`). A checkpoint without video_preprocessor_config.json
trains text and images; a record with a video is then an error.

The PIL backend resizes with PIL's bicubic filter, the Fast classes with torchvision's; pixels can
differ slightly from theirs on images and frames that need resizing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmcp.data import json_text
from vlmcp.data.routes import RouteSpec, route_spec
from vlmcp.data.video_plan import VideoPlan, VideoSettings, video_settings
from vlmcp.errors import ProcessorError, VideoConfigError

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"

#: preprocessor_config.json fields passed through to the image processor unchanged.
_PASSTHROUGH_FIELDS = (
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "image_mean",
    "image_std",
    "do_resize",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "do_convert_rgb",
    "resample",
)
_REQUIRED_FIELDS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")


@dataclass
class VLProcessor:
    """What the data path needs from a checkpoint: tokenizer, image processor, video settings
    and vision ids. `video` (and `frame_processor`, which normalises and patchifies video frames)
    is None, and `video_token_id` may be None, for a checkpoint without
    video_preprocessor_config.json or `<|video_pad|>`; `no_video` then says why."""

    tokenizer: PreTrainedTokenizerBase
    image_processor: Qwen2VLImageProcessorPil
    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    merge_size: int
    video_token_id: int | None = None
    video: VideoSettings | None = None
    frame_processor: Qwen2VLImageProcessorPil | None = None
    no_video: str = ""
    #: Extra keyword arguments of every `apply_chat_template` call that renders a sample
    #: (`data.chat_template_kwargs`, e.g. {"enable_thinking": False}); template variables.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: "target": an empty think block the template renders at the start of a reply is a target;
    #: "prompt": it belongs to the prompt (`data.empty_think`).
    empty_think: str = "target"
    #: The checkpoint's MoE routing layout, which a sample's `routed_experts` must match
    #: (`vlmcp.data.routes`); None for a dense model.
    routes: RouteSpec | None = None

    def process_images(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """Patchify images in order.

        Returns pixel_values [N_patch, C*T*P*P] float32 (N_patch = sum of t*h*w) and
        image_grid_thw [I, 3] long, the (t, h, w) patch grid of each image.
        """
        out = self.image_processor(images, return_tensors="pt")
        return out["pixel_values"].to(torch.float32), out["image_grid_thw"].to(torch.long)

    def num_placeholders(self, grid_row: torch.Tensor | list[int]) -> int:
        """Number of image placeholder tokens for one image of grid (t, h, w): t*h*w // merge**2."""
        t, h, w = (int(x) for x in grid_row)
        return t * h * w // self.merge_size**2

    def process_video(self, frames: list[Image.Image], plan: VideoPlan) -> torch.Tensor:
        """Patchify the decoded frames of `plan` (len(plan.indices) RGB frames, in order).

        Returns pixel_values_videos [groups * h * w, C*T*P*P] float32, temporal group after
        temporal group (group k is the row block [k*h*w, (k+1)*h*w)); within a row the channel
        axis comes first, then the group's T frames, then the patch's pixels, as in
        transformers' video processor.
        """
        settings = self.video
        temporal, patch = settings.temporal_patch_size, settings.patch_size
        if len(frames) != len(plan.indices):
            raise ValueError(f"{len(frames)} frames for the {len(plan.indices)} of the plan")
        size = (plan.width, plan.height)
        frames = [frame if frame.size == size else frame.resize(size, settings.resample)
                  for frame in frames]
        out = self.frame_processor(frames, do_resize=False, return_tensors="np")["pixel_values"]
        groups, rows = plan.grid[0], plan.grid[1] * plan.grid[2]
        channels = out.shape[1] // (temporal * patch * patch)
        # Every frame comes back as T copies; keep one and put a group's T frames side by side.
        per_frame = out.reshape(len(frames), rows, channels, temporal, patch, patch)[:, :, :, 0]
        per_group = per_frame.reshape(groups, temporal, rows, channels, patch, patch)
        per_group = np.ascontiguousarray(per_group.transpose(0, 2, 3, 1, 4, 5))
        return torch.from_numpy(per_group.reshape(groups * rows, -1))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json_text.loads(path.read_text())
    except FileNotFoundError as e:
        raise ProcessorError(f"{path}: missing (expected a Qwen3.5 checkpoint layout)") from e
    except json.JSONDecodeError as e:
        raise ProcessorError(f"{path}: not valid JSON ({e})") from e


def image_processor_kwargs(preprocessor_config: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for `Qwen2VLImageProcessorPil` from a preprocessor_config.json dict.

    Pixel bounds come from `size` ({"shortest_edge", "longest_edge"}, as published) or from the
    older `min_pixels` / `max_pixels` fields.
    """
    missing = [k for k in _REQUIRED_FIELDS if k not in preprocessor_config]
    if missing:
        raise ProcessorError(f"preprocessor_config.json lacks {missing}")
    kwargs = {k: preprocessor_config[k] for k in _PASSTHROUGH_FIELDS if k in preprocessor_config}
    size = dict(preprocessor_config.get("size") or {})
    if "min_pixels" in preprocessor_config:
        size["shortest_edge"] = preprocessor_config["min_pixels"]
    if "max_pixels" in preprocessor_config:
        size["longest_edge"] = preprocessor_config["max_pixels"]
    if set(size) != {"shortest_edge", "longest_edge"}:
        raise ProcessorError(
            "preprocessor_config.json needs size {shortest_edge, longest_edge} or "
            f"min_pixels/max_pixels, got size={size}"
        )
    kwargs["size"] = size
    return kwargs


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ProcessorError(f"tokenizer has no {token} token")
    return int(token_id)


def _check_against_model_config(
    config: dict[str, Any], ids: dict[str, int], preprocessor: dict[str, Any], name: str
) -> None:
    for key, token_id in ids.items():
        if key in config and config[key] != token_id:
            raise ProcessorError(
                f"config.json {key}={config[key]} but the tokenizer maps it to {token_id}"
            )
    vision = config.get("vision_config", {})
    for ours, theirs in (("merge_size", "spatial_merge_size"), ("patch_size", "patch_size"),
                         ("temporal_patch_size", "temporal_patch_size")):
        if theirs in vision and ours in preprocessor and vision[theirs] != preprocessor[ours]:
            raise ProcessorError(
                f"{name} {ours}={preprocessor[ours]} but config.json "
                f"vision_config.{theirs}={vision[theirs]}"
            )


def _video_part(model_dir: Path, config: dict[str, Any], tokenizer: PreTrainedTokenizerBase,
                video: dict[str, Any] | None
                ) -> tuple[int | None, VideoSettings | None, Qwen2VLImageProcessorPil | None, str]:
    """(video token id, settings, frame processor, why videos are unsupported) of a checkpoint.

    video: the job's `data.video` section as a dict (its pixel, frame and fps overrides,
    frame_list_fps and on_timestamp_mismatch)."""
    path = model_dir / "video_preprocessor_config.json"
    video_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
    if video_id is None or video_id == tokenizer.unk_token_id:
        return None, None, None, f"the tokenizer has no {VIDEO_PAD} token"
    if not path.is_file():
        return int(video_id), None, None, f"the checkpoint has no {path.name} ({model_dir})"
    file_config = _read_json(path)
    _check_against_model_config(config, {"video_token_id": int(video_id)}, file_config, path.name)
    overrides = dict(video or {})
    frame_list_fps = overrides.pop("frame_list_fps", None)
    on_mismatch = overrides.pop("on_timestamp_mismatch", "error")
    try:
        settings = video_settings(file_config, overrides, frame_list_fps, on_mismatch)
    except VideoConfigError as e:
        raise ProcessorError(f"{path}: {e}") from e
    frame_processor = Qwen2VLImageProcessorPil(
        patch_size=settings.patch_size, temporal_patch_size=settings.temporal_patch_size,
        merge_size=settings.merge_size, do_resize=False,
        size={"shortest_edge": settings.min_pixels, "longest_edge": settings.max_pixels},
        **settings.frame_kwargs)
    return int(video_id), settings, frame_processor, ""


def load_processor(model_dir: str | Path, chat_template_kwargs: dict[str, Any] | None = None,
                   empty_think: str = "target", video: dict[str, Any] | None = None
                   ) -> VLProcessor:
    """Build the `VLProcessor` of a local checkpoint directory (offline, no torchvision).

    `chat_template_kwargs` are given to every `apply_chat_template` call that renders a sample;
    `empty_think` says whether an empty think block opening a reply is a "target" or "prompt";
    `video` is the job's `data.video` section (fps, min/max frames, min/max pixels overriding
    video_preprocessor_config.json where not None, frame_list_fps and on_timestamp_mismatch).
    Checks that the tokenizer's vision tokens match config.json's ids and that patch/merge sizes
    match the vision config. Its `routes` is config.json's MoE routing layout (None: dense).
    """
    model_dir = Path(model_dir)
    preprocessor = _read_json(model_dir / "preprocessor_config.json")
    config = _read_json(model_dir / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    ids = {
        "image_token_id": _token_id(tokenizer, IMAGE_PAD),
        "vision_start_token_id": _token_id(tokenizer, VISION_START),
        "vision_end_token_id": _token_id(tokenizer, VISION_END),
    }
    _check_against_model_config(config, ids, preprocessor, "preprocessor_config.json")
    image_processor = Qwen2VLImageProcessorPil(**image_processor_kwargs(preprocessor))
    video_id, settings, frame_processor, no_video = _video_part(model_dir, config, tokenizer,
                                                                video)
    return VLProcessor(
        tokenizer=tokenizer,
        image_processor=image_processor,
        image_token_id=ids["image_token_id"],
        vision_start_id=ids["vision_start_token_id"],
        vision_end_id=ids["vision_end_token_id"],
        merge_size=int(preprocessor["merge_size"]),
        chat_template_kwargs=dict(chat_template_kwargs or {}),
        empty_think=empty_think,
        video_token_id=video_id,
        video=settings,
        frame_processor=frame_processor,
        no_video=no_video,
        routes=route_spec(config),
    )
