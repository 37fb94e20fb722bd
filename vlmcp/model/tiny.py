"""Tiny Qwen3.5 configurations and checkpoints for tests, the demo and benchmarks.

The sizes keep every constraint of the real architecture (head_dim, MRoPE sections, vision
out_hidden_size == text hidden_size, special ids below vocab_size), so code that works on a tiny
model exercises the same paths as a published checkpoint. `build_tiny_checkpoint` writes one to
disk laid out like a published checkpoint: random-init weights, a byte-level BPE tokenizer trained
on a built-in corpus (Qwen's pre-tokenizer) with a ChatML template, and the processor configs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers import (PretrainedConfig, Qwen3_5ForConditionalGeneration,
                          Qwen3_5MoeForConditionalGeneration)
from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

#: Special token ids used by the tiny models; the demo tokenizer places its specials here.
TINY_SPECIAL_IDS = {
    "image_token_id": 5,
    "video_token_id": 6,
    "vision_start_token_id": 3,
    "vision_end_token_id": 4,
}


def tiny_qwen3_5_config(
    *,
    moe: bool = False,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    full_attention_interval: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_head_dim: int = 16,
    linear_conv_kernel_dim: int = 4,
    vision_depth: int = 1,
    **text_overrides: Any,
) -> PretrainedConfig:
    """A small `Qwen3_5Config` (or `Qwen3_5MoeConfig` when `moe`) valid for every code path.

    Layer types repeat `full_attention_interval - 1` linear (DeltaNet) layers then one full
    attention layer, like the published checkpoints.
    """
    rotary_dims = int(head_dim * 0.25)
    half = rotary_dims // 2
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    layer_types = [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(num_hidden_layers)
    ]
    text: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "linear_conv_kernel_dim": linear_conv_kernel_dim,
        "linear_key_head_dim": linear_head_dim,
        "linear_value_head_dim": linear_head_dim,
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "layer_types": layer_types,
        "max_position_embeddings": 65536,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": mrope_section,
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.25,
        },
        "pad_token_id": 0,
        "bos_token_id": None,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    if moe:
        text.update(
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": hidden_size,
                "shared_expert_intermediate_size": hidden_size,
            }
        )
    text.update(text_overrides)
    vision = {
        "depth": vision_depth,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": hidden_size,
        "num_position_embeddings": 64,
    }
    config_class = Qwen3_5MoeConfig if moe else Qwen3_5Config
    return config_class(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        **TINY_SPECIAL_IDS,
    )


#: `tiny_qwen3_5_config(moe=True, **QWEN3_5_35B_A3B_HEADS)`: Qwen3.5-35B-A3B's published head
#: layout (DeltaNet 16 key / 32 value heads of 128, attention 16 / 2 heads of 256, its vocabulary,
#: top-8 routing over experts of 512) cut to 4 layers, 8 experts and hidden size 256: a model whose
#: activations per token are shaped like the real one's, small enough for a CPU.
QWEN3_5_35B_A3B_HEADS: dict[str, Any] = {
    "vocab_size": 248_320,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_head_dim": 128,
    "num_experts": 8,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}


#: Head sizes vLLM's CPU kernels accept (`build_tiny_checkpoint(..., **VLLM_CPU_HEADS)`): the
#: DeltaNet key and value heads equal and of 64 or 128 (16 and 32 fail), attention heads of 32 or
#: more. The engine also needs bf16 weights at serving time (`--dtype bfloat16`).
VLLM_CPU_HEADS: dict[str, Any] = {"linear_head_dim": 64, "head_dim": 32}


#: Special tokens by id; ids 3-6 match `TINY_SPECIAL_IDS`, `<|im_end|>` (2) is the tiny eos.
SPECIAL_TOKENS = {
    0: "<|endoftext|>",
    1: "<|im_start|>",
    2: "<|im_end|>",
    TINY_SPECIAL_IDS["vision_start_token_id"]: "<|vision_start|>",
    TINY_SPECIAL_IDS["vision_end_token_id"]: "<|vision_end|>",
    TINY_SPECIAL_IDS["image_token_id"]: "<|image_pad|>",
    TINY_SPECIAL_IDS["video_token_id"]: "<|video_pad|>",
}

#: Qwen-style ChatML template; string or typed content, an image entry renders one image pad and
#: a video entry one video pad, each between vision start and end (as Qwen3.5's template does).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

#: Like a published Qwen3.5 preprocessor_config.json, with pixel bounds that keep a 32x32 digit
#: at 32x32 (2x2 patches, one image token after the 2x2 merge).
TINY_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "rescale_factor": 1 / 255,
    "resample": 3,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
}

#: Like a published Qwen3.5 video_preprocessor_config.json, with the tiny image bounds (which
#: apply to all sampled frames of a video together) and Qwen3-VL's sampling defaults.
TINY_VIDEO_PREPROCESSOR_CONFIG: dict[str, Any] = {
    **{k: v for k, v in TINY_PREPROCESSOR_CONFIG.items() if k != "image_processor_type"},
    "video_processor_type": "Qwen3VLVideoProcessor",
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
    "do_sample_frames": True,
}

#: What the tiny BPE is trained on.
_CORPUS = [
    "What digit is this?",
    "Which digit is shown in the image?",
    "You are a helpful assistant.",
    "system",
    "user",
    "assistant",
    "The answer is 0 1 2 3 4 5 6 7 8 9.",
    "Describe the picture. It shows a handwritten number on a dark background.",
    "This is a small gray image of a digit written by hand.",
    "Count the objects, read the text, and answer the question in one word.",
]


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Qwen3_5Tokenizer:
    """Train a byte-level BPE (Qwen's pre-tokenizer) and save it as a `Qwen3_5Tokenizer`.

    Specials sit at `SPECIAL_TOKENS` ids: pad `<|endoftext|>` 0, `<|im_start|>` 1, eos
    `<|im_end|>` 2, vision start/end 3/4, image/video pad 5/6. Total vocab <= vocab_size.
    """
    specials = [SPECIAL_TOKENS[i] for i in range(len(SPECIAL_TOKENS))]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS, trainer)
    model = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen3_5Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        unk_token=None,
        eos_token=SPECIAL_TOKENS[2],
        pad_token=SPECIAL_TOKENS[0],
        extra_special_tokens=[SPECIAL_TOKENS[1], *specials[3:]],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    for token_id, token in SPECIAL_TOKENS.items():
        if tokenizer.convert_tokens_to_ids(token) != token_id:
            raise RuntimeError(f"{token} got id {tokenizer.convert_tokens_to_ids(token)}")
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_tiny_checkpoint(
    out_dir: str | Path, moe: bool = False, seed: int = 0, tokenizer: bool = True, **config_overrides: Any
) -> Path:
    """Write a random-init tiny Qwen3.5 (MoE when `moe`) laid out like a published checkpoint.

    config.json + model.safetensors (save_pretrained), tokenizer files with chat_template.jinja,
    preprocessor_config.json naming Qwen2VLImageProcessorFast, and video_preprocessor_config.json.
    Without `tokenizer`, only config.json + model.safetensors (all a model load needs; the bench
    uses that). `config_overrides` go to `tiny_qwen3_5_config` (e.g. vocab_size: any size, the
    tokenizer then holds at most that many tokens). Global RNG state is left untouched.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_qwen3_5_config(moe=moe, **config_overrides)
    model_class = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.save_pretrained(str(out_dir))
    if not tokenizer:
        return out_dir
    build_tiny_tokenizer(out_dir, vocab_size=config.text_config.vocab_size)
    (out_dir / "preprocessor_config.json").write_text(
        json.dumps(TINY_PREPROCESSOR_CONFIG, indent=2) + "\n"
    )
    (out_dir / "video_preprocessor_config.json").write_text(
        json.dumps(TINY_VIDEO_PREPROCESSOR_CONFIG, indent=2) + "\n")
    return out_dir
