"""Transformers' logprobs of tokens an inference engine sampled: the references of the engine tests.

The engine samples from `log_softmax(masked logits / tau)`: its logprobs are processed
(`--logprobs-mode processed_logprobs`) after the temperature and after `allowed_token_ids`, whose
mask renormalises over the allowed ids. The reference computes exactly that from plain
transformers on the same weights: in float64 (`float64_reference`, the truth) and in bf16 (what
bf16 itself costs on this machine), each completion forwarded alone after its prompt.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen3_5ForConditionalGeneration

from tests.helpers.parity import float64_reference


@dataclass
class Prompt:
    """A prompt's tokens and, for an image prompt, its vision inputs."""

    input_ids: list[int]
    pixel_values: torch.Tensor | None = None     # [patches, C*T*P*P]
    image_grid_thw: torch.Tensor | None = None   # [images, 3]
    mm_token_type_ids: torch.Tensor | None = None  # [1, L]


@torch.no_grad()
def _masked_logprobs(model: torch.nn.Module, prompt: Prompt, completions: Sequence[list[int]],
                     tau: float, allowed: Sequence[int]) -> torch.Tensor:
    """[sum of completion lengths] float64: each token's log_softmax(masked logits / tau)."""
    dtype = next(model.parameters()).dtype
    out = []
    for tokens in completions:
        ids = torch.tensor([prompt.input_ids + list(tokens)])
        vision = {}
        if prompt.pixel_values is not None:
            vision = {"pixel_values": prompt.pixel_values.to(dtype),
                      "image_grid_thw": prompt.image_grid_thw,
                      "mm_token_type_ids": torch.cat(
                          [prompt.mm_token_type_ids,
                           torch.zeros(1, len(tokens), dtype=torch.long)], dim=1)}
        logits = model(input_ids=ids, use_cache=False, **vision).logits[0]
        logits = logits[len(prompt.input_ids) - 1:-1].to(torch.float64)
        mask = torch.full((logits.shape[-1],), float("-inf"), dtype=torch.float64)
        mask[list(allowed)] = 0.0
        logp = torch.log_softmax(logits / tau + mask, dim=-1)
        out.append(logp.gather(1, torch.tensor(tokens)[:, None])[:, 0])
    return torch.cat(out)


def reference_logprobs(checkpoint: str | Path, prompt: Prompt, completions: Sequence[list[int]],
                       tau: float, allowed: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64, bf16) transformers logprobs of `completions` after `prompt`, from the
    checkpoint's fp32 weights."""
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(checkpoint),
                                                            dtype=torch.float32).eval()
    ref64 = float64_reference(_masked_logprobs, model, prompt, completions, tau, allowed)
    ref_bf16 = _masked_logprobs(copy.deepcopy(model).to(torch.bfloat16), prompt, completions,
                                tau, allowed)
    return ref64, ref_bf16
