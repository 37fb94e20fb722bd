"""Held-out evaluation: token loss on packed batches, and accuracy by greedy generation.

eval_loss: the sum of target-token cross-entropy over every held-out sample / their number of
targets (whatever `loss.type` trains), computed through the training module (packed, sharded like training). The eval packs are
dealt round-robin over data-parallel groups; a group short of packs repeats one with weight zero
so that every rank runs the same collectives.

eval_accuracy: for each held-out sample, the prompt is everything before its first target token
(for chat data: the conversation up to and including the first `<|im_start|>assistant\\n`), and
the sample counts as correct when plain Hugging Face greedy `generate` on that prompt reproduces
the sample's first run of target tokens exactly (for chat data: the first assistant reply and its
`<|im_end|>`), up to `eval.max_new_tokens` tokens. Samples are spread over all ranks; under
ZeRO-3 (each forward gathers the partitioned weights) and under expert parallelism (each MoE
layer's forward exchanges tokens with the EP group) every rank runs the same number of `generate`
calls with `synced_gpus`, so that every decoding step runs on every rank: a rank whose sample is
done keeps stepping until the last one is.

Nothing is decoded up front: packs and prompts are read back from data.eval's length index
(`SampleReader`) when they are needed, by the rank that needs them. A sample that fails to load
(with any exception) stops every rank with one error naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.data.formats import Sample
from vlmcp.data.pack import first_fit
from vlmcp.data.positions import IMAGE, VIDEO
from vlmcp.data.stream import SampleReader
from vlmcp.errors import PreflightError
from vlmcp.config.schema import LossTerm
from vlmcp.parallel import comm
from vlmcp.parallel.agree import attempt, fail_together, run_together
from vlmcp.parallel.groups import SequenceParallel

T = TypeVar("T")

#: Held-out loss is always token-mean cross-entropy, whatever `loss.type` trains.
EVAL_OBJECTIVE = LossTerm()


@dataclass
class GenerationPrompt:
    """What `generate` needs for one sample, and the tokens it should produce."""

    input_ids: torch.Tensor          # [1, L_prompt]
    mm_token_type_ids: torch.Tensor  # [1, L_prompt]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    reference: list[int]
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None

    def vision_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The image and video keyword arguments of `generate`, on `device`."""
        inputs = {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw,
                  "pixel_values_videos": self.pixel_values_videos,
                  "video_grid_thw": self.video_grid_thw}
        return {key: value.to(device) for key, value in inputs.items() if value is not None}


def _runs(mask: torch.Tensor) -> int:
    """Maximal runs of True in a [L] bool mask."""
    return int((mask & ~torch.cat([mask.new_zeros(1), mask[:-1]])).sum())


def _prompt_part(pixels: torch.Tensor | None, grid: torch.Tensor | None, runs: int,
                 runs_per_row: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The pixels and grid rows of the first `runs` placeholder runs (an image is one run of a
    grid row, a video temporal group one of a row's t runs: `runs_per_row`)."""
    if grid is None or runs == 0:
        return None, None
    rows, patches = [], 0
    for row, count in zip(grid.tolist(), runs_per_row.tolist()):
        if runs <= 0:
            break
        kept = min(count, runs)
        rows.append([row[0] * kept // count, row[1], row[2]])
        patches += rows[-1][0] * row[1] * row[2]
        runs -= kept
    return pixels[:patches], torch.tensor(rows, dtype=grid.dtype)


def generation_prompt(sample: Sample, max_new_tokens: int) -> GenerationPrompt:
    """Split a sample into its prompt (before the first target) and reference (first target
    run); the prompt keeps the images and video temporal groups before the first target."""
    labels = sample.labels
    first = next(t for t, label in enumerate(labels) if label != IGNORE_INDEX)
    last = first
    while last < len(labels) and labels[last] != IGNORE_INDEX:
        last += 1
    reference = sample.input_ids[first:min(last, first + max_new_tokens)]
    mm = sample.mm_token_type_ids[:first]
    image_grid, video_grid = sample.image_grid_thw, sample.video_grid_thw
    pixel_values, grid = _prompt_part(
        sample.pixel_values, image_grid, _runs(mm == IMAGE),
        None if image_grid is None else torch.ones(len(image_grid), dtype=torch.long))
    video_pixels, video_grid = _prompt_part(
        sample.pixel_values_videos, video_grid, _runs(mm == VIDEO),
        None if video_grid is None else video_grid[:, 0])
    return GenerationPrompt(
        input_ids=torch.tensor([sample.input_ids[:first]], dtype=torch.long),
        mm_token_type_ids=mm.unsqueeze(0).long(),
        pixel_values=pixel_values,
        image_grid_thw=grid,
        reference=list(reference),
        pixel_values_videos=video_pixels,
        video_grid_thw=video_grid,
    )


def _rounds(count: int, ways: int) -> int:
    return max(1, math.ceil(count / ways))


def _load_agreed(load: Callable[[], T]) -> T:
    """`load()` on every rank, then agree (one small all-reduce): every rank raises
    PreflightError when any rank could not load its data, whatever it raised (the lowest
    failing rank with the error naming the sample), so no rank is left waiting in the next
    collective."""
    return run_together(load, PreflightError, "evaluation")


@torch.no_grad()
def eval_loss(engine: nn.Module, reader: SampleReader, max_seq_len: int,
              sp: SequenceParallel) -> tuple[float, int]:
    """(mean target-token CE over the samples of `reader.index`, number of targets), identical
    on every rank. Packs are first-fit over the index's lengths and dealt round-robin over the DP
    groups; each rank loads only its own packs."""
    packs = first_fit(reader.index.tokens.tolist(), max_seq_len)
    totals = torch.zeros(2, dtype=torch.float64)
    for round_ in range(_rounds(len(packs), sp.dp_size)):
        index = round_ * sp.dp_size + sp.dp_rank
        batch = _load_agreed(lambda: reader.pack(packs[index % len(packs)]))
        loss_sum, count, _ = engine(batch, objective=EVAL_OBJECTIVE)
        if index < len(packs):
            totals += torch.tensor([float(loss_sum), float(count)], dtype=torch.float64)
    comm.all_reduce_sum(totals)
    return float(totals[0] / max(totals[1], 1.0)), int(totals[1])


@torch.no_grad()
def generation_accuracy(hf_model: nn.Module, reader: SampleReader, count: int,
                        max_new_tokens: int, *, synced: bool) -> tuple[float, int]:
    """(fraction of the first `count` samples of `reader.index` whose greedy continuation
    matches, samples), identical on every rank; each rank loads only its own samples.

    `synced`: every rank must take part in every forward (ZeRO-3, expert parallelism).
    """
    world, rank = comm.world_size(), comm.rank()
    device = next(hf_model.lm_head.parameters()).device
    was_training = hf_model.training
    hf_model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    rounds = _rounds(count, world) if synced else math.ceil(max(count - rank, 0) / world)
    problems: list[str] = []
    for round_ in range(rounds):
        index = round_ * world + rank
        if synced:
            sample = _load_agreed(lambda: reader.sample(index % count))
        else:
            sample, problems = attempt(lambda: reader.sample(index), "evaluation")
            if problems:
                break
        prompt = generation_prompt(sample, max_new_tokens)
        output = hf_model.generate(
            input_ids=prompt.input_ids.to(device),
            attention_mask=torch.ones_like(prompt.input_ids, device=device),
            mm_token_type_ids=prompt.mm_token_type_ids.to(device),
            max_new_tokens=len(prompt.reference),
            do_sample=False,
            use_cache=True,
            synced_gpus=synced,
            **prompt.vision_inputs(device),
        )
        generated = output[0, prompt.input_ids.shape[1]:].tolist()
        if index < count:
            totals += torch.tensor([float(generated == prompt.reference), 1.0], dtype=torch.float64)
    hf_model.train(was_training)
    fail_together(problems, PreflightError)
    comm.all_reduce_sum(totals)
    return float(totals[0] / max(totals[1], 1.0)), int(totals[1])
