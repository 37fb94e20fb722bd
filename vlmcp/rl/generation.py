"""One prompt's group: the engine request, the answers as the engine returned them, the rewards.

The request (`generate_request`) is vLLM's token-in/token-out `/inference/v1/generate`: the
prompt's token ids as training renders them, its images as data URLs (`content_parts`: the
engine's own processor makes the pixels, as it does for its chat endpoint), `n` answers sampled
with the job's temperature, top-p, top-k and length limit, each token's logprob after the
temperature and the sampling mask (the engine runs `--logprobs-mode processed_logprobs`), and a
seed per prompt position (vLLM seeds answer i with seed + i). `answers_of` reads the answers back
without re-tokenising anything: the engine's token ids, its logprobs, and each token's policy
version from the engine's `weight_versions` spans (under a keep-mode push one answer spans two
versions); it checks that the engine's prompt tokens after placeholder expansion are vlmcp's.
"""

from __future__ import annotations

import base64
import mimetypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmcp.data.processor import VLProcessor
from vlmcp.errors import OrchestratorError
from vlmcp.rl.engines import engine_version
from vlmcp.rl.steps import Answer


def sampling_mask(processor: VLProcessor) -> list[int]:
    """rl.sampling_mask "text": every id of the tokenizer but the vision placeholders (an answer
    holding one would need an image it does not have); the ids the model's vocabulary has beyond
    the tokenizer's are left out too (no text, and no sample may hold them)."""
    tokenizer = processor.tokenizer
    vision = {processor.image_token_id, processor.vision_start_id, processor.vision_end_id,
              processor.video_token_id}
    return [i for i in range(len(tokenizer)) if i not in vision]


def image_part(path: Path) -> dict[str, str]:
    """A `content_parts` entry carrying the image file at `path` as a data URL."""
    mime = mimetypes.guess_type(path.name)[0] or "image/png"
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return {"type": "image_url", "url": f"data:{mime};base64,{data}"}


def generate_request(prompt_ids: Sequence[int], images: Sequence[Path], *, n: int,
                     temperature: float, top_p: float, top_k: int | None, max_tokens: int,
                     allowed: Sequence[int] | None, seed: int | None) -> dict[str, Any]:
    """The body of one `/inference/v1/generate` request (see the module docstring); temperature
    0 is greedy."""
    sampling: dict[str, Any] = {"n": n, "temperature": temperature, "top_p": top_p,
                                "top_k": top_k or -1, "max_tokens": max_tokens, "logprobs": 0}
    if allowed is not None:
        sampling["allowed_token_ids"] = list(allowed)
    if seed is not None:
        sampling["seed"] = seed
    body: dict[str, Any] = {"token_ids": list(prompt_ids), "sampling_params": sampling,
                            "return_token_ids": True}
    if images:
        body["content_parts"] = [image_part(p) for p in images]
    return body


def _versions(choice: dict[str, Any], count: int, url: str, source: str) -> list[int]:
    spans = choice.get("weight_versions")
    if not spans:
        raise OrchestratorError([f"{source}: engine {url} returned no weight_versions (vLLM 0.32's "
                                 "/inference/v1/generate reports them)"])
    versions: list[int | None] = [None] * count
    for span in spans:
        version = engine_version(str(span["version"]), url)
        versions[span["start"]:span["end"]] = [version] * (span["end"] - span["start"])
    if any(v is None for v in versions):
        raise OrchestratorError([f"{source}: engine {url}'s weight_versions {spans} do not cover "
                                 f"its {count} answer tokens"])
    return versions  # type: ignore[return-value]


def answers_of(reply: dict[str, Any], prompt_ids: Sequence[int], url: str, source: str
               ) -> list[Answer]:
    """The answers of one engine reply (see the module docstring). Raises OrchestratorError
    naming the prompt's `source` when the engine's prompt tokens are not `prompt_ids`."""
    engine_prompt = reply.get("prompt_token_ids")
    if engine_prompt is not None and list(engine_prompt) != list(prompt_ids):
        raise OrchestratorError([
            f"{source}: the engine {url} expanded the prompt to {len(engine_prompt)} tokens, "
            f"vlmcp renders {len(prompt_ids)}: its image processor sizes the images otherwise "
            "than the checkpoint's preprocessor_config.json does for vlmcp (the same checkpoint "
            "on both sides?)"])
    answers = []
    for choice in reply["choices"]:
        tokens = list(choice["token_ids"])
        logprobs = [entry["logprob"] for entry in (choice.get("logprobs") or {}).get("content")
                    or []]
        if len(logprobs) != len(tokens):
            raise OrchestratorError([f"{source}: engine {url} returned {len(logprobs)} logprobs "
                                     f"for {len(tokens)} tokens"])
        answers.append(Answer(tokens, logprobs, _versions(choice, len(tokens), url, source),
                              choice.get("finish_reason") == "length"))
    return answers
