"""What each kind of module of a packed training module keeps for backward, counted by
`vlmcp.bench.saved_bytes` over one forward and backward of a synthetic pack."""

from __future__ import annotations

from vlmcp.bench.inputs import synthetic_pack
from vlmcp.bench.saved_bytes import counting_saved_bytes, layer_summary
from vlmcp.model.packed import PackedVLM


def saved_bytes_per_layer_kind(module: PackedVLM, tokens: int) -> dict[str, float]:
    """Bytes each kind of module keeps for backward, one layer of it, on one `tokens`-long pack."""
    batch = synthetic_pack(tokens, 1, module.hf_model.config)
    with counting_saved_bytes(module) as counts:
        loss, _, _ = module(batch)
    loss.backward()
    return {row["module"]: row["bytes_per_token"] * tokens for row in layer_summary(counts.per_token(tokens))}
