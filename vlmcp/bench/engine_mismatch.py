"""`vlmcp bench --engine-mismatch`: an inference engine's logprobs against the trainer's, at lag 0.

The engine is a vLLM server from the engine venv (`make engine`; `vlmcp.engine.vllm_http`, bf16 on
CPU), started once on the first policy; every further policy is served in place
(`VllmHttpClient.serve`). The policies are `--model` (policy 0), then every complete published
step of `--weights` (a trainer's publish.dir, oldest first); without either, a random-init tiny
engine-compatible Qwen3.5 VLM built on the fly. For each policy the engine samples
`SAMPLES` answers of up to `NEW_TOKENS` tokens at `--temperature` for each of `IMAGE_PROMPTS`
digit image prompts (`/v1/chat/completions`, the image as a data URL, the rendered prompt
checked equal to vlmcp's) and `TEXT_PROMPTS` text prompts (`/v1/completions` on vlmcp's
chat-template tokens), with processed logprobs and `allowed_token_ids` = the ids a tokens-format
line may hold (below the tokenizer's length) other than the vision tokens.

The sampled answers become one rollout file (tokens format: prompt and answer, `temperatures`,
`inference_logprobs`, the image by absolute path), and the same weights score it, lag 0:

    vlmcp_fp32, vlmcp_bf16   `vlmcp score` (the trainer's own forward: packed, SP-sharded over
                             `--sp-size` ranks, its chunked lm_head) with model.dtype float32 or
                             bfloat16, in a process of its own each
    hf_fp32                  plain transformers, fp32, one forward per answer (the reference)
    hf_bf16                  the same in bf16 (DeltaNet in its chunked form, lm_head in bf16)
    hf_bf16_fp32_head        bf16, the lm_head's matmul in fp32 on the fp32 weights
    hf_bf16_decode           bf16, the prompt once and then the answer token by token with the
                             cache, as an engine decodes (DeltaNet in its recurrent form)

A side's logprobs are `log_softmax(logits / tau)` over the whole vocabulary, like the trainer's;
the engine's are over the allowed ids. The mask's own share, `mask_shift` = (masked - unmasked)
log_softmax of hf_fp32 per token, is added to every side before it is compared ("numeric": what
arithmetic alone costs); the vlmcp sides also report the comparison without it ("rows": what a
training row's mismatch metrics show on these samples). Per policy, prompt kind and side, with
d = side - engine per sampled token: `mismatch_kl` (the mean of k3 = exp(d) - 1 - d, the
trainer's `mismatch_kl`), `mean_diff` (the mean of engine - side, its `mismatch_logprob_diff`),
`max_abs_diff`, and `max_abs_from_hf_fp32` (the side's own distance from the reference). The
summary gives each side's `mismatch_kl` mean and max over the policies, beside PrimeRL's bar for
a new model (0.015).

The transformers sides load the whole model in fp32 and bf16 in this process: meant for the small
models a CPU runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForImageTextToText

from vlmcp.bench.jobs import scratch_folder
from vlmcp.data.formats import parse_record
from vlmcp.data.processor import VLProcessor, load_processor
from vlmcp.demo.assets import write_digits_dataset
from vlmcp.demo.image import torchrun_command
from vlmcp.engine.venv import engine_python, missing_engine, named_engine_python
from vlmcp.engine.vllm_http import CPU_ARGS, VllmHttpClient, VllmServer
from vlmcp.errors import EngineError
from vlmcp.rl.generation import image_part
from vlmcp.training.evaluate import generation_prompt
from vlmcp.training.weights.publish import published_steps

logger = logging.getLogger(__name__)

IMAGE_PROMPTS = 16
TEXT_PROMPTS = 8
SAMPLES = 4
NEW_TOKENS = 8
#: PrimeRL's acceptance bar for a new model: mismatch KL below this over 20 steps.
PRIMERL_BAR = 0.015
#: The text prompts: user turns, through the checkpoint's chat template.
TEXTS = ("Describe the picture.", "What digit is this?", "Count from one to five.",
         "Write one short sentence.", "Name a colour.", "Which number comes after seven?",
         "Say hello.", "Spell the word digit.")
#: The sides compared with the engine, in report order.
SIDES = ("vlmcp_fp32", "vlmcp_bf16", "hf_fp32", "hf_bf16", "hf_bf16_fp32_head", "hf_bf16_decode")


@dataclass
class DigitPrompt:
    """One digit question: its prompt tokens and pixels, the image path, the question's text."""

    input_ids: torch.Tensor          # [1, L]
    mm_token_type_ids: torch.Tensor  # [1, L]
    pixel_values: torch.Tensor       # [patches, C*T*P*P]
    image_grid_thw: torch.Tensor     # [1, 3]
    image: str
    question: str                    # the user's text beside the image


def load_prompts(jsonl: Path, processor: VLProcessor) -> list[DigitPrompt]:
    """The digit prompts of a messages-format file (`vlmcp.demo.assets`), as training renders
    them."""
    prompts = []
    for number, text in enumerate(jsonl.read_text().splitlines(), start=1):
        record = json.loads(text)
        sample = parse_record(record, f"{jsonl}:{number}", jsonl.parent, processor, 10**6)
        prompt = generation_prompt(sample, NEW_TOKENS)
        prompts.append(DigitPrompt(prompt.input_ids, prompt.mm_token_type_ids,
                                   prompt.pixel_values, prompt.image_grid_thw,
                                   sample.image_paths[0],
                                   record["messages"][0]["content"].replace("<image>", "")))
    return prompts


def chat_choices(client: VllmHttpClient, model_dir: Path, prompt: DigitPrompt,
                 **params: Any) -> list[dict]:
    """The `choices` of one `/v1/chat/completions` request for `prompt` (its image as a data
    URL beside its question; `params`: the sampling fields). Raises EngineError when the prompt
    tokens vLLM rendered are not vlmcp's own."""
    content = [{"type": "image_url", "image_url": {"url": image_part(Path(prompt.image))["url"]}},
               {"type": "text", "text": prompt.question}]
    out = client.post("/v1/chat/completions", {
        "model": str(model_dir), "messages": [{"role": "user", "content": content}],
        "return_token_ids": True, **params})
    if out["prompt_token_ids"] != prompt.input_ids[0].tolist():
        raise EngineError(f"{prompt.image}: the engine rendered prompt tokens "
                          f"{out['prompt_token_ids']}, vlmcp {prompt.input_ids[0].tolist()}; "
                          "the checkpoint's chat template and the tokens format disagree")
    return out["choices"]


@dataclass
class Answer:
    """One sampled answer: its prompt's kind and tokens (and image), its tokens, the engine's
    logprob of each."""

    kind: str                      # "image" or "text"
    prompt_ids: list[int]
    tokens: list[int]
    engine: list[float]
    image: DigitPrompt | None = None


def _policies(args: argparse.Namespace, scratch: Path) -> list[tuple[int, Path]]:
    """(policy step, directory) of every policy measured, in order."""
    from vlmcp.model.tiny import VLLM_CPU_HEADS, build_tiny_checkpoint

    policies = [(0, Path(args.model))] if args.model else []
    if args.weights:
        steps = sorted(published_steps(args.weights))
        if not steps:
            raise ValueError(f"--weights {args.weights}: no complete published step_N there")
        policies += [(step, Path(args.weights) / f"step_{step}") for step in steps]
    if not policies:
        # vocab_size 400: the tiny tokenizer then holds every id, so the mask is the vision ids
        policies = [(0, build_tiny_checkpoint(scratch / "model", seed=0, vocab_size=400,
                                              **VLLM_CPU_HEADS))]
    return policies


def _allowed_ids(processor: VLProcessor) -> list[int]:
    """The ids a tokens-format line may hold (below the tokenizer's length), less the vision
    tokens (placeholders without an image)."""
    tokenizer = processor.tokenizer
    vision = {tokenizer.convert_tokens_to_ids(t) for t in
              ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    return [i for i in range(len(tokenizer)) if i not in vision]


def _text_ids(processor: VLProcessor, text: str) -> list[int]:
    ids = processor.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _sample(client: VllmHttpClient, model_dir: Path, images: Sequence[DigitPrompt],
            texts: Sequence[list[int]], params: dict[str, Any]) -> list[Answer]:
    """The engine's answers to every image and text prompt (`params`: the sampling fields)."""
    answers = []
    for prompt in images:
        for choice in chat_choices(client, model_dir, prompt, logprobs=True, **params):
            answers.append(Answer("image", prompt.input_ids[0].tolist(), list(choice["token_ids"]),
                                  [t["logprob"] for t in choice["logprobs"]["content"]], prompt))
    for ids in texts:
        out = client.post("/v1/completions", {"model": str(model_dir), "prompt": ids,
                                              "logprobs": 0, "return_token_ids": True, **params})
        answers += [Answer("text", ids, list(c["token_ids"]), c["logprobs"]["token_logprobs"])
                    for c in out["choices"]]
    return [a for a in answers if a.tokens]


def _rollout_lines(answers: Sequence[Answer], tau: float) -> list[dict[str, Any]]:
    """Tokens-format lines of the answers: targets on the answer, its temperature and engine
    logprobs aligned with the labels (null on the prompt)."""
    lines = []
    for a in answers:
        off = [None] * len(a.prompt_ids)
        line = {"input_ids": a.prompt_ids + a.tokens,
                "labels": [-100] * len(a.prompt_ids) + a.tokens,
                "temperatures": off + [tau] * len(a.tokens),
                "inference_logprobs": off + list(a.engine)}
        if a.image is not None:
            line["images"] = [str(Path(a.image.image).resolve())]
        lines.append(line)
    return lines


def _vlmcp_score(policy: Path, dtype: str, data: Path, out_dir: Path, sp_size: int
                 ) -> list[float]:
    """`vlmcp score` of `data` on `policy` at model.dtype `dtype` (a process of its own,
    torchrun for `sp_size` > 1): every target's logprob, lines in order."""
    job = {"model": {"path": str(policy), "dtype": dtype},
           "data": {"train": str(data), "max_seq_len": 2048, "num_workers": 0},
           "parallel": {"sp_size": sp_size}, "deepspeed": {"zero_optimization": {"stage": 0}},
           "output_dir": str(out_dir)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "job.json").write_text(json.dumps(job, indent=1))
    scores = out_dir / "scores.jsonl"
    args = ["score", str(out_dir / "job.json"), "--out", str(scores)]
    if sp_size > 1:
        command, env = torchrun_command(sp_size, args)
    else:
        command, env = [sys.executable, "-m", "vlmcp", *args], None
    with (out_dir / "score.log").open("w") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        tail = (out_dir / "score.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise EngineError(f"vlmcp score of {policy} in {dtype} failed (exit {code}): "
                          + " | ".join(tail))
    return [v for text in scores.read_text().splitlines() for v in json.loads(text)["logprobs"]]


class _Fp32Head(torch.nn.Module):
    """An lm_head whose matmul runs in fp32: bf16 hidden states [..., H] upcast, times the fp32
    weight [V, H]; fp32 logits."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().float(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight)


def _vision(answer: Answer, dtype: torch.dtype, completion: int) -> dict[str, torch.Tensor]:
    """The vision inputs of an image answer's forward over its prompt and `completion` tokens."""
    if answer.image is None:
        return {}
    p = answer.image
    return {"pixel_values": p.pixel_values.to(dtype), "image_grid_thw": p.image_grid_thw,
            "mm_token_type_ids": torch.cat(
                [p.mm_token_type_ids, torch.zeros(1, completion, dtype=torch.long)], dim=1)}


@torch.no_grad()
def _whole_logits(model: torch.nn.Module, answer: Answer) -> torch.Tensor:
    """[answer tokens, V] logits of one forward over prompt + answer."""
    ids = torch.tensor([answer.prompt_ids + answer.tokens])
    dtype = next(model.parameters()).dtype
    logits = model(input_ids=ids, use_cache=False,
                   **_vision(answer, dtype, len(answer.tokens))).logits[0]
    return logits[len(answer.prompt_ids) - 1:-1]


@torch.no_grad()
def _decoded_logits(model: torch.nn.Module, answer: Answer) -> torch.Tensor:
    """[answer tokens, V] logits of the prompt's forward, then one cached step per answer token
    (transformers' recurrent DeltaNet form for those steps)."""
    dtype = next(model.parameters()).dtype
    out = model(input_ids=torch.tensor([answer.prompt_ids]), use_cache=True,
                **_vision(answer, dtype, 0))
    steps = [out.logits[0, -1]]
    for token in answer.tokens[:-1]:
        out = model(input_ids=torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
        steps.append(out.logits[0, -1])
    return torch.stack(steps)


def _logprobs(logits_of: Callable[[Answer], torch.Tensor], answers: Sequence[Answer], tau: float,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """[sum of answer tokens] float64 log_softmax(logits / tau) of the sampled tokens (`mask`:
    0 on the allowed ids, -inf elsewhere)."""
    out = []
    for answer in answers:
        logits = logits_of(answer).double() / tau
        if mask is not None:
            logits = logits + mask
        out.append(torch.log_softmax(logits, -1).gather(
            1, torch.tensor(answer.tokens)[:, None])[:, 0])
    return torch.cat(out)


def _hf_sides(policy: Path, answers: Sequence[Answer], tau: float, allowed: Sequence[int]
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The transformers sides' logprobs of the answers, and the mask's shift per token."""
    fp32 = AutoModelForImageTextToText.from_pretrained(str(policy), dtype=torch.float32).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    head = copy.deepcopy(bf16)
    head.lm_head = _Fp32Head(fp32.lm_head.weight)
    vocab = fp32.lm_head.weight.shape[0]
    mask = torch.full((vocab,), float("-inf"), dtype=torch.float64)
    mask[list(allowed)] = 0.0
    sides = {"hf_fp32": _logprobs(lambda a: _whole_logits(fp32, a), answers, tau)}
    shift = _logprobs(lambda a: _whole_logits(fp32, a), answers, tau, mask) - sides["hf_fp32"]
    sides["hf_bf16"] = _logprobs(lambda a: _whole_logits(bf16, a), answers, tau)
    sides["hf_bf16_fp32_head"] = _logprobs(lambda a: _whole_logits(head, a), answers, tau)
    sides["hf_bf16_decode"] = _logprobs(lambda a: _decoded_logits(bf16, a), answers, tau)
    return sides, shift


def _compare(side: torch.Tensor, engine: torch.Tensor, reference: torch.Tensor
             ) -> dict[str, float]:
    """The statistics of d = side - engine (see the module docstring)."""
    d = side - engine
    return {"mismatch_kl": float((torch.expm1(d) - d).mean()), "mean_diff": float((-d).mean()),
            "max_abs_diff": float(d.abs().max()),
            "max_abs_from_hf_fp32": float((side - reference).abs().max())}


def _policy_row(step: int, policy: Path, answers: Sequence[Answer], tau: float,
                allowed: Sequence[int], scratch: Path, sp_size: int) -> dict[str, Any]:
    """The report row of one policy: its answers scored by every side, compared by kind."""
    data = scratch / f"policy_{step}" / "rollouts.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(line) + "\n" for line in _rollout_lines(answers, tau)))
    started = time.perf_counter()
    sides, shift = _hf_sides(policy, answers, tau, allowed)
    hf_s = time.perf_counter() - started
    started = time.perf_counter()
    for name, dtype in (("vlmcp_fp32", "float32"), ("vlmcp_bf16", "bfloat16")):
        sides[name] = torch.tensor(_vlmcp_score(policy, dtype, data,
                                                scratch / f"policy_{step}" / dtype, sp_size),
                                   dtype=torch.float64)
    score_s = time.perf_counter() - started
    engine = torch.tensor([v for a in answers for v in a.engine], dtype=torch.float64)
    kinds = torch.tensor([a.kind == "image" for a in answers for _ in a.tokens])
    row: dict[str, Any] = {"policy_step": step, "path": str(policy), "transformers_s": round(hf_s, 1),
                           "vlmcp_score_s": round(score_s, 1), "kinds": {}}
    for kind, where in (("image", kinds), ("text", ~kinds)):
        if not where.any():
            continue
        reference = sides["hf_fp32"][where]
        entry: dict[str, Any] = {"tokens": int(where.sum()),
                                 "mask_shift_mean": float(shift[where].mean()),
                                 "engine_logprob_mean": float(engine[where].mean())}
        for name in SIDES:
            values = sides[name][where]
            entry[name] = {"numeric": _compare(values + shift[where], engine[where],
                                               reference + shift[where])}
            if name.startswith("vlmcp_"):
                entry[name]["rows"] = _compare(values, engine[where], reference)
        row["kinds"][kind] = entry
    return row


def _summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each side's numeric mismatch_kl (and the vlmcp sides' rows one) over the policies."""
    summary: dict[str, Any] = {}
    for kind in ("image", "text"):
        entries = [row["kinds"][kind] for row in rows if kind in row["kinds"]]
        if not entries:
            continue
        summary[kind] = {}
        for name in SIDES:
            for view in ("numeric", "rows"):
                values = [e[name][view]["mismatch_kl"] for e in entries if view in e[name]]
                if values:
                    summary[kind][f"{name}_{view}"] = {"mismatch_kl_mean": sum(values) / len(values),
                                                       "mismatch_kl_max": max(values),
                                                       "policies": len(values)}
    return summary


def run_engine_mismatch(args: argparse.Namespace) -> dict[str, Any]:
    """The `--engine-mismatch` report (see the module docstring)."""
    python = engine_python()
    if python is None:
        raise ValueError(f"--engine-mismatch needs the engine venv: "
                         f"{missing_engine(named_engine_python())}")
    tau, sp_size = args.temperature, args.sp_size or 1
    engine_log = Path(args.out).with_name(Path(args.out).stem + "-engine.log")
    with scratch_folder(args.scratch, "vlmcp-engine-mismatch-") as scratch:
        policies = _policies(args, scratch)
        processor = load_processor(policies[0][1])
        _, eval_jsonl = write_digits_dataset(scratch / "digits", n_train=1,
                                             n_eval=IMAGE_PROMPTS, seed=0)
        images = load_prompts(eval_jsonl, processor)
        texts = [_text_ids(processor, text) for text in TEXTS[:TEXT_PROMPTS]]
        allowed = _allowed_ids(processor)
        params = {"n": SAMPLES, "max_tokens": NEW_TOKENS, "temperature": tau,
                  "allowed_token_ids": allowed, "seed": 0}
        first_step, first = policies[0]
        server = VllmServer(python, first, engine_log,
                            args=(*CPU_ARGS, "--max-model-len", "1024", "--seed", "0"))
        start_s = server.start()
        rows = []
        try:
            weights = Path(args.weights) if args.weights else first.parent
            client = VllmHttpClient(server.url, weights, first, version=first_step,
                                    server=server)
            for step, policy in policies:
                served_s = client.serve(step).seconds if step != client.version else 0.0
                started = time.perf_counter()
                answers = _sample(client, first, images, texts, params)
                sample_s = time.perf_counter() - started
                rows.append({**_policy_row(step, policy, answers, tau, allowed, scratch,
                                           sp_size),
                             "serve_s": round(served_s, 2), "sample_s": round(sample_s, 1)})
                logger.info("engine mismatch, policy %d: %s", step, json.dumps(
                    {kind: {name: e[name]["numeric"]["mismatch_kl"] for name in SIDES}
                     for kind, e in rows[-1]["kinds"].items()}))
        finally:
            server.stop()
    return {"mode": "engine_mismatch", "engine": "vLLM server (engine venv), bf16",
            "engine_log": str(engine_log), "engine_start_s": round(start_s, 1), "temperature": tau, "sp_size": sp_size,
            "prompts": {"image": len(images), "text": len(texts)}, "samples_per_prompt": SAMPLES,
            "max_new_tokens": NEW_TOKENS, "primerl_bar": PRIMERL_BAR, "policies": rows,
            "summary": _summary(rows)}
