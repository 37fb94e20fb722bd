"""Offline demo assets: a digits VQA dataset beside a tiny Qwen3.5 checkpoint.

The digits are scikit-learn's bundled set (the `demo` extra), written as 32x32 PNGs with a
messages-format JSONL, and the training digits again as TRL preference pairs (`dpo_train.jsonl`:
chosen the right digit, rejected a wrong one, for launch/jobs/dpo_digits_sp2.json); the checkpoint is `vlmcp.model.tiny.build_tiny_checkpoint`'s, laid out like
a published Qwen3.5 checkpoint so the same loading code serves the demo and real models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlmcp.model.tiny import build_tiny_checkpoint

DIGIT_QUESTION = "What digit is this?"
DIGIT_IMAGE_SIZE = 32


@dataclass
class DemoAssets:
    """Paths of a complete offline demo."""

    checkpoint: Path
    train: Path
    eval: Path


def digit_splits(n_train: int, n_eval: int,
                 rng: np.random.Generator) -> tuple[Any, dict[str, np.ndarray]]:
    """scikit-learn's digits and disjoint random {"train", "eval"} index arrays drawn with `rng`."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    total = len(digits.target)
    if n_train + n_eval > total:
        raise ValueError(f"n_train + n_eval = {n_train + n_eval} exceeds the {total} digits")
    order = rng.permutation(total)
    return digits, {"train": order[:n_train], "eval": order[n_train:n_train + n_eval]}

def write_digits_dataset(
    out_dir: str | Path, n_train: int = 1500, n_eval: int = 297, seed: int = 0
) -> tuple[Path, Path]:
    """Write train.jsonl and eval.jsonl (disjoint) of scikit-learn's digits as 32x32 PNGs.

    Each line is the messages format: user "<image>What digit is this?", assistant the digit.
    Also writes dpo_train.jsonl (`write_digit_pairs`). Returns (train.jsonl, eval.jsonl).
    """
    digits, splits = digit_splits(n_train, n_eval, np.random.default_rng(seed))
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
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
    write_digit_pairs(paths[0], out_dir / "dpo_train.jsonl", seed)
    return paths[0], paths[1]


def write_digit_pairs(train_jsonl: Path, out_path: Path, seed: int = 0) -> Path:
    """TRL conversational preference pairs of the digits prompts of `train_jsonl`: chosen the
    right digit, rejected a wrong one drawn at random (seeded); the images stay where they are
    (out_path lies next to train_jsonl)."""
    rng = np.random.default_rng(seed)
    with out_path.open("w") as f:
        for line in train_jsonl.read_text().splitlines():
            record = json.loads(line)
            user, answer = record["messages"]
            wrong = [d for d in range(10) if str(d) != answer["content"]]
            rejected = {"role": "assistant", "content": str(int(rng.choice(wrong)))}
            f.write(json.dumps({"prompt": [user], "chosen": [answer], "rejected": [rejected],
                                "images": record["images"]}) + "\n")
    return out_path


def build_demo_assets(
    out_dir: str | Path, n_train: int = 1500, n_eval: int = 297, seed: int = 0, moe: bool = False
) -> DemoAssets:
    """Tiny checkpoint under out_dir/checkpoint and the digits dataset under out_dir/digits."""
    out_dir = Path(out_dir)
    checkpoint = build_tiny_checkpoint(out_dir / "checkpoint", moe=moe, seed=seed)
    train, eval_ = write_digits_dataset(out_dir / "digits", n_train, n_eval, seed)
    return DemoAssets(checkpoint=checkpoint, train=train, eval=eval_)
