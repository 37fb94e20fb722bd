"""vlmcp's pure-torch DeltaNet core (`conv_delta_rule`): over packed segments with per-segment
initial states it equals a float64 token-by-token recurrence (after a float64 causal conv when it
runs the conv), forward and backward, gradients into the initial states and the conv's left
context included, for chunk and stretch sizes that do not divide the segment lengths: within the
parity tests' 1e-5 and within 4x the distance of transformers' pure-torch kernel (the unsharded
reference) in fp32 from it (`assert_within_fp32_error`); and it saves for backward only its
inputs plus one state per stretch of chunks."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from tests.helpers.parity import assert_within_fp32_error, rel_err
from tests.helpers.references import delta_rule_inputs, gated_delta_rule_f64
from vlmcp.model.causal_conv import causal_conv_segments
from vlmcp.model.delta_rule import HeadLayout, conv_delta_rule
from vlmcp.model.deltanet_kernel import delta_rule_segments

LENGTHS = [70, 5, 130, 64]
LAYOUT = HeadLayout(key_heads=2, key_dim=32, value_heads=4, value_dim=32)
WIDTH = 3  # conv taps - 1


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


def _torch_kernel(*args):
    return delta_rule_segments(*args, kernel="torch")


# (seed, segment lengths): float64 token by token is the truth; transformers' own pure-torch kernel
# in fp32 is what plain transformers runs (the fp32 reference), so vlmcp's kernel must be as close
# to the truth as it is, and within the parity tests' tolerance.
CASES = {
    "four_segments": (0, LENGTHS),
    "one_short_segment_with_state": (1, [9]),
    "four_segments_other_inputs": (2, LENGTHS),
}
TOL = 1e-5


@pytest.mark.parametrize("name", list(CASES))
def test_cpu_delta_rule_segments_equal_float64_recurrence_forward_and_gradients(name):
    seed, lengths = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    tensors = delta_rule_inputs(gen, sum(lengths))
    init = 0.1 * torch.randn(4, 32, 32, generator=gen)
    values, grads = _run(_torch_kernel, tensors, init, lengths=lengths)
    fp32_values, fp32_grads = _run(_transformers_segments, tensors, init, lengths=lengths)
    truth_values, truth_grads = _run(gated_delta_rule_f64, tensors, init, lengths=lengths)
    names = ["out"] + [f"final state {i}" for i in range(len(lengths))]
    names += ["dq", "dk", "dv", "dg", "dbeta", "dstate"]
    for name, got, ref32, ref64 in zip(names, values + grads, fp32_values + fp32_grads, truth_values + truth_grads,
                                       strict=True):
        assert_within_fp32_error(got, ref32, ref64, at_least=TOL, name=name)


def _conv_inputs(gen: torch.Generator, length: int) -> list[torch.Tensor]:
    """(mixed [L, C], weight [C, 1, w+1], bias [C], left context [w, C], g, beta) in fp32."""
    channels = sum(LAYOUT.split)
    _, _, _, g, beta = delta_rule_inputs(gen, length)
    return [torch.randn(length, channels, generator=gen), 0.3 * torch.randn(channels, 1, WIDTH + 1, generator=gen),
            0.1 * torch.randn(channels, generator=gen), torch.randn(WIDTH, channels, generator=gen), g, beta]


def _conv_core_f64(mixed, weight, bias, left, g, beta, lengths, inits):
    """The definition in float64: causal conv per segment (the left context before the first),
    SiLU, split into q, k, v, then the token-by-token recurrence."""
    mixed, weight, bias, left = (t.double() for t in (mixed, weight, bias, left))
    act = F.silu(causal_conv_segments(mixed, weight, bias, lengths, left))
    q, k, v = act.split(LAYOUT.split, dim=-1)
    n = act.shape[0]
    return gated_delta_rule_f64(q.reshape(n, 2, 32), k.reshape(n, 2, 32), v.reshape(n, 4, 32), g, beta, lengths,
                                [None if s is None else s.double() for s in inits])


# chunk tokens, chunks per saved state: none divides 70, 5 or 130; the last fills no stretch
CHUNKINGS = {"chunk_16_stretch_3": (16, 3), "chunk_64_stretch_1": (64, 1), "chunk_7_stretch_5": (7, 5)}


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_conv_core_equals_float64_conv_and_recurrence_for_chunkings_that_do_not_divide_lengths(chunking):
    chunk, stretch = CHUNKINGS[chunking]
    gen = torch.Generator().manual_seed(chunk)
    tensors = _conv_inputs(gen, sum(LENGTHS))
    init = 0.1 * torch.randn(4, 32, 32, generator=gen)

    def core(mixed, weight, bias, left, g, beta, lengths, inits):
        out, finals = conv_delta_rule(mixed, weight, bias, left, g, beta, lengths, inits, LAYOUT, F.silu,
                                      chunk=chunk, stretch=stretch)
        return out, list(finals.unbind(0))

    values, grads = _run(core, tensors, init)
    ref_values, ref_grads = _run(_conv_core_f64, tensors, init)
    names = ["out", "final0", "final1", "final2", "final3", "mixed", "weight", "bias", "left", "g", "beta", "state"]
    for name, got, expected in zip(names, values + grads, ref_values + ref_grads):
        assert rel_err(got, expected) <= 1e-5, name


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while `fn` runs."""
    seen, total = set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def test_conv_core_saves_only_its_inputs_and_one_state_per_stretch():
    gen = torch.Generator().manual_seed(5)
    lengths = [300, 40]  # 300 tokens: five stretches of 64, so four saved states
    mixed, weight, bias, left, g, beta = (t.requires_grad_(True) for t in _conv_inputs(gen, sum(lengths)))
    init = (0.1 * torch.randn(4, 32, 32, generator=gen)).requires_grad_(True)
    saved = _saved_bytes(lambda: conv_delta_rule(mixed, weight, bias, left, g, beta, lengths, [init, None],
                                                 LAYOUT, F.silu, stretch=1))
    inputs = sum(t.numel() * 4 for t in (mixed, weight, bias, left, g, beta, init))
    assert saved == inputs + 4 * init.numel() * 4
