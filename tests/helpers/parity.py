"""Shared pieces of the parity tests: synthetic packs and the plain-transformers reference.

The reference never touches vlmcp's model code: a separate, untouched transformers model forwards
every sample alone (batch of one, no packing), and the step loss is sum(CE) / N over all samples.
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
from vlmcp.model.tiny import tiny_qwen3_5_config


@dataclass
class RawSample:
    """One sample: input_ids [L], labels [L] (HF convention), its images' pixels and grids."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None


def build_model(moe: bool = False, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random-init tiny Qwen3.5 VLM in fp32 with sdpa everywhere."""
    config = tiny_qwen3_5_config(moe=moe, **overrides)
    cls = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.conv1d.weight.normal_(0, 0.3)
                layer.linear_attn.A_log.uniform_(-1.0, 1.0)
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(0, 0.1)
    return model.eval()


def make_sample(
    gen: torch.Generator, config, length: int, grids: list[tuple[int, int, int]] = (), image_at: int = 3
) -> RawSample:
    """Random tokens with one `<vision_start> N*<image> <vision_end>` run per grid, placed from
    `image_at`; labels on every later text token (like an answer) and none on image tokens."""
    merge = config.vision_config.spatial_merge_size
    specials = {config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id}
    vocab = [t for t in range(8, config.text_config.vocab_size)]
    ids: list[int] = [vocab[int(torch.randint(len(vocab), (1,), generator=gen))] for _ in range(image_at)]
    for t, h, w in grids:
        ids += [config.vision_start_token_id] + [config.image_token_id] * (t * h * w // merge**2) + [config.vision_end_token_id]
    while len(ids) < length:
        ids.append(vocab[int(torch.randint(len(vocab), (1,), generator=gen))])
    if len(ids) != length:
        raise ValueError(f"sample of {len(ids)} tokens does not fit length {length}")
    input_ids = torch.tensor(ids)
    labels = input_ids.clone()
    labels[: length // 3] = IGNORE_INDEX
    labels[torch.tensor([i in specials for i in ids])] = IGNORE_INDEX
    pixel_values = grid = None
    if grids:
        patch_dim = 3 * config.vision_config.temporal_patch_size * config.vision_config.patch_size**2
        n = sum(t * h * w for t, h, w in grids)
        pixel_values = torch.randn(n, patch_dim, generator=gen)
        grid = torch.tensor(grids)
    return RawSample(input_ids, labels, pixel_values, grid)


def mm_token_type_ids(sample: RawSample, config) -> torch.Tensor:
    return (sample.input_ids == config.image_token_id).int()


def pack(samples: list[RawSample], model) -> PackedBatch:
    """PackedBatch of `samples`, positions from the model's own rope index for each sample alone."""
    config = model.config
    positions, targets = [], []
    for s in samples:
        pos, _ = model.model.get_rope_index(
            s.input_ids[None], mm_token_type_ids(s, config)[None], image_grid_thw=s.image_grid_thw
        )
        positions.append(pos[:, 0])
        shifted = torch.full_like(s.labels, IGNORE_INDEX)
        shifted[:-1] = s.labels[1:]
        targets.append(shifted)
    pixels = [s.pixel_values for s in samples if s.pixel_values is not None]
    grids = [s.image_grid_thw for s in samples if s.image_grid_thw is not None]
    return PackedBatch(
        input_ids=torch.cat([s.input_ids for s in samples]),
        targets=torch.cat(targets),
        position_ids=torch.cat(positions, dim=1),
        mm_token_type_ids=torch.cat([mm_token_type_ids(s, config) for s in samples]),
        seq_lens=[len(s.input_ids) for s in samples],
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        sample_ids=[f"sample{i}" for i in range(len(samples))],
    )


def reference_loss_and_grads(model, samples: list[RawSample]) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain transformers, each sample forwarded alone: loss = sum CE / N and its gradients."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    n_total = sum(int((s.labels[1:] != IGNORE_INDEX).sum()) for s in samples)
    total = 0.0
    for s in samples:
        n = int((s.labels[1:] != IGNORE_INDEX).sum())
        kwargs = {}
        if s.pixel_values is not None:
            kwargs = dict(pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw,
                          mm_token_type_ids=mm_token_type_ids(s, model.config)[None])
        out = model(input_ids=s.input_ids[None], labels=s.labels[None], use_cache=False, **kwargs)
        (out.loss * n / n_total).backward()
        total += float(out.loss.detach()) * n / n_total
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return total, grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def seed_adapter_weights(model: torch.nn.Module) -> None:
    """Give every LoRA and modules_to_save weight of `model` (vlmcp's injected model or a plain
    PeftModel) a value that depends only on its path from `language_model.` on, so both sides of a
    parity test start from the same non-zero adapters (PEFT's default B = 0 would leave the A
    gradients zero). Small values keep the adapted layers well conditioned."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            key = name[name.index("language_model."):]
            gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            noise = torch.randn(param.shape, generator=gen)
            if "modules_to_save" in name:
                param.add_(0.05 * noise)
            else:
                param.copy_(noise * (0.1 if ".lora_A." in name else 0.05))


def plain_sample_loss(model: torch.nn.Module, sample) -> tuple[torch.Tensor, int]:
    """(mean CE over the targets, target count) of a vlmcp `Sample` forwarded alone through a
    plain transformers (or PEFT-wrapped) model."""
    kwargs = {}
    if sample.pixel_values is not None:
        kwargs = {"pixel_values": sample.pixel_values, "image_grid_thw": sample.image_grid_thw}
    out = model(input_ids=torch.tensor([sample.input_ids]), labels=torch.tensor([sample.labels]),
                mm_token_type_ids=sample.mm_token_type_ids[None], use_cache=False, **kwargs)
    return out.loss, sum(label != IGNORE_INDEX for label in sample.labels[1:])


def random_lm_head(vocab: int, hidden: int, rows: int, bias: bool, ignore_every: int,
                   generator: torch.Generator) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """(an lm_head Linear [vocab, hidden] with N(0, 1) weights (and bias), hidden states
    [rows, hidden], targets [rows] with every `ignore_every`-th one IGNORE_INDEX), all from
    `generator`, fp32."""
    head = torch.nn.Linear(hidden, vocab, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=generator))
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=generator))
    states = torch.randn(rows, hidden, generator=generator)
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[::ignore_every] = IGNORE_INDEX
    return head, states, targets


def make_lively(path: Path) -> Path:
    """Rewrite a tiny checkpoint's DeltaNet gates to decay moderately (A_log in [-1, 1]) and its
    conv taps to be large, so that every gradient is far from zero (with the default init the
    decay saturates and some A_log gradients are pure cancellation noise); returns `path`."""
    weights = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for key, value in weights.items():
        if key.endswith("linear_attn.A_log"):
            weights[key] = torch.rand(value.shape, generator=generator) * 2 - 1
        elif key.endswith("linear_attn.conv1d.weight"):
            weights[key] = torch.randn(value.shape, generator=generator) * 0.3
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path
