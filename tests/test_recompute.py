"""vlmcp's exact recompute of elementwise steps (vlmcp/model/recompute.py): full attention's
`q_norm` and `k_norm` and the routed experts' gate keep only their inputs for backward (counted by
`vlmcp.bench.saved_bytes`, against the same module with transformers' code put back), replaying
the DeltaNet norm in backward never runs `out_proj`'s matmul again, and a packed step with all of
it on matches plain transformers in fp32 against float64, with LoRA on `out_proj`, `q_proj` and
the routed experts."""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.parity import (assert_within_fp32_error, build_model, float64_reference, make_sample,
                                  pack, reference_loss_and_grads, seed_adapter_weights)
from tests.helpers.saved_bytes import saved_bytes_per_layer_kind
from vlmcp.config import LoraSection
from vlmcp.model.lora import apply_lora
from vlmcp.model.packed import PackedVLM
from vlmcp.model.recompute import gated_norm_then_project, uninstall_recompute

TOKENS = 96
TOL = 1e-5
ATTENTION = "language_model.layers.*.self_attn"
EXPERTS = "language_model.layers.*.mlp.experts"


def test_head_norms_and_expert_gates_keep_only_their_inputs():
    recomputed = PackedVLM(build_model(moe=True)).train()
    plain = PackedVLM(build_model(moe=True)).train()
    uninstall_recompute(plain.recomputed)
    after, before = saved_bytes_per_layer_kind(recomputed, TOKENS), saved_bytes_per_layer_kind(plain, TOKENS)
    config = recomputed.hf_model.config.text_config
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    # q_norm: a compact copy of the query half; before, all of q_proj's output (query and gate
    # halves) plus the norm's output.
    assert after[f"{ATTENTION}.q_norm"] == TOKENS * heads * dim * 4
    assert before[f"{ATTENTION}.q_norm"] >= 3 * TOKENS * heads * dim * 4
    assert after[f"{ATTENTION}.k_norm"] == TOKENS * kv_heads * dim * 4 < before[f"{ATTENTION}.k_norm"]
    # The experts' gate keeps its input (as the activation and product did) but no longer the
    # activation's output: one [tokens x top-k, I] fp32 tensor less per layer.
    pairs = TOKENS * config.num_experts_per_tok
    assert f"{EXPERTS}.act_fn" not in after
    gate_after = after[EXPERTS]
    gate_before = before[EXPERTS] + before[f"{EXPERTS}.act_fn"]
    assert gate_after == gate_before - pairs * config.moe_intermediate_size * 4
    assert sum(after.values()) < sum(before.values())


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.matmuls += 1
        return func(*args, **(kwargs or {}))


def test_norm_then_out_proj_replays_the_norm_but_not_the_matmul_and_gives_the_same_gradients():
    layer = next(m for m in build_model().modules() if hasattr(m, "in_proj_qkv"))
    gen = torch.Generator().manual_seed(3)
    shape = (TOKENS, layer.num_v_heads, layer.head_v_dim)
    core, z = (torch.randn(shape, generator=gen, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(TOKENS, layer.hidden_size, generator=gen)

    def backward(project) -> tuple[int, list[torch.Tensor]]:
        out = project(core, z)
        with _CountMatmuls() as counter:
            out.backward(grad_out)
        params = [core, z, layer.norm.weight, layer.out_proj.weight]
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return counter.matmuls, grads

    def transformers_order(hidden, gate):
        normed = layer.norm(hidden.reshape(-1, layer.head_v_dim), gate.reshape(-1, layer.head_v_dim))
        return layer.out_proj(normed.reshape(TOKENS, -1))

    matmuls, grads = backward(lambda h, g: gated_norm_then_project(layer.norm, layer.out_proj, h, g))
    plain_matmuls, plain_grads = backward(transformers_order)
    assert matmuls == plain_matmuls == 2  # out_proj's input and weight gradients, no forward replay
    for got, want in zip(grads, plain_grads):
        assert torch.equal(got, want)


ROUTED_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_packed_step_with_recompute_and_lora_matches_plain_transformers(tmp_path):
    model = build_model(moe=True)
    apply_lora(model, LoraSection(r=4, alpha=8.0, target_modules=["out_proj", "q_proj"],
                                  target_parameters=ROUTED_EXPERTS), tmp_path)
    seed_adapter_weights(model)
    gen = torch.Generator().manual_seed(11)
    samples = [make_sample(gen, model.config, 40), make_sample(gen, model.config, 25, [(1, 4, 4)])]
    ref_loss, ref_grads = reference_loss_and_grads(model, samples)
    truth_loss, truth_grads = float64_reference(reference_loss_and_grads, model, samples)
    trained = copy.deepcopy(model)
    module = PackedVLM(trained).train()
    assert module.recomputed, "nothing was set to recompute"
    batch = pack(samples, model)
    loss_sum, count, _ = module(batch)
    (loss_sum / count).backward()
    assert_within_fp32_error(float(loss_sum.detach()) / count, ref_loss, truth_loss, at_least=TOL, name="loss")
    grads = {n: p.grad for n, p in trained.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys()
    assert any(".out_proj.lora_A." in n for n in grads) and any(".experts." in n for n in grads)
    for name, grad in grads.items():
        assert_within_fp32_error(grad, ref_grads[name], truth_grads[name], at_least=TOL, name=name)
