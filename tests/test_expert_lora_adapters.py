"""LoRA on the routed experts under AutoEP (training/ds/expert_lora.py). The adapters vlmcp takes
out of PEFT's wrappers are PEFT's own: each expert's delta equals PEFT's
`ParamWrapper.get_delta_weight`, and the factors go back to PEFT's layout bit for bit. DeepSpeed's own
`GroupedExperts` with vlmcp's adapters attached computes, within fp32's error of the float64
definition, the experts' MLP on
base + scaling * B @ A (PEFT's delta), output and every gradient, on both of its paths (torch's
grouped GEMM and the expert loop), padding rows zero; and it saves for backward no copy of the
experts' weights (the merged weights the earlier forward kept), only activations of the rows."""

from __future__ import annotations

import pytest
import torch
from deepspeed.moe.ep_experts import GroupedExperts, apply_expert_activation
from peft import LoraConfig, get_peft_model
from torch import nn

from tests.helpers.parity import assert_within_fp32_error, build_model, seed_adapter_weights
from vlmcp.bench.saved_bytes import counting_saved_bytes
from vlmcp.training.ds.expert_lora import (ExpertAdapter, attach_expert_adapters,
                                           peft_expert_tensors, take_expert_adapters)

H, I, E, R, SCALING = 16, 32, 2, 4, 2.0
#: Rows per expert, and the padding rows AutoEP appends.
SIZES, PADDING = [5, 3], 2


def _adapted(grouped: bool, dtype: torch.dtype) -> nn.Module:
    """A layer whose `experts` is AutoEP's GroupedExperts with adapters on both weights."""
    gen = torch.Generator().manual_seed(0)
    layer = nn.Module()
    layer.ep_rank, layer.num_local_experts = 0, E
    layer.experts = GroupedExperts(H, I, E, use_grouped_mm=grouped)
    for weight in (layer.experts.w1, layer.experts.w2, layer.experts.w3):
        weight.data = torch.randn(weight.shape, generator=gen) * 0.2
    root = nn.Module()
    root.layer = layer
    factors = {"gate_up_proj": (torch.randn(E, R, H, generator=gen),
                                torch.randn(E, 2 * I, R, generator=gen)),
               "down_proj": (torch.randn(E, R, I, generator=gen),
                             torch.randn(E, H, R, generator=gen))}
    attach_expert_adapters(root, {"layer.experts": [
        (ExpertAdapter(name, SCALING, False, f"peft.{name}", "default", E), a * 0.1, b * 0.1)
        for name, (a, b) in factors.items()]})
    return root.to(dtype)


def _merged_reference(experts: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The definition: every expert's MLP on its merged weights W + s B A, padding rows zero."""
    gate_up = experts.lora_B_gate_up_proj @ experts.lora_A_gate_up_proj * SCALING
    w1 = experts.w1 + gate_up[:, :I]
    w3 = experts.w3 + gate_up[:, I:]
    w2 = experts.w2 + experts.lora_B_down_proj @ experts.lora_A_down_proj * SCALING
    rows = torch.split(x[:sum(SIZES)], SIZES)
    out = [apply_expert_activation(r @ w1[e].T, r @ w3[e].T, "swiglu", fused=False) @ w2[e].T
           for e, r in enumerate(rows)]
    return torch.cat([*out, x.new_zeros(PADDING, H)])


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_gemm", "expert_loop"])
def test_the_lora_experts_compute_the_merged_weights_mlp_and_its_gradients(grouped):
    """fp32 (torch's grouped GEMM has no float64), held to the float64 definition within fp32's
    own error for this computation (the definition evaluated in fp32)."""
    root = _adapted(grouped, torch.float32)
    experts = root.layer.experts
    truth = _adapted(grouped, torch.float64).layer.experts
    x = torch.randn(sum(SIZES) + PADDING, H, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    used = sum(SIZES)
    grad = torch.randn(x.shape[0], H)
    grad[used:] = 0  # AutoEP drops the padding rows' outputs
    out = experts(x, torch.tensor(SIZES))
    ref32, ref64 = _merged_reference(experts, x), _merged_reference(truth, x64)
    assert_within_fp32_error(out[:used], ref32[:used], ref64[:used], at_least=1e-6, name="out")
    got = torch.autograd.grad(out, [x, *experts.parameters()], grad)
    want32 = torch.autograd.grad(ref32, [x, *experts.parameters()], grad)
    want64 = torch.autograd.grad(ref64, [x64, *truth.parameters()], grad.double())
    names = ["x", *(n for n, _ in experts.named_parameters())]
    for name, a, b, c in zip(names, got, want32, want64):
        if name == "x":  # the grouped GEMM leaves the padding rows' gradient unset
            a, b, c = a[:used], b[:used], c[:used]
        assert_within_fp32_error(a, b, c, at_least=1e-6, name=name)
    if not grouped:
        assert torch.equal(out[used:], torch.zeros(PADDING, H))


def test_the_lora_experts_save_no_copy_of_the_expert_weights_for_backward():
    root = _adapted(True, torch.float32)
    experts = root.layer.experts
    weights = sum(w.numel() * w.element_size() for w in (experts.w1, experts.w2, experts.w3))
    x = torch.randn(sum(SIZES) + PADDING, H, requires_grad=True)
    with counting_saved_bytes(root) as saved:
        experts(x, torch.tensor(SIZES))
    # the rows' activations (x, gate, up, hidden and the [T, r] products): a few KB; a merged
    # weight of every expert alone would be `weights` (24 KB here)
    assert saved.total < weights / 2, (saved.total, weights)


def test_the_taken_adapters_give_peft_s_own_deltas_and_go_back_to_its_layout_bit_for_bit():
    model = build_model(moe=True).double()
    peft_model = get_peft_model(model, LoraConfig(
        r=R, lora_alpha=8.0, target_modules=[],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    seed_adapter_weights(peft_model)
    wrappers = {name: module for name, module in peft_model.named_modules()
                if hasattr(module, "parameter_name") and hasattr(module, "lora_A")}
    deltas = {name: w.get_delta_weight("default").detach().clone() for name, w in wrappers.items()}
    factors = {name: (w.lora_A["default"].weight.detach().clone(),
                      w.lora_B["default"].weight.detach().clone()) for name, w in wrappers.items()}
    taken = take_expert_adapters(peft_model)
    assert sum(map(len, taken.values())) == len(wrappers) > 0
    for adapters in taken.values():
        for adapter, lora_a, lora_b in adapters:
            name = adapter.peft_name
            torch.testing.assert_close(adapter.delta(lora_a, lora_b), deltas[name],
                                       rtol=1e-12, atol=1e-14)
            back = peft_expert_tensors(adapter, lora_a, lora_b)
            assert torch.equal(back[f"{name}.lora_A.default.weight"], factors[name][0])
            assert torch.equal(back[f"{name}.lora_B.default.weight"], factors[name][1])
