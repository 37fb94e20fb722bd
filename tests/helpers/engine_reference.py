"""Transformers' logprobs of tokens an inference engine sampled: the references of the engine tests.

The engine samples from `log_softmax(masked logits / tau)`: its logprobs are processed
(`--logprobs-mode processed_logprobs`) after the temperature and after `allowed_token_ids`, whose
mask renormalises over the allowed ids. The reference computes exactly that from plain
transformers on the same weights: in float64 (`float64_reference`, the truth) and in bf16 (what
bf16 itself costs on this machine), each completion forwarded alone after its prompt.

`NEEDS_ENGINE` marks a test that needs the engine venv (`vlmcp.engine.venv`: one whose build
finished). Where it is missing, the test skips on a developer's machine and fails in CI
(`CI=true`, as `.ci/run` sets it), so that CI never passes without its engine tests
(`require_engine`, which tests/conftest.py applies to every marked test). The prompts the engine
tests send: `image_request` (a digit record as a chat request, the image as a data URL, beside
vlmcp's own `Prompt` of it), `text_prompt_ids`, and `demo_allowed_ids` (the RL demo's sampling
mask).
"""

from __future__ import annotations

import base64
import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForImageTextToText

from tests.helpers.parity import float64_reference
from vlmcp.data.formats import parse_record
from vlmcp.data.processor import VLProcessor
from vlmcp.training.evaluate import generation_prompt

#: The engine tests' sampling: temperature, answers per prompt, tokens per answer.
TAU = 0.8
SAMPLES = 4
NEW_TOKENS = 4
#: The mark of every test that needs the engine venv (`make engine`, or $VLMCP_ENGINE_PYTHON):
#: tests/conftest.py calls `require_engine` before each such test.
NEEDS_ENGINE = pytest.mark.needs_engine


def in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this run is CI's: $CI is "true" or "1" (any case), as CI services and .ci/run set
    it; the Makefile's `test` target reads it the same way."""
    return environ.get("CI", "").lower() in ("true", "1")


def require_engine(missing: str | None, ci: bool) -> None:
    """Before a NEEDS_ENGINE test: nothing when the engine venv is there (`missing` is None);
    else skip the test naming `missing` (why there is none), or fail it under `ci`, where the
    engine tests must run."""
    if missing is None:
        return
    if ci:
        pytest.fail(f"the engine tests must run in CI ($CI is set), but {missing}", pytrace=False)
    pytest.skip(f"{missing} (make test builds it when it can)")


@dataclass
class Prompt:
    """A prompt's tokens and, for an image prompt, its vision inputs."""

    input_ids: list[int]
    pixel_values: torch.Tensor | None = None     # [patches, C*T*P*P]
    image_grid_thw: torch.Tensor | None = None   # [images, 3]
    mm_token_type_ids: torch.Tensor | None = None  # [1, L]


def demo_allowed_ids(processor: VLProcessor) -> list[int]:
    """The RL demo's sampling mask: no vision tokens (ids 3-6), no ids beyond the tokenizer."""
    return [i for i in range(len(processor.tokenizer)) if i not in (3, 4, 5, 6)]


def image_request(record: dict[str, Any], name: str, root: Path, processor: VLProcessor,
                  new_tokens: int) -> tuple[list[dict[str, Any]], Prompt]:
    """The chat messages of a messages-format digit `record` (its image as a data URL, its text
    without the `<image>` marker) and vlmcp's generation `Prompt` of the same record."""
    sample = parse_record(record, name, root, processor, 10**6)
    prompt = generation_prompt(sample, new_tokens)
    image = (root / record["images"][0]).read_bytes()
    content = [{"type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}},
               {"type": "text", "text": record["messages"][0]["content"].replace("<image>", "")}]
    return ([{"role": "user", "content": content}],
            Prompt(prompt.input_ids[0].tolist(), prompt.pixel_values, prompt.image_grid_thw,
                   prompt.mm_token_type_ids))


def text_prompt_ids(processor: VLProcessor, text: str = "Describe the picture.") -> list[int]:
    """The chat template's tokens of one user turn `text` and the assistant's header."""
    ids = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


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
    checkpoint's fp32 weights (a dense Qwen3.5 or its MoE, as its config.json names)."""
    model = AutoModelForImageTextToText.from_pretrained(str(checkpoint),
                                                        dtype=torch.float32).eval()
    ref64 = float64_reference(_masked_logprobs, model, prompt, completions, tau, allowed)
    ref_bf16 = _masked_logprobs(copy.deepcopy(model).to(torch.bfloat16), prompt, completions,
                                tau, allowed)
    return ref64, ref_bf16
