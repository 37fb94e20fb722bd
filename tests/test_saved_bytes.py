"""`vlmcp bench --saved-bytes`' counter on the packed training module: what a Gated DeltaNet layer
saves for backward is its pre-conv channels plus a few per-token gate values, one state per
stretch of chunks and its gated RMSNorm's two inputs (the norm and `out_proj` after it, replayed
under one checkpoint, keep nothing more), parameters never count, and a storage counts once."""

from __future__ import annotations

import torch

from tests.helpers.parity import build_model
from tests.helpers.saved_bytes import saved_bytes_per_layer_kind
from vlmcp.bench.saved_bytes import counting_saved_bytes
from vlmcp.model.delta_rule import CHUNK, STRETCH_CHUNKS
from vlmcp.model.packed import PackedVLM

TOKENS = 1100  # two stretches of the DeltaNet core: one saved state


def test_deltanet_layer_keeps_pre_conv_channels_gates_one_state_per_stretch_and_its_norm_inputs_only():
    saved = saved_bytes_per_layer_kind(PackedVLM(build_model()).train(), TOKENS)
    config = build_model().config.text_config
    heads, kdim, vdim = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    mixed = TOKENS * (2 * config.linear_num_key_heads * kdim + heads * vdim) * 4
    states = (-(-TOKENS // (CHUNK * STRETCH_CHUNKS)) - 1) * heads * kdim * vdim * 4
    norm_inputs = 2 * TOKENS * heads * vdim * 4  # the core's output and the gate z
    gates = 8 * TOKENS * heads * 4  # g, beta and the gate computation's own per-token values
    layer = saved["language_model.layers.*.linear_attn"]
    assert mixed + states + norm_inputs <= layer <= mixed + states + norm_inputs + gates
    assert "language_model.layers.*.linear_attn.norm" not in saved
    assert "language_model.layers.*.linear_attn.out_proj" not in saved


def test_saved_bytes_skip_parameters_and_count_each_storage_once():
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(5, 8, requires_grad=True)
    with counting_saved_bytes(layer) as counts:
        y = layer(x)
        (y * y).sum()  # saves y twice: one storage
    assert counts.by_module == {"<root>": x.numel() * 4, "<outside modules>": y.numel() * 4}
