"""A local Qwen3.5 checkpoint -> a trainable Hugging Face model.

Loading is offline (`local_files_only`). The class comes from config.json's `model_type`:
`qwen3_5` -> `Qwen3_5ForConditionalGeneration`, `qwen3_5_moe` -> its MoE twin. Under ZeRO-3 the
caller creates `transformers.integrations.HfDeepSpeedConfig` first, so `from_pretrained`
partitions parameters as they load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
)

from vlmcp.data import json_text
from vlmcp.errors import ModelLoadError

MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "qwen3_5": Qwen3_5ForConditionalGeneration,
    "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration,
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_model_config(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint as a dict; raises ModelLoadError naming the file."""
    config_file = Path(path) / "config.json"
    try:
        raw = json_text.loads(config_file.read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(f"model.path: {config_file} not found") from exc
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"model.path: {config_file} is not valid JSON ({exc.msg})") from exc
    model_type = raw.get("model_type")
    if model_type not in MODEL_CLASSES:
        raise ModelLoadError(f"model.path: {config_file} has model_type {model_type!r}; "
                             f"vlmcp trains {sorted(MODEL_CLASSES)}")
    return raw


def load_config(path: str | Path) -> PretrainedConfig:
    """The checkpoint's transformers config (offline)."""
    read_model_config(path)
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def text_hidden_size(config: PretrainedConfig) -> int:
    """Hidden size of the language model (what DeepSpeed bucket sizes scale with)."""
    return int(config.get_text_config().hidden_size)


def load_model(path: str | Path, dtype: str = "float32", *, freeze_vision: bool = True,
               attn_implementation: str | None = None) -> PreTrainedModel:
    """Load the checkpoint for training: `use_cache` off, vision tower frozen when asked."""
    raw = read_model_config(path)
    model_class = MODEL_CLASSES[raw["model_type"]]
    model = model_class.from_pretrained(
        str(path),
        dtype=DTYPES[dtype],
        attn_implementation=attn_implementation or "sdpa",
        local_files_only=True,
    )
    model.config.use_cache = False
    model.config.get_text_config().use_cache = False
    if freeze_vision:
        model.model.visual.requires_grad_(False)
    return model
