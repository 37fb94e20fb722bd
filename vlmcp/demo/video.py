"""`vlmcp demo --video`: video question answering, offline, on 2 CPU ranks at SP 2.

1. Build the assets: a tiny random-init Qwen3.5 checkpoint (the image demo's) and synthetic
   clips made from scikit-learn's digits: each clip has 4 to 8 temporal groups (8 to 16 frames at
   2 fps, so the checkpoint's 2 fps sampling keeps every frame); one random group shows a digit
   (32x32, in both of its frames), every other frame is noise. Clips are H.264 mp4 files written
   with PyAV (crf 0); records are messages ("<video>Which digit appears in the video?" -> "7"),
   with a held-out split.
2. Train with `torchrun --nproc_per_node 2 -m vlmcp train` at sequence-parallel size 2: each
   pack is split over both ranks and so is its vision work, group by group.
3. Held-out accuracy by greedy generation on the held-out clips (`eval_accuracy` rows of
   OUT/metrics.jsonl); the curves go to OUT/loss_accuracy.png.

The answer needs more than one frame: the digit's group is anywhere in the clip. The learning
rate is half the image demo's: at 2e-3 this task stayed at the answer prior (loss ~1.15: the
digits' entropy over two target tokens) for 500 steps with noise frames (1150 with blank ones);
at 1e-3 it left it after ~150 (single-process runs of this job).
Exits non-zero when training fails or the final held-out accuracy is below 80 %.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image

from vlmcp.demo.assets import DIGIT_IMAGE_SIZE, digit_splits
from vlmcp.demo.image import DEMO_MODEL, demo_job, train_and_report
from vlmcp.model.tiny import build_tiny_checkpoint

TARGET_ACCURACY = 0.80
VIDEO_QUESTION = "Which digit appears in the video?"
#: Native frame rate of the clips: the checkpoint samples 2 fps, so every frame is kept.
CLIP_FPS = 2
#: Temporal groups per clip, drawn uniformly from this range (inclusive).
MIN_GROUPS, MAX_GROUPS = 4, 8


def _write_clip(path: Path, frames: list[np.ndarray]) -> None:
    """Frames ([32, 32] uint8 gray) as an H.264 mp4 at CLIP_FPS."""
    with av.open(str(path), "w") as output:
        stream = output.add_stream("libx264", rate=Fraction(CLIP_FPS))
        stream.width = stream.height = DIGIT_IMAGE_SIZE
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "0", "preset": "ultrafast"}
        for pixels in frames:
            frame = av.VideoFrame.from_ndarray(np.repeat(pixels[:, :, None], 3, 2), format="rgb24")
            output.mux(stream.encode(frame))
        output.mux(stream.encode())


def write_digit_clips(out_dir: str | Path, n_train: int = 1500, n_eval: int = 200,
                      seed: int = 0) -> tuple[Path, Path]:
    """Write train.jsonl and eval.jsonl (disjoint digits) with their clips under clips/ (see the
    module docstring). Returns (train.jsonl, eval.jsonl)."""
    rng = np.random.default_rng(seed)
    digits, splits = digit_splits(n_train, n_eval, rng)
    out_dir = Path(out_dir)
    (out_dir / "clips").mkdir(parents=True, exist_ok=True)
    paths = []
    for split, indices in splits.items():
        path = out_dir / f"{split}.jsonl"
        with path.open("w") as f:
            for index in indices.tolist():
                digit = (digits.images[index] * (255 / 16)).round().astype(np.uint8)
                digit = np.asarray(Image.fromarray(digit, mode="L").resize(
                    (DIGIT_IMAGE_SIZE, DIGIT_IMAGE_SIZE), Image.NEAREST))
                groups = int(rng.integers(MIN_GROUPS, MAX_GROUPS + 1))
                shown = int(rng.integers(groups))
                frames = [digit if k // 2 == shown else
                          rng.integers(0, 256, digit.shape, dtype=np.uint8)
                          for k in range(2 * groups)]
                clip = f"clips/{index:04d}.mp4"
                _write_clip(out_dir / clip, frames)
                f.write(json.dumps({
                    "messages": [{"role": "user", "content": f"<video>{VIDEO_QUESTION}"},
                                 {"role": "assistant", "content": str(int(digits.target[index]))}],
                    "videos": [clip]}) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def video_demo_job(assets_dir: Path, out_dir: Path, sp_size: int) -> dict[str, Any]:
    """The video demo's job: the image demo's on the clips, at a lower rate for longer."""
    return demo_job(assets_dir, out_dir, sp_size, data="clips", lr=1e-3, max_steps=600,
                    eval_every=200)


def run_video_demo(out_dir: str | Path = "runs/demo_video", nproc: int = 2, sp_size: int = 2,
                   steps: int | None = None, overrides: Sequence[str] = ()) -> int:
    """Build, train, evaluate and plot; returns the process exit code."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    build_tiny_checkpoint(out / "assets" / "checkpoint", moe=False, seed=0, **DEMO_MODEL)
    write_digit_clips(out / "assets" / "clips", seed=0)
    return train_and_report(out, video_demo_job(out / "assets", out, sp_size), nproc, sp_size,
                            steps, overrides, time.perf_counter() - started,
                            target=TARGET_ACCURACY,
                            title="vlmcp demo --video: which digit appears, tiny Qwen3.5")
