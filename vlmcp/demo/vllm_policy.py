"""`vlmcp demo --rl --engine vllm`: the RL demo's policy served by a vLLM server (docs/demo.md).

The server runs in a process of its own from the engine venv (`make engine`;
`vlmcp.engine.vllm_http.VllmServer`), bf16, on the warm start's weights. With `pushed` (the
default of `vlmcp demo --rl --engine vllm`) the trainer pushes every step into the server itself
(publish.engines, docs/rl-loop.md): the newest version is the one the server reports (GET
/weight_info), and taking it loads nothing. Requests are labelled with the version served when
the step's sampling began: a push that lands during it (in wait mode, after the requests in
flight finished) makes the later requests one version newer than their label, never older, and
their logprobs are always the sampling engine's own. Without `pushed`, `reload` serves each newer
published step through `VllmHttpClient` (pause, reload in place, both caches reset, the version
label, resume). Sampling mirrors the transformers policy of `vlmcp.demo.orchestrator`:
`group` answers per prompt at temperature 1 over the full distribution, except the vision tokens
and the ids beyond the tokenizer (`allowed_token_ids`: the same mask as its `suppress_tokens`),
with each sampled token's logprob after that mask (`--logprobs-mode processed_logprobs`).
Prompts go to `/v1/chat/completions` (the image as a data URL), concurrently so that the engine
batches them; the prompt tokens vLLM renders must equal vlmcp's own (checked), so the rollout
lines the orchestrator writes hold exactly what the engine saw.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vlmcp.data.processor import VLProcessor
from vlmcp.demo.orchestrator import MAX_NEW_TOKENS, Completion, DigitPrompt, newest_published
from vlmcp.engine.vllm_http import CPU_ARGS, PUSH_ARGS, VllmHttpClient, VllmServer
from vlmcp.errors import EngineError

#: Concurrent requests: enough for the engine to batch a step's prompts.
CONCURRENCY = 32


def chat_choices(client: VllmHttpClient, model_dir: Path, prompt: DigitPrompt,
                 **params: Any) -> list[dict]:
    """The `choices` of one `/v1/chat/completions` request for `prompt` (its image as a data
    URL beside its question; `params`: the sampling fields, `return_token_ids` is set). Raises
    EngineError when the prompt tokens vLLM rendered are not vlmcp's own."""
    image = base64.b64encode(Path(prompt.image).read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
               {"type": "text", "text": prompt.question}]
    out = client.post("/v1/chat/completions", {
        "model": str(model_dir), "messages": [{"role": "user", "content": content}],
        "return_token_ids": True, **params})
    if out["prompt_token_ids"] != prompt.input_ids[0].tolist():
        raise EngineError(f"{prompt.image}: the engine rendered prompt tokens "
                          f"{out['prompt_token_ids']}, vlmcp {prompt.input_ids[0].tolist()}; "
                          "the checkpoint's chat template and the tokens format disagree")
    return out["choices"]


class VllmPolicy:
    """The orchestrator's engine: a vLLM server at one policy version (the interface of
    `vlmcp.demo.orchestrator.Policy`)."""

    def __init__(self, python: str | Path, model_dir: Path, weights_dir: Path,
                 processor: VLProcessor, log: Path, *, pushed: bool = True):
        self.pushed = pushed
        self.server = VllmServer(python, model_dir, log,
                                 args=(*CPU_ARGS, *(PUSH_ARGS if pushed else ()),
                                       "--max-model-len", "256", "--seed", "0"))
        self.start_s = self.server.start()
        self.model_dir = model_dir
        self.client = VllmHttpClient(self.server.url, weights_dir, model_dir, server=self.server)
        self._version = 0
        tokenizer = processor.tokenizer
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        vision = {tokenizer.convert_tokens_to_ids(t) for t in
                  ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
        self.allowed = [i for i in range(len(tokenizer)) if i not in vision]
        self.pool = ThreadPoolExecutor(CONCURRENCY)

    @property
    def version(self) -> int:
        return self._version if self.pushed else self.client.version

    @property
    def url(self) -> str:
        """The server's base URL (the trainer's publish.engines)."""
        return self.server.url

    def newest_available(self, weights: Path) -> int:
        """The newest version it can serve: the one pushed into the server, or the newest step
        published in `weights`."""
        return int(self.client.engine_version) if self.pushed else newest_published(weights)

    def reload(self, published: Path, version: int) -> None:
        """Serve version `version`: pushed, it already does; else load WEIGHTS/step_`version`
        (`published`, a step of the client's weights_dir) in place."""
        if self.pushed:
            self._version = version
        else:
            self.client.serve(version)

    def _request(self, prompt: DigitPrompt, **params: Any) -> list[dict]:
        return chat_choices(self.client, self.model_dir, prompt, max_tokens=MAX_NEW_TOKENS,
                            allowed_token_ids=self.allowed, **params)

    def _completion(self, choice: dict) -> Completion:
        tokens = list(choice["token_ids"])
        values = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        end = tokens.index(self.eos) + 1 if self.eos in tokens else len(tokens)
        return Completion(tokens[:end], values[:end], self.version)

    def sample(self, prompts: Sequence[DigitPrompt], group: int, seed: int
               ) -> list[list[Completion]]:
        """`group` answers per prompt at temperature 1, each token's logprob after the mask."""
        answers = self.pool.map(lambda item: self._request(
            item[1], n=group, temperature=1.0, top_p=1.0, top_k=-1, logprobs=True,
            seed=seed * len(prompts) + item[0]), enumerate(prompts))
        return [[self._completion(c) for c in choices] for choices in answers]

    def accuracy(self, prompts: Sequence[DigitPrompt]) -> float:
        """The fraction of `prompts` whose greedy answer is exactly the right one."""
        answers = self.pool.map(lambda p: self._request(p, n=1, temperature=0.0)[0], prompts)
        return sum(list(a["token_ids"])[:len(p.answer)] == p.answer
                   for a, p in zip(answers, prompts)) / len(prompts)

    def close(self) -> None:
        """Stop the server."""
        self.pool.shutdown()
        self.client.close()
