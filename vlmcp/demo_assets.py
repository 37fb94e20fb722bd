"""Offline demo assets: a digits VQA dataset, a tiny tokenizer and a tiny Qwen3.5 checkpoint.

Everything is generated locally (scikit-learn's bundled digits, a BPE trained on a built-in
corpus, random-init weights), laid out like a published Qwen3.5 checkpoint so the same loading
code serves the demo and real models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer

from vlmcp.model.tiny import TINY_SPECIAL_IDS, tiny_qwen3_5_config

DIGIT_QUESTION = "What digit is this?"
DIGIT_IMAGE_SIZE = 32

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

_CORPUS = [
    DIGIT_QUESTION,
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


@dataclass
class DemoAssets:
    """Paths of a complete offline demo."""

    checkpoint: Path
    train: Path
    eval: Path


def write_digits_dataset(
    out_dir: str | Path, n_train: int = 1500, n_eval: int = 297, seed: int = 0
) -> tuple[Path, Path]:
    """Write train.jsonl and eval.jsonl (disjoint) of scikit-learn's digits as 32x32 PNGs.

    Each line is the messages format: user "<image>What digit is this?", assistant the digit.
    Returns (train.jsonl, eval.jsonl).
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    total = len(digits.target)
    if n_train + n_eval > total:
        raise ValueError(f"n_train + n_eval = {n_train + n_eval} exceeds the {total} digits")
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    order = np.random.default_rng(seed).permutation(total)
    splits = {"train": order[:n_train], "eval": order[n_train:n_train + n_eval]}
    paths = []
    for split, indices in splits.items():
        path = out_dir / f"{split}.jsonl"
        with path.open("w") as f:
            for index in indices.tolist():
                image_path = f"images/{index:04d}.png"
                pixels = (digits.images[index] * (255 / 16)).round().astype(np.uint8)
                image = Image.fromarray(pixels, mode="L").resize(
                    (DIGIT_IMAGE_SIZE, DIGIT_IMAGE_SIZE), Image.NEAREST
                )
                image.save(out_dir / image_path)
                record = {
                    "messages": [
                        {"role": "user", "content": f"<image>{DIGIT_QUESTION}"},
                        {"role": "assistant", "content": str(int(digits.target[index]))},
                    ],
                    "images": [image_path],
                }
                f.write(json.dumps(record) + "\n")
        paths.append(path)
    return paths[0], paths[1]


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


def build_demo_assets(
    out_dir: str | Path, n_train: int = 1500, n_eval: int = 297, seed: int = 0, moe: bool = False
) -> DemoAssets:
    """Tiny checkpoint under out_dir/checkpoint and the digits dataset under out_dir/digits."""
    out_dir = Path(out_dir)
    checkpoint = build_tiny_checkpoint(out_dir / "checkpoint", moe=moe, seed=seed)
    train, eval_ = write_digits_dataset(out_dir / "digits", n_train, n_eval, seed)
    return DemoAssets(checkpoint=checkpoint, train=train, eval=eval_)
