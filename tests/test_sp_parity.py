"""SP = P equals plain transformers: for P = 2, 3 and 4, the loss and every gradient after one
DeepSpeed step equal those of a plain transformers model that forwards each sample alone
(fp32, within rel 1e-5 of that reference computed in float64, or within fp32's own error of it
where that is larger: `assert_within_fp32_error`), with the vision work split over the SP group
(frozen and trainable tower) or replicated. Real engine, real gloo processes, real checkpoints on disk.

Video cases (P = 1 with LoRA, 2, 3, 4 and DP 2 x SP 2): plain transformers is fed
pixel_values_videos, video_grid_thw and mm_token_type_ids; the packs mix videos with images and
text-only samples, hold two videos of different sizes in one sample, put video placeholders
across shard edges, and one video larger than the rest of its pack whose temporal groups go to
several ranks.

LoRA cases (P = 1, 2, 3, 4; ZeRO 0-3; both DeltaNet modes; gradient checkpointing): vlmcp's adapters on the DeltaNet,
attention and MLP projections and on the MoE routed experts' fused weights (target_parameters) against PEFT's on plain transformers, the same adapter weights on
both sides; the trainable parameters are then exactly the adapters (and modules_to_save).

Memory features (train.tiled_mlp, train.offload_activations; P = 1, 2, 4; ZeRO 2 and 3; alone and
together; LoRA on the MLP projections; gradient checkpointing) are further cases of the same
launches.

The degree per micro-batch (parallel.sp_dynamic; P = 4, ZeRO-3, trainable split tower): a step of
one pack spread over the four ranks (a video's placeholders across a shard edge) and one whole
pack per rank, each rank's different (a video, an image, text only, an image and a video), equals
plain transformers per sample; the same samples with every micro-batch spread (the feature off)
equal it too, and the two runs' gradients agree with each other to fp32 rounding.

Each world size runs all its cases in one set of processes."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from peft import LoraConfig, get_peft_model

from tests.helpers.distributed import run_ranks
from tests.helpers.parity import (assert_steps_agree_to_fp32_rounding, assert_within_fp32_error, build_model,
                                  float64_reference, make_sample, pack, reference_loss_and_grads, rel_err,
                                  seed_adapter_weights)
from tests.helpers.router_reference import add_grads, reference_router_aux_and_grads
from tests.helpers.sp_cases import FEATURE_OFF, engine_step, layout_degree
from vlmcp.model.loss import DEFAULT_LOSS_CHUNK_MB

pytestmark = pytest.mark.e2e

TOL = 1e-5
LORA_R, LORA_ALPHA = 4, 8.0
#: Every Linear of a dense model's decoder layers: DeltaNet, attention and MLP projections.
DENSE_TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
                 "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: The routed experts' fused weights of a qwen3_5_moe model (lora.target_parameters).
ROUTED_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

# name -> world, sp size, model overrides, zero stage, DeltaNet mode, grad accumulation, pack layout,
# and optionally vision ("split", the default, or "replicated"), train_vision, checkpointing, bf16,
# router_aux (the MoE router load-balancing loss, its coefficient raised so that it matters).
# A pack layout is, per DP rank, per micro-batch, a list of samples (length, image grids) or
# (length, image grids, video grids); a sample's first image placeholder is at offset 4, its
# images follow one another (start, placeholders, end), then its videos: per temporal group two
# timestamp tokens, start, h*w/4 placeholders, end (8 tokens for a 4x4 group).
# Under split vision, images go largest first to the least-loaded rank; the comments say where
# image rows travel (shard length in brackets).
# A case with `per_rank` and `degrees` (one per micro-batch) runs `parallel.sp_dynamic`'s
# degree per micro-batch: its layout lists packs per GLOBAL rank; a micro-batch of degree None is
# one pack spread over the SP group (the same samples in each rank's list, made once), one of
# degree 1 a whole pack on each rank (each rank's own samples, `batch.sp_degree = 1`). The step's
# samples are the spread packs once and every rank's degree-1 pack. With `feature_off`, the same
# engine then also runs that step with every micro-batch spread (the feature off): the degree-1
# micro-batch's packs joined, in rank order, into one pack over the SP group.
CASES = {
    # [24] one 16-row image on placeholders 15..30, encoded by rank 0, straddles the edge
    "p2_image_placeholders_cross_shard_edge_zero0": dict(
        world=2, sp=2, model={}, stage=0, mode="state", accum=1,
        packs=[[[(11, []), (37, [(1, 8, 8)])]]],
    ),
    "p2_text_only_pack_zero2_heads_mode": dict(
        world=2, sp=2, model={"linear_num_key_heads": 2, "linear_num_value_heads": 4}, stage=2, mode="heads", accum=1,
        packs=[[[(13, []), (9, []), (20, [])]]],
    ),
    "p2_replicated_vision_gradient_checkpointing_zero1": dict(
        world=2, sp=2, model={}, stage=1, mode="state", accum=1, checkpointing=True, vision="replicated",
        packs=[[[(19, [(1, 4, 4)]), (26, [])]]],
    ),
    "p2_moe_multi_image_zero1": dict(
        world=2, sp=2, model={"moe": True}, stage=1, mode="state", accum=1,
        packs=[[[(25, [(1, 4, 4), (1, 2, 4)]), (15, [(1, 2, 2)])]]],
    ),
    # [26] the 32-patch image (larger than the other) is rank 0's, its placeholders 25..32 straddle
    # the edge; rank 1 encodes the 16-patch image, whose rows go to rank 0
    "p2_trainable_split_vision_larger_image_straddles_zero2": dict(
        world=2, sp=2, model={}, stage=2, mode="state", accum=1, train_vision=True,
        packs=[[[(21, [(1, 4, 4)]), (30, [(1, 4, 8)])]]],
    ),
    "p2_replicated_trainable_vision_zero3": dict(
        world=2, sp=2, model={}, stage=3, mode="state", accum=1, train_vision=True, vision="replicated",
        packs=[[[(21, [(1, 4, 4)]), (9, [])]]],
    ),
    "p2_bf16_zero2": dict(
        world=2, sp=2, model={}, stage=2, mode="state", accum=1, bf16=True,
        packs=[[[(37, [(1, 8, 8)]), (11, [])]]],
    ),
    # [15] rank 0 encodes the image (placeholders 8..23 over ranks 0 and 1); ranks 1 and 2 run the
    # dummy image so that ZeRO-3 gathers the tower on every rank
    # Loss chunks of one target row: the ranks hold different target counts, and a ZeRO-3 lm_head
    # must still make the same module calls on every rank.
    "p3_sample_spans_three_ranks_trainable_split_vision_zero3_one_row_loss_chunks": dict(
        world=3, sp=3, model={"num_attention_heads": 6, "num_key_value_heads": 3}, stage=3, mode="state", accum=1,
        train_vision=True, loss_chunk_mb=0.001,
        packs=[[[(4, []), (40, [(1, 8, 8)])]]],
    ),
    # [14] 16-patch image (larger than the two others together) on 13..16 -> ranks 0, 1; rank 1's
    # image -> rank 2; rank 2's image -> rank 2
    "p3_split_vision_one_large_image_kv_heads_below_p_heads_mode_zero2": dict(
        world=3, sp=3,
        model={"num_attention_heads": 6, "num_key_value_heads": 1, "linear_num_key_heads": 3, "linear_num_value_heads": 6},
        stage=2, mode="heads", accum=1,
        packs=[[[(9, []), (19, [(1, 4, 4)]), (14, [(1, 2, 2), (1, 2, 2)])]]],
    ),
    # [11] rank 0 encodes the 64-patch image (placeholders 10..25 over ranks 0, 1, 2), rank 1 the
    # 16-patch one (4..7, rank 0); ranks 2 and 3 run the dummy image
    "p4_one_sample_pack_kv_heads_below_p_trainable_split_vision_zero3": dict(
        world=4, sp=4, model={"num_key_value_heads": 2}, stage=3, mode="state", accum=1, train_vision=True,
        packs=[[[(44, [(1, 4, 4), (1, 8, 8)])]]],
    ),
    # [11] 64-patch image on 4..19 (ranks 0, 1) from rank 0; two 4-patch images on 30 (rank 2)
    # and 33 (rank 3) from ranks 1 and 2; rank 3 encodes nothing and skips the frozen tower
    "p4_moe_heads_mode_split_vision_zero2": dict(
        world=4, sp=4, model={"moe": True, "num_key_value_heads": 1, "linear_num_key_heads": 4, "linear_num_value_heads": 4},
        stage=2, mode="heads", accum=1,
        packs=[[[(23, [(1, 8, 8)]), (3, []), (17, [(1, 2, 2), (1, 2, 2)])]]],
    ),
    # four ranks sum the trainable tower's gradients; text-only and one-image micro-batches make
    # ranks run the dummy image
    "p2_dp2_grad_accum2_trainable_split_vision_zero2": dict(
        world=4, sp=2, model={}, stage=2, mode="state", accum=2, train_vision=True,
        packs=[
            [[(17, [(1, 4, 4)]), (6, [])], [(30, [])]],
            [[(9, []), (22, [(1, 2, 2)])], [(12, [(1, 4, 2)]), (5, [])]],
        ],
    ),
    # LoRA: adapters on DeltaNet, attention and MLP projections; images straddle shard edges as in
    # the cases above.
    "sp1_lora_deltanet_attention_mlp_zero2": dict(
        world=1, sp=1, model={}, stage=2, mode="state", accum=1, lora=dict(targets=DENSE_TARGETS),
        packs=[[[(11, []), (37, [(1, 8, 8)])]]],
    ),
    "sp1_lora_all_linear_zero3": dict(
        world=1, sp=1, model={}, stage=3, mode="state", accum=1, lora=dict(targets="all-linear"),
        packs=[[[(21, [(1, 4, 4)]), (30, [(1, 4, 8)])]]],
    ),
    "sp1_lora_zero0": dict(
        world=1, sp=1, model={}, stage=0, mode="state", accum=1, lora=dict(targets=["in_proj_qkv", "q_proj", "up_proj"]),
        packs=[[[(19, [(1, 4, 4)]), (26, [])]]],
    ),
    # the routed experts' fused 3-D weights through lora.target_parameters (one LoRA pair per
    # expert), next to Linear targets and the shared expert's MLP projections
    "sp1_lora_moe_routed_experts_gradient_checkpointing_zero2": dict(
        world=1, sp=1, model={"moe": True}, stage=2, mode="state", accum=1, checkpointing=True,
        lora=dict(targets=["q_proj", "down_proj"], target_parameters=ROUTED_EXPERTS),
        packs=[[[(11, []), (37, [(1, 8, 8)])]]],
    ),
    "p2_lora_replicated_vision_gradient_checkpointing_zero1": dict(
        world=2, sp=2, model={}, stage=1, mode="state", accum=1, vision="replicated", checkpointing=True,
        lora=dict(targets=["in_proj_z", "out_proj", "k_proj", "gate_proj"]),
        packs=[[[(19, [(1, 4, 4)]), (26, [])]]],
    ),
    "p2_lora_image_straddles_edge_modules_to_save_zero2": dict(
        world=2, sp=2, model={}, stage=2, mode="state", accum=1,
        lora=dict(targets=DENSE_TARGETS, modules_to_save=["post_attention_layernorm", "language_model.norm"]),
        packs=[[[(11, []), (37, [(1, 8, 8)])]]],
    ),
    "p2_lora_all_linear_heads_mode_zero3": dict(
        world=2, sp=2, model={}, stage=3, mode="heads", accum=1, lora=dict(targets="all-linear"),
        packs=[[[(21, [(1, 4, 4)]), (30, [(1, 4, 8)])]]],
    ),
    "p2_lora_moe_shared_expert_zero3": dict(
        world=2, sp=2, model={"moe": True}, stage=3, mode="state", accum=1,
        lora=dict(targets=["in_proj_qkv", "out_proj", "q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        packs=[[[(25, [(1, 4, 4), (1, 2, 4)]), (15, [(1, 2, 2)])]]],
    ),
    # [24] placeholders 15..30 straddle the edge; routed experts only (no Linear targets); every
    # ZeRO-3 parameter partitioned (persistence threshold 0: the tiny experts would stay whole),
    # so PEFT adds the adapters to the gathered expert weights
    "p2_lora_moe_routed_experts_image_straddles_partitioned_zero3": dict(
        world=2, sp=2, model={"moe": True}, stage=3, mode="state", accum=1, partition_all=True,
        lora=dict(targets=[], target_parameters=ROUTED_EXPERTS),
        packs=[[[(11, []), (36, [(1, 8, 8)])]]],
    ),
    "p3_lora_sample_spans_three_ranks_zero3": dict(
        world=3, sp=3, model={"num_attention_heads": 6, "num_key_value_heads": 3}, stage=3, mode="state", accum=1,
        lora=dict(targets=DENSE_TARGETS), packs=[[[(4, []), (40, [(1, 8, 8)])]]],
    ),
    "p4_lora_state_mode_zero3": dict(
        world=4, sp=4, model={"num_key_value_heads": 2}, stage=3, mode="state", accum=1,
        lora=dict(targets=DENSE_TARGETS), packs=[[[(44, [(1, 4, 4), (1, 8, 8)])]]],
    ),
    "p4_lora_heads_mode_zero2": dict(
        world=4, sp=4, model={"num_key_value_heads": 1, "linear_num_key_heads": 4, "linear_num_value_heads": 4},
        stage=2, mode="heads", accum=1, lora=dict(targets="all-linear"),
        packs=[[[(23, [(1, 8, 8)]), (3, []), (17, [(1, 2, 2), (1, 2, 2)])]]],
    ),
    # Memory features (train.tiled_mlp: DeepSpeed's TiledMLP; train.offload_activations: DeepSpeed's
    # CheckpointHiddenStatesOffload), alone and together. Hidden size 16, so that a shard of 20+
    # tokens is tiled into at least two pieces (ceil(S_local / hidden)).
    # TiledMLP alone, on LoRA adapters of the MLP projections, ZeRO-3
    "sp1_tiled_mlp_lora_mlp_projections_zero3": dict(
        world=1, sp=1, model={"hidden_size": 16}, stage=3, mode="state", accum=1, tiled_mlp=True,
        lora=dict(targets=["gate_proj", "up_proj", "down_proj", "q_proj"]),
        packs=[[[(19, [(1, 4, 4)]), (26, [])]]],
    ),
    # offload alone, ZeRO-3, an image straddling the shard edge
    "p2_offload_activations_checkpointing_zero3": dict(
        world=2, sp=2, model={"hidden_size": 16}, stage=3, mode="state", accum=1, checkpointing=True,
        offload_activations=True, packs=[[[(11, []), (37, [(1, 8, 8)])]]],
    ),
    # both, with checkpointing (three forwards of each MLP shard), ZeRO-2
    "p2_tiled_mlp_offload_activations_checkpointing_zero2": dict(
        world=2, sp=2, model={"hidden_size": 16}, stage=2, mode="state", accum=1, checkpointing=True,
        tiled_mlp=True, offload_activations=True, packs=[[[(21, [(1, 4, 4)]), (30, [(1, 4, 8)])]]],
    ),
    # both on a MoE model (its whole sparse block tiled), ZeRO-3, the second sample over three ranks
    # (a seed whose fp32 DeltaNet gate gradients are well conditioned, see the router cases below)
    "p4_moe_h16_two_samples_tiled_offload_checkpointing_zero3": dict(
        world=4, sp=4, model={"moe": True, "hidden_size": 16, "num_key_value_heads": 2}, stage=3, mode="state",
        accum=1, checkpointing=True, tiled_mlp=True, offload_activations=True,
        packs=[[[(45, [(1, 4, 4)]), (43, [(1, 8, 8)])]]],
    ),
    # Router aux loss (model.router_loss). A case's data seed is its name's length; these names give
    # samples whose fp32 DeltaNet gate gradients (dt_bias, A_log) are well conditioned (within
    # 3e-6 of the reference at SP = 1; other seeds reach 1e-5 at SP = 1 already, field notes). the router statistics of the shards' real tokens summed
    # over the SP group equal transformers' aux loss of the pack's samples batched with an
    # attention mask. [24] one padding row; placeholders 15..30 straddle the edge.
    "p2_moe_router_aux_loss_image_spans_edge_checkpointing_zero2": dict(
        world=2, sp=2, model={"moe": True, "router_aux_loss_coef": 0.5}, stage=2, mode="state", accum=1,
        router_aux=True, checkpointing=True,
        packs=[[[(11, []), (36, [(1, 8, 8)])]]],
    ),
    # [11] one padding row; the 64-patch image's placeholders 4..19 over ranks 0 and 1, the
    # 4-patch one on 30 (rank 2)
    "p4_moe_router_aux_loss_padded_image_straddles_zero3": dict(
        world=4, sp=4, model={"moe": True, "router_aux_loss_coef": 0.5}, stage=3, mode="state", accum=1,
        router_aux=True,
        packs=[[[(23, [(1, 8, 8)]), (3, []), (17, [(1, 2, 2)])]]],
    ),
    # the step's router term is the mean of the four micro-batches' aux losses
    "p2_dp2_grad_accum2_moe_router_aux_loss_zero2": dict(
        world=4, sp=2, model={"moe": True, "router_aux_loss_coef": 0.5}, stage=2, mode="state", accum=2,
        router_aux=True,
        packs=[
            [[(17, [(1, 4, 4)]), (6, [])], [(27, [])]],
            [[(9, []), (22, [(1, 2, 2)])], [(12, [(1, 4, 2)]), (5, [])]],
        ],
    ),
    # Video. Units are whole images and single temporal groups, balanced by cost
    # p * (p + alpha) (alpha = 2 * 32 + 64 for the tiny tower).
    # A video-only sample and a sample with two videos of different sizes, LoRA on every Linear.
    "sp1_lora_video_only_sample_and_two_videos_of_different_sizes_zero3": dict(
        world=1, sp=1, model={}, stage=3, mode="state", accum=1, lora=dict(targets=DENSE_TARGETS),
        packs=[[[(28, [], [(3, 2, 4)]), (40, [], [(2, 4, 4), (1, 2, 2)])]]],
    ),
    # [37] video, image and text-only samples; the video's first group's placeholders 35..38
    # straddle the edge; four 16-patch units (the image, three groups), two per rank
    "p2_video_image_text_pack_group_straddles_edge_trainable_split_heads_mode_zero3": dict(
        world=2, sp=2, model={}, stage=3, mode="heads", accum=1, train_vision=True,
        packs=[[[(9, []), (20, [(1, 4, 4)]), (45, [], [(3, 4, 4)])]]],
    ),
    # [22] two videos of different sizes and an image in one sample: units of 16, 16, 4, 4, 4
    # and 4 patches over three ranks, frozen tower
    "p3_two_videos_of_different_sizes_and_an_image_frozen_split_zero2": dict(
        world=3, sp=3, model={"num_attention_heads": 6, "num_key_value_heads": 3}, stage=2,
        mode="state", accum=1,
        packs=[[[(4, []), (62, [(1, 2, 2)], [(2, 4, 4), (3, 2, 2)])]]],
    ),
    # [23] a six-group video larger than the rest of its pack: its 16-patch groups go to all four
    # ranks (two each to ranks 0 and 1, rank 2 also takes the 4-patch image), and their rows
    # cross the shard edges
    "p4_one_video_larger_than_the_pack_spread_over_four_ranks_trainable_split_zero3": dict(
        world=4, sp=4, model={"num_key_value_heads": 2}, stage=3, mode="state", accum=1,
        train_vision=True,
        packs=[[[(11, [(1, 2, 2)]), (80, [], [(6, 4, 4)])]]],
    ),
    # parallel.sp_dynamic at SP 4: a degree-4 micro-batch [13] whose video's second temporal
    # group has its placeholders on 23..26, across the edge at 26; then a degree-1 micro-batch,
    # a different whole pack on each rank: rank 0 a two-group video and a text-only sample,
    # rank 1 an image, rank 2 text only (the dummy image), rank 3 an image and a video in one
    # sample. Trainable split tower: each rank encodes its own degree-1 pack's units.
    "p4_sp_dynamic_degree_four_and_degree_one_packs_video_image_text_trainable_split_zero3": dict(
        world=4, sp=4, model={"num_key_value_heads": 2}, stage=3, mode="state", accum=2,
        train_vision=True, per_rank=True, degrees=[None, 1], feature_off=True,
        packs=[[[(9, []), (40, [], [(3, 4, 4)])], whole] for whole in (
            [(12, []), (26, [], [(2, 4, 4)])],
            [(20, [(1, 4, 4)])],
            [(14, []), (9, [])],
            [(22, [(1, 2, 4)], [(2, 2, 2)])],
        )],
    ),
    # parallel.sp_dynamic at SP 2 with the memory features and LoRA on every dense projection:
    # a degree-2 micro-batch [24] whose 16-row image straddles the edge, then a whole pack on
    # each rank (rank 0 an image sample, rank 1 two text-only samples); TiledMLP (hidden 16: two
    # tiles or more of each shard and of each whole pack), activation offload, checkpointing
    "p2_sp_dynamic_degree_one_packs_lora_tiled_mlp_offload_checkpointing_zero2": dict(
        world=2, sp=2, model={"hidden_size": 16}, stage=2, mode="state", accum=2, checkpointing=True,
        tiled_mlp=True, offload_activations=True, lora=dict(targets=DENSE_TARGETS),
        per_rank=True, degrees=[None, 1], feature_off=True,
        packs=[[[(11, []), (37, [(1, 8, 8)])], whole] for whole in (
            [(21, [(1, 4, 4)])],
            [(26, []), (6, [])],
        )],
    ),
    # replicated vision with videos under data parallelism and accumulation, trainable tower
    "p2_dp2_grad_accum2_video_replicated_trainable_zero2": dict(
        world=4, sp=2, model={}, stage=2, mode="state", accum=2, train_vision=True,
        vision="replicated",
        packs=[
            [[(30, [], [(2, 4, 4)]), (6, [])], [(25, [(1, 2, 2)], [(2, 2, 2)])]],
            [[(9, []), (22, [], [(2, 2, 4)])], [(20, [(1, 4, 2)]), (5, [])]],
        ],
    ),
}


def _lora_section(spec: dict) -> dict:
    """The case's vlmcp `lora` section."""
    lora = spec["lora"]
    return dict(r=LORA_R, alpha=LORA_ALPHA, target_modules=lora["targets"],
                modules_to_save=lora.get("modules_to_save", []),
                target_parameters=lora.get("target_parameters", []))


def _peft_model(model, spec: dict):
    """PEFT's LoRA on the plain model (every Linear of the decoder layers for "all-linear"), with
    the adapter weights vlmcp's ranks get."""
    lora = spec["lora"]
    targets = DENSE_TARGETS if lora["targets"] == "all-linear" else lora["targets"]
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=targets or None, modules_to_save=lora.get("modules_to_save"),
        target_parameters=lora.get("target_parameters")))
    seed_adapter_weights(peft_model)
    return peft_model


def _peft_reference(peft_model, samples) -> tuple[float, dict[str, torch.Tensor]]:
    """`reference_loss_and_grads` of a `_peft_model`, gradients under the plain model's names."""
    loss, grads = reference_loss_and_grads(peft_model, samples)
    prefix = "base_model.model."
    return loss, {name.removeprefix(prefix): grad for name, grad in grads.items()}


def _reference(model, spec: dict, micro_batches, exact: bool) -> tuple:
    """(loss, grads, router aux or None) of plain transformers `model` (a `_peft_model` for a LoRA
    case): in fp32, or with `exact` in float64 throughout (`float64_reference`)."""
    flat = [s for micro in micro_batches for s in micro]
    lm_reference = _peft_reference if spec.get("lora") else reference_loss_and_grads

    def run(function, *args):
        return float64_reference(function, model, *args) if exact else function(model, *args)

    loss, grads = run(lm_reference, flat)
    router_aux = None
    if spec.get("router_aux"):
        router_aux, router_grads = run(reference_router_aux_and_grads, micro_batches)
        grads = add_grads(grads, router_grads)
    return loss, grads, router_aux


def _with_videos(sample: tuple) -> tuple:
    """A pack layout's sample as (length, image grids, video grids)."""
    return (*sample, []) if len(sample) == 2 else sample


def _units(grids) -> list[tuple[int, int, int]]:
    """The vision units of grids: a (t, h, w) grid is t units (1, h, w) (images have t = 1)."""
    return [(1, h, w) for t, h, w in grids for _ in range(t)]



def _group_layouts(spec: dict, group: int) -> list[list[tuple]]:
    """The sample layouts of every distinct pack that SP group `group` (a DP rank) runs in the
    step: a per-rank case's spread packs once, then each rank's degree-1 packs."""
    if not spec.get("per_rank"):
        return spec["packs"][group]
    ranks = spec["packs"][group * spec["sp"] : (group + 1) * spec["sp"]]
    spread = [micro for i, micro in enumerate(ranks[0]) if layout_degree(spec, i) is None]
    return spread + [micro for rank in ranks for i, micro in enumerate(rank) if layout_degree(spec, i) == 1]


def _materialise(name: str, tmp_root):
    """(model, checkpoint, packs per rank (a per-rank case's per global rank) per micro-batch, every
    distinct micro-batch's samples, and with `feature_off` the packs of the step with every
    micro-batch spread, else None)."""
    spec = CASES[name]
    overrides = dict(spec["model"])
    model = build_model(**overrides)
    checkpoint = tmp_root / name
    model.save_pretrained(checkpoint)
    gen = torch.Generator().manual_seed(len(name))
    spread = {}
    samples = []
    for rank_packs in spec["packs"]:
        rank_samples = []
        for i, micro in enumerate(rank_packs):
            if spec.get("per_rank") and layout_degree(spec, i) is None and i in spread:
                rank_samples.append(spread[i])
                continue
            made = [make_sample(gen, model.config, length, grids, videos=videos)
                    for length, grids, videos in map(_with_videos, micro)]
            if spec.get("per_rank") and layout_degree(spec, i) is None:
                spread[i] = made
            rank_samples.append(made)
        samples.append(rank_samples)
    packs = [[pack(micro, model) for micro in rank_packs] for rank_packs in samples]
    if not spec.get("per_rank"):
        micro_batches = [micro for rank_packs in samples for micro in rank_packs]
        return model, checkpoint, packs, micro_batches, None
    for rank_packs in packs:
        for i, batch in enumerate(rank_packs):
            batch.sp_degree = layout_degree(spec, i)
    micro_batches = list(spread.values()) + [rank_samples[i] for rank_samples in samples
                                             for i in range(len(rank_samples)) if layout_degree(spec, i) == 1]
    spread_step = None
    if spec.get("feature_off"):
        joined = [spread[i] if layout_degree(spec, i) is None else [s for rank in samples for s in rank[i]]
                  for i in range(len(spec["degrees"]))]
        spread_step = [[pack(micro, model) for micro in joined]] * spec["world"]
    return model, checkpoint, packs, micro_batches, spread_step


@functools.cache
def _results(world: int, sp: int, tmp_root) -> dict:
    cases, references = {}, {}
    for name, spec in CASES.items():
        if (spec["world"], spec["sp"]) != (world, sp):
            continue
        model, checkpoint, packs, micro_batches, spread_step = _materialise(name, tmp_root)
        reference_model = _peft_model(model, spec) if spec.get("lora") else model
        truth = None if spec.get("bf16") else _reference(reference_model, spec, micro_batches, exact=True)
        references[name] = (_reference(reference_model, spec, micro_batches, exact=False), truth)
        cases[name] = dict(checkpoint=str(checkpoint), stage=spec["stage"], mode=spec["mode"], grad_accum=spec["accum"], packs=packs,
                           train_vision=spec.get("train_vision", False), bf16=spec.get("bf16", False),
                           checkpointing=spec.get("checkpointing", False), vision=spec.get("vision", "split"),
                           loss_chunk_mb=spec.get("loss_chunk_mb", DEFAULT_LOSS_CHUNK_MB),
                           lora=_lora_section(spec) if spec.get("lora") else None,
                           router_aux=spec.get("router_aux", False), partition_all=spec.get("partition_all", False),
                           tiled_mlp=spec.get("tiled_mlp", False),
                           offload_activations=spec.get("offload_activations", False),
                           per_rank=spec.get("per_rank", False))
        if spread_step is not None:
            # the step as given (the run None: results under the case's name), then with every
            # micro-batch spread (results under "name/FEATURE_OFF"), on the one engine (lr 0)
            cases[name]["runs"] = {None: (None, packs), FEATURE_OFF: (None, spread_step)}
    per_rank = run_ranks(engine_step, world, sp, cases)
    results = {name: (references[name], [r[name] for r in per_rank]) for name in cases}
    results.update({f"{name}/{FEATURE_OFF}": (references[name], [r[f"{name}/{FEATURE_OFF}"] for r in per_rank])
                    for name in cases if CASES[name].get("feature_off")})
    return results


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("sp_parity")


FP32_CASES = [name for name, spec in CASES.items() if not spec.get("bf16") and not spec.get("per_rank")]
DYNAMIC_CASES = [name for name, spec in CASES.items() if spec.get("per_rank")]


@pytest.mark.parametrize("name", FP32_CASES)
def test_sp_step_equals_plain_transformers_per_sample(name, tmp_root):
    _assert_step_equals_plain_transformers_per_sample(name, name, tmp_root)


@pytest.mark.parametrize("name", DYNAMIC_CASES)
def test_sp_dynamic_step_mixing_spread_and_whole_packs_equals_plain_transformers_per_sample(
        name, tmp_root):
    """parallel.sp_dynamic: a step of one pack spread over the SP group and one whole pack per
    rank gives the loss and every gradient of plain transformers forwarding each sample alone,
    within fp32's error of float64: at SP 4, ZeRO-3, with videos (placeholders across a shard
    edge), images and text only, the trainable tower's gradients too; at SP 2, ZeRO-2, on LoRA
    adapters (against PEFT) with TiledMLP, activation offload and checkpointing."""
    _assert_step_equals_plain_transformers_per_sample(name, name, tmp_root)


@pytest.mark.parametrize("name", [name for name in DYNAMIC_CASES if CASES[name].get("feature_off")])
def test_sp_dynamic_off_every_pack_spread_gives_the_same_step_to_fp32_rounding(name, tmp_root):
    """The same samples with the feature off (every micro-batch spread over the SP group) equal
    the float64 truth as well, and the two runs' loss and gradients agree with each other to fp32
    rounding: within twice `fp32_allowance` (FP32_ERROR_MULTIPLE times plain transformers' own
    fp32 distance from float64, plus FP32_ERROR_FLOOR) of one another, without the 1e-5 floor
    (`assert_agree_to_fp32_rounding`)."""
    spec = CASES[name]
    off = f"{name}/{FEATURE_OFF}"
    _assert_step_equals_plain_transformers_per_sample(name, off, tmp_root)
    results = _results(spec["world"], spec["sp"], tmp_root)
    ((ref_loss, ref_grads, _), (truth_loss, truth_grads, _)), dynamic = results[name]
    _, spread = results[off]
    assert_steps_agree_to_fp32_rounding(dynamic, spread, (ref_loss, ref_grads), (truth_loss, truth_grads))


def _assert_step_equals_plain_transformers_per_sample(name: str, key: str, tmp_root) -> None:
    """Case `name`'s run `key` (its name, or "name/FEATURE_OFF"): on every rank the loss (and the
    router aux loss) and every trainable gradient within fp32's error of the float64 reference
    (at least TOL), the layer-0 MLP run once per micro-batch (twice with checkpointing)."""
    spec = CASES[name]
    ((ref_loss, ref_grads, ref_router_aux), (truth_loss, truth_grads, truth_router_aux)), per_rank = \
        _results(spec["world"], spec["sp"], tmp_root)[key]
    for result in per_rank:
        assert_within_fp32_error(result["loss"], ref_loss, truth_loss, at_least=TOL, name="loss")
        if ref_router_aux is not None:
            assert_within_fp32_error(result["router_aux"], ref_router_aux, truth_router_aux, at_least=TOL,
                                     name="router aux")
        recomputed = 2 if spec.get("checkpointing") else 1
        assert result["layer0_mlp_calls"] == recomputed * spec["accum"]
        trained = {n: g for n, g in result["grads"].items()}
        expected = {n: g for n, g in ref_grads.items() if spec.get("train_vision") or not n.startswith("model.visual")}
        assert trained.keys() == expected.keys()
        if spec.get("lora"):
            assert all(".lora_" in n or ".modules_to_save." in n for n in trained), "a base weight trains"
        for pname, grad in trained.items():
            assert_within_fp32_error(grad, expected[pname], truth_grads[pname], at_least=TOL, name=pname)


MEMORY_CASES = [name for name, spec in CASES.items() if spec.get("tiled_mlp") or spec.get("offload_activations")]


@pytest.mark.parametrize("name", MEMORY_CASES)
def test_memory_features_run_tiled_mlps_and_pass_every_checkpointed_input_through_the_offload_hooks(name, tmp_root):
    """TiledMLP splits the shard into at least two pieces; with offload, every decoder layer's
    checkpointed input (and a vision block's, where the rank runs the tower) reaches DeepSpeed's
    offload engine through its pack hook, under ZeRO-3 too."""
    spec = CASES[name]
    _, per_rank = _results(spec["world"], spec["sp"], tmp_root)[name]
    decoder_layers = 4
    for result in per_rank:
        if spec.get("tiled_mlp"):
            assert result["tiled_shards"] >= 2
        if spec.get("offload_activations"):
            assert result["offloaded"]["passed_hooks"] >= decoder_layers * spec["accum"]


@pytest.mark.parametrize("name", list(CASES))
def test_split_vision_encodes_each_unit_once_per_sp_group_replicated_on_every_rank(name, tmp_root):
    """Split: the ranks of an SP group together encode each image and each video temporal group
    of their packs exactly once. Replicated: every rank encodes every image and video. A
    trainable tower runs once per micro-batch on every rank (the blank dummy image where a rank
    has none); a frozen one at most once."""
    spec = CASES[name]
    _, per_rank = _results(spec["world"], spec["sp"], tmp_root)[name]
    p = spec["sp"]
    copies = p if spec.get("vision") == "replicated" else 1
    for dp_rank in range(spec["world"] // p):
        group = per_rank[dp_rank * p : (dp_rank + 1) * p]
        units = _units(grid for micro in _group_layouts(spec, dp_rank)
                       for _, grids, videos in map(_with_videos, micro) for grid in [*grids, *videos])
        encoded = _units(grid for r in group for grids, blank in r["tower_calls"] if not blank for grid in grids)
        assert sorted(encoded) == sorted(units * copies)
        for result in group:
            calls = len(result["tower_calls"])
            assert calls == spec["accum"] if spec.get("train_vision") else calls <= spec["accum"]


def test_bf16_sp_step_tracks_the_fp32_reference(tmp_root):
    """bf16 weights and activations under SP: the loss within 1e-3 and the gradients within bf16
    precision (mean rel 3e-2, worst 1e-1) of the fp32 plain-transformers reference."""
    ((ref_loss, ref_grads, _), _), per_rank = _results(2, 2, tmp_root)["p2_bf16_zero2"]
    for result in per_rank:
        assert abs(result["loss"] - ref_loss) <= 1e-3 * abs(ref_loss)
        errors = [rel_err(g, ref_grads[n]) for n, g in result["grads"].items()]
        assert sum(errors) / len(errors) <= 3e-2
        assert max(errors) <= 1e-1
