"""The model-FLOPs formula (`vlmcp.model.flops`) against torch's FlopCounterMode on the tiny
Qwen3.5, dense and MoE, with images and a video, samples of several lengths, each forwarded alone
through plain transformers (as packed samples attend only within themselves), forward and backward
counted apart, op by op (mm, bmm, convolution, convolution_backward), to the FLOP.

What FlopCounterMode counts differently, and the test adds exactly:
- sdpa (the math backend: the counter sees nothing of the CPU's fused kernel) multiplies the
  whole L x L score matrix; the formula counts the L (L + 1) / 2 causal pairs.
- transformers' pure-torch DeltaNet solves the WY system with `solve_triangular`, which the counter
  does not see in forward; it sees that solve's backward products (2 C^2 (K + V) per chunk and
  value head), where the formula has fla's inverse and its two products (`deltanet_wy`).
- The chunk loop starts from a zero state that takes no gradient (the first chunk's two state reads
  have a backward of 1 x) and drops its final state (the last chunk's state update has none).
- PEFT folds a routed-experts adapter into the weight with one baddbmm per read of the weight: here
  two reads per layer and forward, one of which feeds the products (only its backward, two bmm,
  runs), and each sample is a forward of its own; the formula counts one fold per forward.
- HF's conv1d pads by w - 1 on both sides and keeps the first L outputs: the counter counts
  L + w - 1 outputs; and its convolution_backward formula ignores `groups`, so the depthwise
  conv's weight gradient is counted channels x over.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

from vlmcp.config.schema import LoraSection
from vlmcp.model.delta_rule import CHUNK
from vlmcp.model.flops import AdapterFlops, FlopCount, Trains, step_flops
from vlmcp.model.lora import adapter_flops, apply_lora
from vlmcp.model.tiny import tiny_qwen3_5_config

#: The products of a weight with activations (FlopCounterMode's aten.mm).
LINEAR_TERMS = ("attention_proj", "deltanet_proj", "mlp", "moe_router", "moe_experts", "moe_shared",
                "lm_head", "vision_proj", "vision_merger")
#: (length, image grids, video grids) of each sample: images of two sizes, a two-group video, a
#: text-only sample shorter than a chunk and one of exactly one chunk.
SAMPLES = [(150, [(1, 8, 8)], []), (37, [], []), (64, [], []), (230, [(1, 16, 16), (1, 8, 12)], []),
           (120, [], [(2, 8, 8)])]


#: FlopCounterMode's ops by the names the test groups them under (a Linear with a bias is addmm).
_OPS = {"aten.mm": "mm", "aten.addmm": "mm", "aten.bmm": "bmm", "aten.baddbmm": "baddbmm",
        "aten.convolution": "convolution", "aten.convolution_backward": "convolution_backward"}


def _sample_inputs(config, length: int, images: list, videos: list) -> dict:
    """One sample's transformers inputs: a few text tokens, then each image's and video temporal
    group's framed placeholders, then random text up to `length`."""
    vision = config.vision_config
    merge = vision.spatial_merge_size**2
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(8, config.text_config.vocab_size, (length,), generator=generator)
    kinds = torch.zeros(length, dtype=torch.long)
    at = 3
    for grid, pad, kind in [*[(g, config.image_token_id, 1) for g in images],
                            *[((1, h, w), config.video_token_id, 2) for t, h, w in videos for _ in range(t)]]:
        n = grid[0] * grid[1] * grid[2] // merge
        ids[at], ids[at + n + 1] = config.vision_start_token_id, config.vision_end_token_id
        ids[at + 1: at + 1 + n], kinds[at + 1: at + 1 + n] = pad, kind
        at += n + 4
    inputs = {"input_ids": ids[None], "mm_token_type_ids": kinds[None]}
    for grids, key in ((images, "pixel_values"), (videos, "pixel_values_videos")):
        if grids:
            patches = sum(t * h * w for t, h, w in grids)
            inputs[key] = torch.randn(patches, patch_dim, generator=generator)
            inputs["image_grid_thw" if key == "pixel_values" else "video_grid_thw"] = torch.tensor(grids)
    return inputs


def _counted(model, samples, config) -> tuple[dict[str, int], dict[str, int]]:
    """FlopCounterMode's counts per aten op, (forward, backward), summed over the samples."""
    forward: dict[str, int] = {}
    backward: dict[str, int] = {}
    for length, images, videos in samples:
        inputs = _sample_inputs(config, length, images, videos)
        with sdpa_kernel(SDPBackend.MATH):
            for counts, run in ((forward, lambda: model(**inputs, use_cache=False)),
                                (backward, lambda: out.logits.sum().backward())):
                counter = FlopCounterMode(display=False)
                with counter:
                    result = run()
                out = result if result is not None else out
                for op, flops in counter.get_flop_counts()["Global"].items():
                    name = _OPS.get(str(op), str(op))
                    counts[name] = counts.get(name, 0) + flops
    return forward, backward


def _as_counted(count: FlopCount, config, samples, trains: Trains,
                adapters: AdapterFlops) -> tuple[dict[str, int], dict[str, int]]:
    """The formula's terms regrouped into FlopCounterMode's ops, with the differences of the module
    docstring added (the expert-adapter folds' forward apart)."""
    text = config.text_config
    kinds = text.layer_types[: text.num_hidden_layers]
    attention_layers, deltanet_layers = kinds.count("full_attention"), kinds.count("linear_attention")
    lengths = [length for length, _, _ in samples]
    square = attention_layers * 4 * text.num_attention_heads * text.head_dim * sum(n * n for n in lengths)
    k, v, heads = text.linear_key_head_dim, text.linear_value_head_dim, text.linear_num_value_heads
    chunks = sum(-(-n // CHUNK) for n in lengths)
    solve_backward = deltanet_layers * heads * chunks * 2 * CHUNK**2 * (k + v)
    state_edges = deltanet_layers * heads * len(lengths) * 4 * 2 * CHUNK * k * v
    channels = 2 * text.linear_num_key_heads * k + heads * v
    taps = text.linear_conv_kernel_dim
    padded_conv = deltanet_layers * sum(n + taps - 1 for n in lengths) * 2 * taps * channels
    fwd, bwd = count.forward, count.backward
    per_token = adapters.per_token * sum(lengths)
    assert fwd.get("lora", 0) == per_token + adapters.per_forward
    forward = {"mm": sum(fwd.get(t, 0) for t in LINEAR_TERMS) + per_token,
               "bmm": square + fwd["deltanet_chunk"] + fwd.get("vision_attention", 0),
               "convolution": padded_conv + fwd.get("vision_patch_embed", 0)}
    backward = {"mm": sum(bwd.get(t, 0) for t in LINEAR_TERMS) + 2 * per_token,
                "bmm": 2 * square + bwd["deltanet_chunk"] - state_edges + solve_backward
                + bwd.get("vision_attention", 0) + 2 * len(samples) * adapters.per_forward,
                "convolution_backward": padded_conv * (1 + (channels if trains.text_weights else 0))
                + bwd.get("vision_patch_embed", 0)}
    return forward, backward


#: LoRA on attention, DeltaNet and shared-expert Linear layers and on the routed experts' gate_up.
LORA = LoraSection(r=4, target_modules=["q_proj", "in_proj_qkv", "down_proj"],
                   target_parameters=["mlp.experts.gate_up_proj"])


@pytest.mark.parametrize("moe,trains", [(False, Trains(vision=True)),
                                        (False, Trains(vision=False)),
                                        (True, Trains(text_weights=False, vision=False))],
                         ids=["dense-all-trained", "dense-frozen-vision", "moe-lora"])
def test_formula_equals_flop_counter_op_by_op_on_the_tiny_model_with_images_and_a_video(
        moe, trains, tmp_path):
    config = tiny_qwen3_5_config(moe=moe)
    model_class = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    torch.manual_seed(0)
    model = model_class(config)
    if moe:  # per-expert F.linear, which the counter sees (it has no formula for grouped_mm)
        model.set_experts_implementation("eager")
    model.model.visual.requires_grad_(trains.vision)
    adapters = AdapterFlops()
    if not trains.text_weights:
        apply_lora(model, LORA, tmp_path)
        adapters = adapter_flops(model)
        # the formula counts every layer's input gradient, also the first layer's (which a frozen
        # embedding would spare)
        model.model.language_model.embed_tokens.requires_grad_(True)
    forward, backward = _counted(model, SAMPLES, config)
    folds = forward.pop("baddbmm", 0) // max(adapters.per_forward, 1)
    assert folds % len(SAMPLES) == 0 and (folds > 0) == bool(adapters.per_forward)
    lengths = [length for length, _, _ in SAMPLES]
    count = step_flops(config, lengths, [g for _, images, _ in SAMPLES for g in images],
                       [g for _, _, videos in SAMPLES for g in videos], lm_head_tokens=sum(lengths),
                       trains=trains, adapters=adapters)
    assert (forward, backward) == _as_counted(count, config, SAMPLES, trains, adapters)
    assert count.forward["deltanet_wy"] and count.forward["attention_core"] and count.forward["lm_head"]
    forward_only = step_flops(config, lengths, [g for _, images, _ in SAMPLES for g in images],
                              [g for _, _, videos in SAMPLES for g in videos],
                              lm_head_tokens=sum(lengths), trains=Trains(backward=False),
                              adapters=adapters)
    assert forward_only.backward == {} and forward_only.total == sum(count.forward.values())
    if moe:
        assert count.forward["moe_experts"] and "mlp" not in count.forward
        assert adapters.merged == {"gate_up_proj"} and adapters.per_token and adapters.per_forward
