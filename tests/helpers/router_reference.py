"""Plain-transformers reference of the MoE router load-balancing loss (no vlmcp model code).

Each micro-batch's samples are forwarded together, right-padded with an attention mask and
`output_router_logits=True`; the model's own `aux_loss` (transformers' `load_balancing_loss_func`
over the real tokens) is the micro-batch's aux loss. The step's router term is
router_aux_loss_coef x the mean of those over the micro-batches, as a plain transformers run over
the same micro-batches would average it.
"""

from __future__ import annotations

import copy

import torch

from tests.helpers.parity import RawSample, mm_token_type_ids


def batched_padded_inputs(samples: list[RawSample], config) -> dict[str, torch.Tensor]:
    """One right-padded batch of `samples`: input_ids, attention_mask, mm_token_type_ids [B, L],
    and the images of all samples in order."""
    length = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), length), config.text_config.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    mm = torch.zeros_like(ids)
    for row, s in enumerate(samples):
        n = len(s.input_ids)
        ids[row, :n], mask[row, :n], mm[row, :n] = s.input_ids, 1, mm_token_type_ids(s, config)
    inputs = dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=mm)
    pixels = [s.pixel_values for s in samples if s.pixel_values is not None]
    if pixels:
        inputs["pixel_values"] = torch.cat(pixels)
        inputs["image_grid_thw"] = torch.cat([s.image_grid_thw for s in samples if s.image_grid_thw is not None])
    return inputs


def reference_router_aux_and_grads(model, micro_batches: list[list[RawSample]]) -> tuple[float, dict[str, torch.Tensor]]:
    """(mean aux loss over `micro_batches`, gradients of router_aux_loss_coef x that mean)."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    coef = model.config.text_config.router_aux_loss_coef
    total = 0.0
    for samples in micro_batches:
        out = model(**batched_padded_inputs(samples, model.config), use_cache=False, output_router_logits=True)
        (coef * out.aux_loss / len(micro_batches)).backward()
        total += float(out.aux_loss.detach()) / len(micro_batches)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return total, grads


def add_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The sum of two gradient dicts (a name missing from one counts as zero there)."""
    return {name: a[name] + b[name] if name in a and name in b else a.get(name, b.get(name)) for name in a.keys() | b.keys()}
