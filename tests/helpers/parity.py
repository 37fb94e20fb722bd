"""Shared pieces of the parity tests: synthetic packs, the plain-transformers reference, its
float64 twin, and the one rule that holds an fp32 result to float64 (`assert_within_fp32_error`).

The reference never touches vlmcp's model code: a separate, untouched transformers model forwards
every sample alone (batch of one, no packing), and the step loss is sum(CE) / N over all samples.
"""

from __future__ import annotations

import contextlib
import copy
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode
from transformers import Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
from vlmcp.model.tiny import tiny_qwen3_5_config


@dataclass
class RawSample:
    """One sample: input_ids [L], labels [L] (HF convention), its images' pixels and grids, and
    its videos' pixels [groups*h*w, C*T*P*P] and grids [V, 3] (groups, h, w)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None


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


#: Text tokens that stand for a temporal group's timestamp ("<1.5 seconds>") in `make_sample`.
TIMESTAMP_TOKENS = 2


def make_sample(
    gen: torch.Generator, config, length: int, grids: list[tuple[int, int, int]] = (), image_at: int = 3,
    videos: list[tuple[int, int, int]] = (),
) -> RawSample:
    """Random tokens with one `<vision_start> N*<image> <vision_end>` run per image grid, placed
    from `image_at`, then per video grid (groups, h, w) and per group `TIMESTAMP_TOKENS` random
    text tokens and `<vision_start> h*w/merge**2 * <video> <vision_end>` (Qwen3.5's video
    prompt); labels on every later text token (like an answer) and none on vision tokens."""
    merge = config.vision_config.spatial_merge_size
    specials = {config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id}
    vocab = [t for t in range(8, config.text_config.vocab_size)]

    def text(n: int) -> list[int]:
        return [vocab[int(torch.randint(len(vocab), (1,), generator=gen))] for _ in range(n)]

    ids: list[int] = text(image_at)
    for t, h, w in grids:
        ids += [config.vision_start_token_id] + [config.image_token_id] * (t * h * w // merge**2) + [config.vision_end_token_id]
    for groups, h, w in videos:
        for _ in range(groups):
            ids += text(TIMESTAMP_TOKENS) + [config.vision_start_token_id]
            ids += [config.video_token_id] * (h * w // merge**2) + [config.vision_end_token_id]
    while len(ids) < length:
        ids += text(1)
    if len(ids) != length:
        raise ValueError(f"sample of {len(ids)} tokens does not fit length {length}")
    input_ids = torch.tensor(ids)
    labels = input_ids.clone()
    labels[: length // 3] = IGNORE_INDEX
    labels[torch.tensor([i in specials for i in ids])] = IGNORE_INDEX
    patch_dim = 3 * config.vision_config.temporal_patch_size * config.vision_config.patch_size**2
    pixel_values = grid = video_pixels = video_grid = None
    if grids:
        pixel_values = torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=gen)
        grid = torch.tensor(grids)
    if videos:
        video_pixels = torch.randn(sum(t * h * w for t, h, w in videos), patch_dim, generator=gen)
        video_grid = torch.tensor(videos)
    return RawSample(input_ids, labels, pixel_values, grid, video_pixels, video_grid)


def mm_token_type_ids(sample: RawSample, config) -> torch.Tensor:
    """1 on image placeholders, 2 on video placeholders, else 0 (transformers' convention)."""
    return ((sample.input_ids == config.image_token_id).int()
            + 2 * (sample.input_ids == config.video_token_id).int())


def vision_kwargs(sample: RawSample, config) -> dict:
    """What plain transformers is fed for a sample's images and videos (nothing without)."""
    kwargs = {}
    if sample.pixel_values is not None:
        kwargs.update(pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw)
    if sample.pixel_values_videos is not None:
        kwargs.update(pixel_values_videos=sample.pixel_values_videos,
                      video_grid_thw=sample.video_grid_thw)
    if kwargs:
        kwargs["mm_token_type_ids"] = mm_token_type_ids(sample, config)[None]
    return kwargs


def pack(samples: list[RawSample], model) -> PackedBatch:
    """PackedBatch of `samples`, positions from the model's own rope index for each sample alone."""
    config = model.config
    positions, targets = [], []
    for s in samples:
        pos, _ = model.model.get_rope_index(
            s.input_ids[None], mm_token_type_ids(s, config)[None], image_grid_thw=s.image_grid_thw,
            video_grid_thw=s.video_grid_thw,
        )
        positions.append(pos[:, 0])
        shifted = torch.full_like(s.labels, IGNORE_INDEX)
        shifted[:-1] = s.labels[1:]
        targets.append(shifted)
    pixels = [s.pixel_values for s in samples if s.pixel_values is not None]
    grids = [s.image_grid_thw for s in samples if s.image_grid_thw is not None]
    video_pixels = [s.pixel_values_videos for s in samples if s.pixel_values_videos is not None]
    video_grids = [s.video_grid_thw for s in samples if s.video_grid_thw is not None]
    return PackedBatch(
        input_ids=torch.cat([s.input_ids for s in samples]),
        targets=torch.cat(targets),
        position_ids=torch.cat(positions, dim=1),
        mm_token_type_ids=torch.cat([mm_token_type_ids(s, config) for s in samples]),
        seq_lens=[len(s.input_ids) for s in samples],
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        sample_ids=[f"sample{i}" for i in range(len(samples))],
        pixel_values_videos=torch.cat(video_pixels) if video_pixels else None,
        video_grid_thw=torch.cat(video_grids) if video_grids else None,
    )


def reference_loss_and_grads(model, samples: list[RawSample]) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain transformers, each sample forwarded alone: loss = sum CE / N and its gradients."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    n_total = sum(int((s.labels[1:] != IGNORE_INDEX).sum()) for s in samples)
    total = 0.0
    for s in samples:
        n = int((s.labels[1:] != IGNORE_INDEX).sum())
        out = model(input_ids=s.input_ids[None], labels=s.labels[None], use_cache=False,
                    **vision_kwargs(s, model.config))
        (out.loss * n / n_total).backward()
        total += float(out.loss.detach()) * n / n_total
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return total, grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


#: fp32's machine epsilon (2^-23).
FP32_EPS = torch.finfo(torch.float32).eps
#: How many times the plain fp32 reference's own distance from float64 an fp32 result may be away.
FP32_ERROR_MULTIPLE = 4.0
#: Added to every allowance, for a quantity whose plain fp32 reference happens to round almost
#: exactly (a scalar sum, a short conv): 8 eps, about 1e-6.
FP32_ERROR_FLOOR = 8 * FP32_EPS


def fp32_allowance(ref32: Any, ref64: Any, at_least: float = 0.0,
                   multiple: float = FP32_ERROR_MULTIPLE) -> float:
    """The relative distance from `ref64` that `assert_within_fp32_error` allows an fp32 result:
    max(at_least, multiple * rel_err(ref32, ref64) + FP32_ERROR_FLOOR)."""
    ref32, ref64 = (torch.as_tensor(x, dtype=torch.float64) for x in (ref32, ref64))
    return max(at_least, multiple * rel_err(ref32, ref64) + FP32_ERROR_FLOOR)


def assert_within_fp32_error(got: Any, ref32: Any, ref64: Any, *, at_least: float = 0.0,
                             multiple: float = FP32_ERROR_MULTIPLE, name: str = "") -> None:
    """The suite's rule for an fp32 result (tensor or number) that no exact path produces.

    Two fp32 computations that sum in different orders differ by rounding, and how much depends
    on the CPU's BLAS kernels and the thread count, so neither is held to the other. `ref64` is
    the quantity computed in float64 (the truth), and `ref32` a plain fp32 computation of the same
    quantity (plain transformers, or the definition evaluated in fp32), on this machine: its
    distance from `ref64` is fp32's own error for this quantity here. `got` must lie within
    FP32_ERROR_MULTIPLE times that distance of `ref64`, plus FP32_ERROR_FLOOR (relative, norm-wise;
    `fp32_allowance`); `multiple` raises the factor only where a measured kernel difference needs
    it. `at_least` keeps a test's stated tolerance where it is looser (the parity tests' 1e-5
    against plain transformers). A real error (a dropped row, a wrong scale, a leaked state) stays
    orders of magnitude above any of these allowances.
    """
    got, ref32, ref64 = (torch.as_tensor(x, dtype=torch.float64) for x in (got, ref32, ref64))
    error, allowed = rel_err(got, ref64), fp32_allowance(ref32, ref64, at_least, multiple)
    assert error <= allowed, (f"{name}: {error:.3e} from float64 > allowance {allowed:.3e} "
                              f"(the fp32 reference is {rel_err(ref32, ref64):.3e} from float64)")


def assert_agree_to_fp32_rounding(a: Any, b: Any, ref32: Any, ref64: Any, *,
                                  multiple: float = FP32_ERROR_MULTIPLE, name: str = "") -> None:
    """Two fp32 results `a` and `b` of one quantity that should be equal in exact arithmetic
    (e.g. one step with a feature on and off: different shardings, different summation orders)
    agree to fp32 rounding: |a - b| <= 2 * fp32_allowance(ref32, ref64) * |ref64|, the sum of
    what `assert_within_fp32_error` allows each of them from the float64 truth `ref64` when the
    test's own tolerance (`at_least`) is left out, so the bound is fp32's measured error for this
    quantity here (`ref32`: plain fp32 of it) and never a looser stated floor. Use it next to
    `assert_within_fp32_error` on each side, never instead of it."""
    a, b, ref32, ref64 = (torch.as_tensor(x, dtype=torch.float64) for x in (a, b, ref32, ref64))
    distance = float((a - b).norm() / ref64.norm().clamp_min(1e-30))
    allowed = 2 * fp32_allowance(ref32, ref64, multiple=multiple)
    assert distance <= allowed, (f"{name}: the two results are {distance:.3e} apart (relative to "
                                 f"float64) > allowance {allowed:.3e} (the fp32 reference is "
                                 f"{rel_err(ref32, ref64):.3e} from float64)")


def assert_steps_agree_to_fp32_rounding(on: list[dict], off: list[dict], ref32: tuple, ref64: tuple
                                        ) -> None:
    """Per rank, two runs of one step (`on`, `off`: each rank's {"loss", "grads": {name: tensor}})
    agree to fp32 rounding (`assert_agree_to_fp32_rounding`) in the loss and in every gradient;
    `ref32` and `ref64` are (loss, grads by name) of plain transformers in fp32 and float64."""
    (ref_loss, ref_grads), (truth_loss, truth_grads) = ref32, ref64
    for a, b in zip(on, off, strict=True):
        assert_agree_to_fp32_rounding(a["loss"], b["loss"], ref_loss, truth_loss, name="loss")
        assert a["grads"].keys() == b["grads"].keys()
        for name, grad in a["grads"].items():
            assert_agree_to_fp32_rounding(grad, b["grads"][name], ref_grads[name], truth_grads[name],
                                          name=name)


#: bf16's machine epsilon (2^-7).
BF16_EPS = torch.finfo(torch.bfloat16).eps
#: How many times plain transformers' own bf16 distance from float64 an engine's bf16 result may be.
BF16_ERROR_MULTIPLE = 4.0
#: Added to every bf16 allowance: an eighth of bf16's epsilon (2^-10, about 1e-3), the size of
#: the rounding of one bf16 value below 1/8; measured bf16 references sit at 5e-4 (docs/test-bounds.md).
BF16_ERROR_FLOOR = BF16_EPS / 8


def bf16_allowance(ref_bf16: Any, ref64: Any) -> float:
    """The relative distance from `ref64` that `assert_within_bf16_error` allows:
    BF16_ERROR_MULTIPLE * rel_err(ref_bf16, ref64) + BF16_ERROR_FLOOR."""
    ref_bf16, ref64 = (torch.as_tensor(x, dtype=torch.float64) for x in (ref_bf16, ref64))
    return BF16_ERROR_MULTIPLE * rel_err(ref_bf16, ref64) + BF16_ERROR_FLOOR


def assert_within_bf16_error(got: Any, ref_bf16: Any, ref64: Any, *, name: str = "") -> None:
    """The fp32 rule of `assert_within_fp32_error`, for a result computed in bf16 by another
    program (an inference engine): `ref_bf16` is plain transformers in bf16 on the same weights
    and inputs, on this machine, so its distance from the float64 truth `ref64` is bf16's own
    error for this quantity; `got` must lie within BF16_ERROR_MULTIPLE times that, plus
    BF16_ERROR_FLOOR (relative, norm-wise)."""
    got, ref_bf16, ref64 = (torch.as_tensor(x, dtype=torch.float64) for x in (got, ref_bf16, ref64))
    error, allowed = rel_err(got, ref64), bf16_allowance(ref_bf16, ref64)
    assert error <= allowed, (f"{name}: {error:.3e} from float64 > allowance {allowed:.3e} "
                              f"(transformers in bf16 is {rel_err(ref_bf16, ref64):.3e} from float64)")


#: fp32 casts that `Float64Mode` turns into float64 ones.
_NARROWING_CASTS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}


def _mutates_first_argument(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or name.startswith("__i")


def _widen(value: Any) -> Any:
    """`value` with every fp32 tensor and `torch.float32` in it (also inside lists, tuples and
    dicts) made float64."""
    if value is torch.float32:
        return torch.float64
    if isinstance(value, torch.Tensor):
        return value.double() if value.dtype == torch.float32 else value
    if type(value) in (list, tuple):
        return type(value)(_widen(v) for v in value)
    if type(value) is dict:
        return {k: _widen(v) for k, v in value.items()}
    return value


class Float64Mode(TorchFunctionMode):
    """Every torch call in float64: fp32 tensor arguments and `dtype=torch.float32` requests become
    float64, `.float()` keeps float64; an fp32 result raises. Transformers computes its norms,
    gates, rotary tables, router softmax and DeltaNet kernel in fp32 even for a float64 model
    (measured: a plain `.double()` Qwen3.5 is up to 2.9e-6 away from float64 on gate gradients,
    more than fp32 itself); under this mode none of those casts happen. A tensor a call writes into
    (in-place methods, `out=`) is never replaced."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NARROWING_CASTS:
            return args[0].double()
        keep = 1 if _mutates_first_argument(func) else 0
        args = tuple(args[:keep]) + _widen(tuple(args[keep:]))
        out = func(*args, **{k: v if k == "out" else _widen(v) for k, v in kwargs.items()})
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                raise AssertionError(f"{func} returned float32 under Float64Mode")
        return out


@contextlib.contextmanager
def float64_everywhere() -> Iterator[None]:
    """`Float64Mode`, with float64 as the default dtype (tensors made without a dtype)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Float64Mode():
            yield
    finally:
        torch.set_default_dtype(previous)


T = TypeVar("T")


def float64_reference(reference: Callable[..., T], model: torch.nn.Module, *args: Any) -> T:
    """`reference(model, *args)` on a float64 copy of `model`, computed wholly in float64
    (`float64_everywhere`): the truth an fp32 result and its fp32 reference are both held to. fp32
    inputs among `args` are used at their exact values; the copy starts without gradients. A MoE
    model's experts run as transformers' eager loop (its grouped matmul has no float64 kernel): the
    same sums, in float64."""
    twin = copy.deepcopy(model).double()
    twin.zero_grad(set_to_none=True)
    config = getattr(twin, "config", None)
    if getattr(config, "_experts_implementation", None) not in (None, "eager"):
        twin.set_experts_implementation("eager")
    with float64_everywhere():
        return reference(twin, *args)


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
    if sample.pixel_values_videos is not None:
        kwargs.update(pixel_values_videos=sample.pixel_values_videos,
                      video_grid_thw=sample.video_grid_thw)
    out = model(input_ids=torch.tensor([sample.input_ids]), labels=torch.tensor([sample.labels]),
                mm_token_type_ids=sample.mm_token_type_ids[None], use_cache=False, **kwargs)
    return out.loss, sum(label != IGNORE_INDEX for label in sample.labels[1:])


#: `assert_within_fp32_error`'s multiple for the hidden-state gradient of an lm_head chunk of
#: fewer than 4 rows: BLAS computes [rows, vocab] @ [vocab, hidden] with its matrix-vector kernel
#: there, which rounds each 50,000-term sum differently (measured: 8.9e-6 from float64 where fp32
#: cross-entropy on the whole shard is 2.6e-6 away and 4-row chunks 9.3e-7).
MATRIX_VECTOR_MULTIPLE = 8.0


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
