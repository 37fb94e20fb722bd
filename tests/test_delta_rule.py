"""The CPU delta-rule kernel is vlmcp's own pure-torch chunked kernel: over packed segments with
per-segment initial states it equals a float64 token-by-token recurrence, it matches transformers'
pure-torch kernel (the unsharded reference) in fp32, forward and backward, and its autograd graph
splits the chunk axis once instead of indexing or writing one chunk at a time."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from tests.helpers.parity import rel_err
from tests.helpers.references import delta_rule_inputs, gated_delta_rule_f64
from vlmcp.model.delta_rule import chunked_delta_rule, delta_rule_segments

LENGTHS = [70, 5, 130, 64]


def _run(fn, tensors, init, lengths=LENGTHS):
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    state = init.clone().requires_grad_(True)
    inits = [None, state, None, state * 0.5] if len(lengths) == 4 else [state]
    out, finals = fn(*leaves, lengths, inits)
    (out.double().square().sum() + sum(f.double().square().sum() for f in finals)).backward()
    return [out.detach().double()] + [f.detach().double() for f in finals], [t.grad.double() for t in leaves + [state]]


def _transformers_segments(q, k, v, g, beta, lengths, initial_states):
    reference = inspect.unwrap(torch_chunk_gated_delta_rule)
    outs, finals, start = [], [], 0
    for length, init in zip(lengths, initial_states):
        sl = slice(start, start + length)
        out, final = reference(
            q[None, sl],
            k[None, sl],
            v[None, sl],
            g=g[None, sl],
            beta=beta[None, sl],
            initial_state=None if init is None else init[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        outs.append(out[0])
        finals.append(final[0])
        start += length
    return torch.cat(outs, dim=0), finals


# (seed, segment lengths, reference): float64 token by token is the truth; transformers' own
# pure-torch kernel is what plain transformers runs, so fp32 agreement with it keeps parity tight.
REFERENCES = {
    "four_segments_equal_float64_recurrence": (0, LENGTHS, gated_delta_rule_f64),
    "one_short_segment_with_state_equals_float64_recurrence": (1, [9], gated_delta_rule_f64),
    "four_segments_match_transformers_pure_torch_kernel_in_fp32": (2, LENGTHS, _transformers_segments),
}


@pytest.mark.parametrize("name", list(REFERENCES))
def test_cpu_delta_rule_segments_forward_and_gradients(name):
    seed, lengths, reference = REFERENCES[name]
    gen = torch.Generator().manual_seed(seed)
    tensors = delta_rule_inputs(gen, sum(lengths))
    init = 0.1 * torch.randn(4, 32, 32, generator=gen)
    values, grads = _run(delta_rule_segments, tensors, init, lengths=lengths)
    ref_values, ref_grads = _run(reference, tensors, init, lengths=lengths)
    for got, expected in zip(values + grads, ref_values + ref_grads):
        assert rel_err(got, expected) <= 1e-5


def _graph_node_names(root) -> list[str]:
    seen, stack, names = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    return names


def _indexing_nodes(chunks: int) -> dict[str, int]:
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = (t.requires_grad_(True) for t in delta_rule_inputs(gen, 64 * chunks - 10))
    out, final = chunked_delta_rule(q, k, v, g, beta, None)
    names = _graph_node_names((out.sum() + final.sum()).grad_fn)
    kinds = ("CopySlices", "SelectBackward0", "SliceBackward0", "UnbindBackward0", "StackBackward0")
    return {kind: names.count(kind) for kind in kinds}


def test_cpu_kernel_graph_splits_chunks_once_without_per_chunk_indexing():
    few, many = _indexing_nodes(3), _indexing_nodes(9)
    assert few == many
    assert few["CopySlices"] == 0 and few["StackBackward0"] == 1
