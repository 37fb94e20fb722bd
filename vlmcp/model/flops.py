"""Model FLOPs of one Qwen3.5 VLM step (dense or MoE), from the model config and the pack's sample
lengths: what MFU divides by the step time and the machine's peak (docs/mfu.md has the formula).

These are *model* FLOPs in the sense of PaLM (Chowdhery et al. 2022, appendix B) and torchtitan:
2 FLOPs per multiply-add of the matrix products the model's math needs, whatever the implementation
runs. Hence:

- A product's backward is 1 x its forward for the input gradient (when something before it trains)
  plus 1 x for the weight gradient (when its weight trains): 2 x for a trained Linear, 1 x for a
  frozen one under LoRA, and for the vision patch embedding of a trained tower (pixels take no
  gradient); a product of two activations (attention, the DeltaNet chunks) 2 x; a frozen vision
  tower none.
- Recomputation is not counted: activation checkpointing, vlmcp's recomputing DeltaNet kernel, the
  fused cross-entropy's logits recomputed in backward, fla's chunk states recomputed in backward,
  the scores that flash attention recomputes. Hardware FLOPs would include them.
- Elementwise work (norms, activations, rotary, softmax, gates, decays, biases) is not counted.

Sample by sample: causal attention covers the L (L + 1) / 2 query-key pairs of each packed sample
(packed samples attend only within themselves), the DeltaNet's chunked recurrence runs
ceil(L / 64) chunks of 64 tokens per sample (a last partial chunk costs a whole one, as the
kernels compute it), the vision tower attends within each image's (each video temporal group's)
h x w patches, and the lm_head runs over the tokens it is computed for (vlmcp: the targets).

The DeltaNet chunk counts follow fla's chunked algorithm (`chunk_gated_delta_rule`), per value head
and chunk of C tokens, key dim K, value dim V: A = beta K K^T (2 C^2 K), the unit lower triangular
inverse T = (I + A)^-1 (C^3 / 3), w = T (beta K decayed) and u = T (beta V) (2 C^2 K + 2 C^2 V):
the "WY" part; then v_new = u - w S (2 C K V), the output q S (2 C K V) + (q K^T * decay) v_new
(2 C^2 K + 2 C^2 V) and the state update K^T v_new (2 C K V). transformers' pure-torch fallback and
vlmcp's own kernel compute the WY part by triangular solves instead (C^2 (K + V)); the rest is the
same products.

Dimension legend: L sample length, T tokens of the pack (sum of L), H hidden size, I intermediate
size, E experts, k experts per token, V_vocab vocabulary, H_q / H_kv attention heads of dim D,
H_k / H_v DeltaNet key / value heads of dims K / V, C = 64 chunk tokens, w conv taps; vision:
H_vis hidden, I_vis intermediate, m spatial merge, depth blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vlmcp.model.delta_rule import CHUNK


@dataclass(frozen=True)
class Trains:
    """What a step computes gradients for.

    backward: False for a forward-only step (`vlmcp score`, evaluation).
    text_weights: the language model's own weights and the lm_head train; False under LoRA (the
        base weights are frozen: their products' backward is the input gradient alone).
    vision: the vision tower trains (`model.freeze_vision: false`); else it runs forward only.
    """

    backward: bool = True
    text_weights: bool = True
    vision: bool = False


@dataclass(frozen=True)
class AdapterFlops:
    """Forward FLOPs of LoRA adapters (`vlmcp.model.lora.adapter_flops`): `per_token` for the
    adapters on Linear layers (2 r (in + out) each, per text token), `per_forward` for those on the
    routed experts' fused weights (their delta weight B A, 2 r in out per expert, once per forward
    whatever the tokens). Both train: their backward is 2 x. `merged`: the routed experts' fused
    weights ("gate_up_proj", "down_proj") that carry such an adapter: their products then take a
    weight gradient (of W + B A, for the adapter's) although the base weight is frozen."""

    per_token: int = 0
    per_forward: int = 0
    merged: frozenset[str] = frozenset()


@dataclass(frozen=True)
class FlopCount:
    """FLOPs by term: `forward[term]` and `backward[term]` (see the module docstring)."""

    forward: dict[str, int] = field(default_factory=dict)
    backward: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Forward + backward FLOPs of every term."""
        return sum(self.forward.values()) + sum(self.backward.values())


class _Counter:
    """Accumulates (forward, backward) FLOPs per term."""

    def __init__(self, backward: bool) -> None:
        self.backward = backward
        self.count = FlopCount()

    def add(self, term: str, forward: int, backward_factor: int) -> None:
        """`forward` FLOPs of `term`, whose backward is `backward_factor` x them (0, 1 or 2)."""
        if not forward:
            return
        self.count.forward[term] = self.count.forward.get(term, 0) + forward
        if self.backward and backward_factor:
            self.count.backward[term] = self.count.backward.get(term, 0) + backward_factor * forward


def step_flops(config: Any, seq_lens: Sequence[int], image_grids: Sequence[Sequence[int]] = (),
               video_grids: Sequence[Sequence[int]] = (), *, lm_head_tokens: int | None = None,
               trains: Trains = Trains(), adapters: AdapterFlops = AdapterFlops()) -> FlopCount:
    """Model FLOPs of one forward (+ backward, per `trains`) of a pack.

    config: the VLM's transformers config (`Qwen3_5Config` or `Qwen3_5MoeConfig`, with
    `text_config` and `vision_config`); seq_lens: the packed samples' lengths; image_grids and
    video_grids: the (t, h, w) patch grid of every image and video the vision tower encodes
    (`image_grid_thw`, `video_grid_thw`: an image shared by a pair's halves is encoded once);
    lm_head_tokens: the tokens the lm_head is computed for (default: every token).

    Terms: attention_proj, attention_core, deltanet_proj, deltanet_conv, deltanet_chunk,
    deltanet_wy, mlp (dense), moe_router, moe_experts, moe_shared, lm_head, vision_patch_embed,
    vision_proj, vision_attention, vision_merger, lora.
    """
    text = config.get_text_config()
    counter = _Counter(trains.backward)
    linear = 1 + int(trains.text_weights)  # the input gradient, plus the weight's
    tokens = sum(seq_lens)
    hidden = text.hidden_size
    kinds = list(text.layer_types)[: text.num_hidden_layers]
    attention_layers = kinds.count("full_attention")
    deltanet_layers = kinds.count("linear_attention")

    q_width = text.num_attention_heads * text.head_dim
    kv_width = text.num_key_value_heads * text.head_dim
    # q_proj carries the output gate (2 x q_width), then k_proj, v_proj and o_proj
    per_token = 2 * hidden * (2 * q_width + 2 * kv_width) + 2 * q_width * hidden
    counter.add("attention_proj", attention_layers * tokens * per_token, linear)
    pairs = sum(length * (length + 1) // 2 for length in seq_lens)
    counter.add("attention_core", attention_layers * 4 * q_width * pairs, 2)

    key_width = text.linear_num_key_heads * text.linear_key_head_dim
    value_heads = text.linear_num_value_heads
    value_width = value_heads * text.linear_value_head_dim
    conv_channels = 2 * key_width + value_width
    # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
    per_token = 2 * hidden * (conv_channels + value_width + 2 * value_heads) + 2 * value_width * hidden
    counter.add("deltanet_proj", deltanet_layers * tokens * per_token, linear)
    counter.add("deltanet_conv", deltanet_layers * tokens * 2 * text.linear_conv_kernel_dim * conv_channels,
                linear)
    chunks = sum(-(-length // CHUNK) for length in seq_lens)
    k, v, c = text.linear_key_head_dim, text.linear_value_head_dim, CHUNK
    # q K^T and beta K K^T, (q K^T * decay) v_new, then w S, q S and K^T v_new
    per_chunk = 4 * c * c * k + 2 * c * c * v + 6 * c * k * v
    counter.add("deltanet_chunk", deltanet_layers * chunks * value_heads * per_chunk, 2)
    wy_per_chunk = c**3 // 3 + 2 * c * c * (k + v)
    counter.add("deltanet_wy", deltanet_layers * chunks * value_heads * wy_per_chunk, 2)

    layers = attention_layers + deltanet_layers
    if getattr(text, "num_experts", 0):
        counter.add("moe_router", layers * tokens * 2 * hidden * text.num_experts, linear)
        routed = layers * tokens * text.num_experts_per_tok * 2 * hidden * text.moe_intermediate_size
        for name, products in (("gate_up_proj", 2), ("down_proj", 1)):
            counter.add("moe_experts", routed * products,
                        1 + int(trains.text_weights or name in adapters.merged))
        # the shared expert's three products and its sigmoid gate (hidden -> 1)
        counter.add("moe_shared", layers * tokens * 2 * hidden
                    * (3 * text.shared_expert_intermediate_size + 1), linear)
    else:
        counter.add("mlp", layers * tokens * 6 * hidden * text.intermediate_size, linear)

    head_tokens = tokens if lm_head_tokens is None else lm_head_tokens
    counter.add("lm_head", lm_head_flops(head_tokens, hidden, text.vocab_size), linear)
    counter.add("lora", adapters.per_token * tokens + adapters.per_forward, 2)
    _vision(counter, config.vision_config, [*image_grids, *video_grids], trains.vision)
    return counter.count


def _vision(counter: _Counter, vision: Any, grids: list[Sequence[int]], trains: bool) -> None:
    """The vision tower on images/videos of patch grids (t, h, w): the patch embedding, `depth`
    blocks (qkv, proj, two MLP products; attention within each of the t h x w frames), the merger
    (two products per m x m patches)."""
    if not grids:
        return
    width, inner, depth = vision.hidden_size, vision.intermediate_size, vision.depth
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    merged = width * vision.spatial_merge_size**2
    patches = sum(int(t) * int(h) * int(w) for t, h, w in grids)
    pairs = sum(int(t) * (int(h) * int(w)) ** 2 for t, h, w in grids)
    blocks = 2 if trains else 0
    counter.add("vision_patch_embed", patches * 2 * patch_dim * width, 1 if trains else 0)
    counter.add("vision_proj", depth * patches * 2 * width * (4 * width + 2 * inner), blocks)
    counter.add("vision_attention", depth * 4 * width * pairs, blocks)
    counter.add("vision_merger", patches // vision.spatial_merge_size**2 * 2 * merged
                * (merged + vision.out_hidden_size), blocks)


def lm_head_flops(tokens: int, hidden: int, vocab: int) -> int:
    """Forward FLOPs of the lm_head on `tokens` rows (its backward: 1 x for the hidden states'
    gradient, 1 x for the weight's when it trains)."""
    return 2 * tokens * hidden * vocab


def batch_flops(config: Any, batch: Any, trains: Trains = Trains(),
                adapters: AdapterFlops = AdapterFlops()) -> FlopCount:
    """`step_flops` of a `PackedBatch` as vlmcp trains it: the lm_head over its targets, its
    images (each distinct image once) and videos."""
    grids = [batch.image_grid_thw, batch.video_grid_thw]
    images, videos = ([] if g is None else g.tolist() for g in grids)
    return step_flops(config, batch.seq_lens, images, videos, lm_head_tokens=batch.num_targets,
                      trains=trains, adapters=adapters)



def gemm_shapes(config: Any) -> list[tuple[int, int]]:
    """The distinct (in, out) weight shapes of the language model's products and the lm_head: the
    GEMMs a step of `config` runs on every token (a CPU peak is measured on them)."""
    text = config.get_text_config()
    hidden = text.hidden_size
    kinds = set(text.layer_types[: text.num_hidden_layers])
    shapes = [(hidden, text.vocab_size)]
    if "full_attention" in kinds:
        q_width = text.num_attention_heads * text.head_dim
        shapes += [(hidden, 2 * q_width), (hidden, text.num_key_value_heads * text.head_dim),
                   (q_width, hidden)]
    if "linear_attention" in kinds:
        key_width = text.linear_num_key_heads * text.linear_key_head_dim
        value_width = text.linear_num_value_heads * text.linear_value_head_dim
        shapes += [(hidden, 2 * key_width + value_width), (hidden, value_width), (value_width, hidden)]
    inners = ([text.moe_intermediate_size, text.shared_expert_intermediate_size]
              if getattr(text, "num_experts", 0) else [text.intermediate_size])
    for inner in inners:
        shapes += [(hidden, inner), (inner, hidden)]
    return sorted(set(shapes))
