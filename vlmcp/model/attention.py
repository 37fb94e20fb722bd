"""Ulysses attention for the text model's full-attention layers, under its own registered key.

The key `ATTENTION_KEY` is added to transformers' attention registry and set on the *text* config
only; the vision tower keeps sdpa, and no existing entry ("sdpa", "flash_attention_2", ...) is
replaced. Called without a `shard_plan` (generation, plain inference) the function is exactly sdpa.

Dimension legend: S (whole padded pack), S_local = S / P, H query heads, H_kv key/value heads,
H_local = H / P, D head dim. Each rank of an SP group holds S_local tokens of every head going in,
all S tokens of H_local heads in the middle, and S_local tokens of every head coming out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from vlmcp.parallel import comm
from vlmcp.parallel.shard import ShardPlan

ATTENTION_KEY = "vlmcp_ulysses"


def register_attention() -> str:
    """Add vlmcp's attention (and its mask builder, the same as sdpa's) to the registries.

    Idempotent; adds a new key and leaves every existing key as it is. Returns the key.
    """
    AttentionInterface.register(ATTENTION_KEY, ulysses_attention_forward)
    AttentionMaskInterface.register(ATTENTION_KEY, sdpa_mask)
    return ATTENTION_KEY


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    shard_plan: ShardPlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over a sequence-sharded pack, causal within each packed sample.

    query: [1, H, S_local, D]; key, value: [1, H_kv, S_local, D] (this rank's shard, after RoPE).
    Returns ([1, S_local, H, D], None), the layout transformers' attention interfaces return.
    Without `shard_plan` this is transformers' sdpa attention with the given mask.
    """
    if shard_plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1, got query of shape {tuple(query.shape)}")
    group = shard_plan.group
    q = query[0].transpose(0, 1)
    k = replicate_kv_heads(key[0].transpose(0, 1), shard_plan.size)
    v = replicate_kv_heads(value[0].transpose(0, 1), shard_plan.size)
    q, k, v = (comm.seq_to_heads_autograd(t, group) for t in (q, k, v))
    out = varlen_causal_attention(
        q, k, v, shard_plan.cu_seqlens, scaling=scaling, dropout=dropout if module.training else 0.0
    )
    out = comm.heads_to_seq_autograd(out, group)
    return out.unsqueeze(0), None


def replicate_kv_heads(kv: torch.Tensor, sp_size: int) -> torch.Tensor:
    """[S_local, H_kv, D] -> [S_local, max(H_kv, P), D].

    When P > H_kv (P a multiple of H_kv), each kv head is repeated P / H_kv times in place, so
    that after the all-to-all rank r holds kv head r * H_kv // P: the one its query heads use.
    """
    heads = kv.shape[1]
    if heads % sp_size == 0:
        return kv
    if sp_size % heads:
        raise ValueError(
            f"key/value heads ({heads}) and parallel.sp_size ({sp_size}): one must divide the other"
        )
    return kv.repeat_interleave(sp_size // heads, dim=1)


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: tuple[int, ...],
    scaling: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention inside each segment of a packed sequence, never across segments.

    q: [S, Hq, D]; k, v: [S, Hk, D] with Hq a multiple of Hk; cu_seqlens: global segment starts
    then S. Returns [S, Hq, D]. Uses flash-attn's varlen kernel on CUDA when installed, and sdpa
    one segment at a time otherwise.
    """
    if q.is_cuda and _flash_varlen() is not None:
        cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=q.device)
        max_len = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))
        return _flash_varlen()(
            q, k, v, cu, cu, max_len, max_len, dropout_p=dropout, softmax_scale=scaling, causal=True
        )
    groups = q.shape[1] // k.shape[1]
    pieces = []
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        qs = q[a:b].transpose(0, 1)
        ks = k[a:b].transpose(0, 1).repeat_interleave(groups, dim=0)
        vs = v[a:b].transpose(0, 1).repeat_interleave(groups, dim=0)
        out = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout, is_causal=True, scale=scaling)
        pieces.append(out.transpose(0, 1))
    return torch.cat(pieces, dim=0)


def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func
