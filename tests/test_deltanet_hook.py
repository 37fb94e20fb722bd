"""The DeltaNet CP hook on its own: a sharded Gated DeltaNet layer equals the unsharded layer run
on every sample alone, forward and backward, with sample boundaries placed exactly at, just
before and just after shard edges. Real processes over gloo; fp32, within rel 1e-5 of the
unsharded layer in float64 (or within fp32's own error of it where that is larger,
`assert_within_fp32_error`, the unsharded layer in fp32 being the fp32 reference).

All cases of one world size run in one set of processes (spawning is the slow part)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.helpers.deltanet_cases import sharded_layer_grads
from tests.helpers.distributed import run_ranks
from tests.helpers.parity import assert_within_fp32_error, build_model, float64_reference

pytestmark = pytest.mark.e2e

TOL = 1e-5
LOCAL = 8  # tokens per rank in these packs; the conv halo is 3 tokens

# name -> (world size, seq_lens, DeltaNet mode)
CASES = {
    # P=2, 8 tokens per rank: the only boundary sits at, before, after the shard edge
    "state_boundary_at_edge": (2, [LOCAL, LOCAL], "state"),
    "state_boundary_one_before_edge": (2, [LOCAL - 1, LOCAL + 1], "state"),
    "state_boundary_one_after_edge": (2, [LOCAL + 1, LOCAL - 1], "state"),
    "state_sample_shorter_than_halo_before_edge": (2, [LOCAL - 2, 2, LOCAL], "state"),
    "state_sample_shorter_than_halo_across_edge": (2, [LOCAL - 1, 2, LOCAL - 1], "state"),
    "state_one_sample_two_ranks": (2, [2 * LOCAL], "state"),
    "heads_two_ranks": (2, [LOCAL - 1, 2, LOCAL - 1], "heads"),
    # P=3: a sample spanning all three ranks (padding at the end)
    "state_sample_spans_three_ranks": (3, [3 * LOCAL - 2], "state"),
    "state_spans_three_ranks_after_short_sample": (3, [2, 3 * LOCAL - 3], "state"),
    # P=4: one sample starts just after an edge and runs across two more
    "state_mixed_four_ranks": (4, [LOCAL - 1, 1, 2 * LOCAL + 1, LOCAL - 1], "state"),
    # P=4: one sample over all ranks (ranks 1 and 2 relay the state), and a pack where a sample
    # runs through rank 1 into rank 2 after rank 0's shard ends inside another sample
    "state_one_sample_four_ranks": (4, [4 * LOCAL], "state"),
    "state_relay_after_split_sample": (4, [LOCAL + 3, 2 * LOCAL - 1, LOCAL - 2], "state"),
    "heads_mixed_four_ranks": (4, [LOCAL - 1, 1, 2 * LOCAL + 1, LOCAL - 1], "heads"),
}


def _layer(mode: str):
    heads = {"linear_num_key_heads": 4, "linear_num_value_heads": 4} if mode == "heads" else {}
    return copy.deepcopy(build_model(**heads).model.language_model.layers[0].linear_attn)


def _inputs(name: str):
    world, seq_lens, mode = CASES[name]
    layer = _layer(mode)
    gen = torch.Generator().manual_seed(len(name))
    total = sum(seq_lens)
    x = torch.randn(total, layer.hidden_size, generator=gen)
    weight = torch.randn(total, layer.hidden_size, generator=gen)
    return layer, x, weight, seq_lens, mode, "torch"


@functools.cache
def _sharded_results(world: int) -> dict[str, list[dict]]:
    cases = {name: _inputs(name) for name, (w, _, _) in CASES.items() if w == world}
    per_rank = run_ranks(sharded_layer_grads, world, cases)
    return {name: [r[name] for r in per_rank] for name in cases}


def _reference(layer, x: torch.Tensor, weight: torch.Tensor, seq_lens: list[int]):
    """The stock transformers layer forwarded on each sample alone: (out, x grad, parameter grads),
    in the layer's dtype."""
    layer = copy.deepcopy(layer)
    x = x.to(next(layer.parameters()).dtype, copy=True).requires_grad_(True)
    outs, start = [], 0
    for n in seq_lens:
        outs.append(layer(x[start : start + n].unsqueeze(0))[0])
        start += n
    out = torch.cat(outs)
    (out * weight).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_deltanet_equals_unsharded_layer_per_sample(name):
    world = CASES[name][0]
    layer, x, weight, seq_lens, _, _ = _inputs(name)
    ref_out, ref_x_grad, ref_param_grads = _reference(layer, x, weight, seq_lens)
    truth_out, truth_x_grad, truth_param_grads = float64_reference(_reference, layer, x, weight, seq_lens)
    results = _sharded_results(world)[name]
    total = x.shape[0]
    out = torch.cat([r["out"] for r in results])[:total]
    x_grad = torch.cat([r["x_grad"] for r in results])[:total]
    assert_within_fp32_error(out, ref_out, truth_out, at_least=TOL, name="out")
    assert_within_fp32_error(x_grad, ref_x_grad, truth_x_grad, at_least=TOL, name="x grad")
    for pname, grad in results[0]["param_grads"].items():
        assert_within_fp32_error(grad, ref_param_grads[pname], truth_param_grads[pname], at_least=TOL, name=pname)


STATE_CASES = [name for name, (_, _, mode) in CASES.items() if mode == "state"]


@pytest.mark.parametrize("name", STATE_CASES)
def test_state_mode_runs_each_token_through_the_recurrence_once(name):
    """Per rank, the forward passes exactly its shard's tokens through `deltanet_core`."""
    results = _sharded_results(CASES[name][0])[name]
    counts = [r["recurrence_tokens"] for r in results]
    assert counts == [r["local_len"] for r in results], counts
