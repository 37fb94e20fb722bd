"""Ulysses attention for the text model's full-attention layers, under its own registered key.

The key `ATTENTION_KEY` is added to transformers' attention registry and set on the *text* config
only; the vision tower keeps sdpa, and no existing entry ("sdpa", "flash_attention_2", ...) is
replaced. Called without a `shard_plan` (generation, plain inference) the function is exactly sdpa.

Dimension legend: S (whole padded pack), S_local = S / P, H query heads, H_kv key/value heads,
H_local = H / P, D head dim. Each rank of an SP group holds S_local tokens of every head going in,
all S tokens of H_local heads in the middle, and S_local tokens of every head coming out.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from vlmcp.parallel import comm
from vlmcp.parallel.shard import ShardPlan

ATTENTION_KEY = "vlmcp_ulysses"

#: dtypes the flash varlen kernels take.
FLASH_DTYPES = (torch.bfloat16, torch.float16)
#: Largest head dim of the flash varlen kernels.
FLASH_MAX_HEAD_DIM = 256
#: `varlen_attn`'s window (left, right) that means causal.
CAUSAL_WINDOW = (-1, 0)

try:  # optional: preferred over torch's varlen_attn where it is installed (and takes dropout)
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None


def varlen_attn_usable(fn) -> bool:
    """Whether `fn` (torch's `varlen_attn`, or None where torch lacks it) takes the arguments vlmcp
    passes: `window_size` (causal) and `enable_gqa`. Feature detection, not a version check."""
    if fn is None:
        return False
    parameters = inspect.signature(fn).parameters
    return "window_size" in parameters and "enable_gqa" in parameters


try:  # torch 2.13 has it with window_size and enable_gqa; older torch lacks it or those arguments
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None
if not varlen_attn_usable(varlen_attn):
    varlen_attn = None


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

    q: [S, Hq, D]; k, v: [S, Hk, D] with Hq a multiple of Hk (kv heads are shared, not copied,
    except as 2. says); cu_seqlens: global segment starts then S. Returns [S, Hq, D].

    No kernel stores a segment x segment score matrix. In order of precedence:
      1. CUDA, bf16/fp16, a head dim the flash kernels take (`flash_kernels_apply`): one varlen
         call over the whole pack, flash-attn's `flash_attn_varlen_func` when that package is
         installed, else torch's built-in `varlen_attn` (which has no dropout: with dropout > 0
         and no flash-attn, 2. runs; torch < 2.13 lacks it, and 2. runs there too).
      2. Everything else (CPU in any dtype, fp32 on CUDA, other head dims): sdpa one segment at
         a time on 4-D [1, H, L, D] tensors, which dispatches to a fused kernel (CPU flash; CUDA
         memory-efficient, flash or cuDNN). 3-D inputs would take the math kernel, which stores
         L x L; so would sdpa's GQA broadcast on CUDA, which its fused kernels refuse: there each
         kv head's query group is a batch entry instead (`kv_groups_as_batch`). CPU's fused kernel has no dropout, so dropout > 0 on CPU is quadratic (warned).
         Each segment's q, k, v are made contiguous per head first (a copy where a head-sharded
         [S, H, D] holds more than one head; the copy replaces the view as what sdpa keeps for
         backward): CPU's flash kernel gives the same bits on either layout and runs a little
         faster on contiguous heads (about 1 % at 16k tokens; docs/memory.md, vlmcp against ALST).
         In training on CPU, k and v are handed over with `cpu_backward_kv_heads` heads: CPU's
         fused backward splits its work over the kv heads, so with fewer kv heads than threads
         it cannot use them all (docs/memory.md: 1.25x the backward's time at 16k tokens, 4
         query heads on 1 kv head, 2 threads).
    """
    if flash_kernels_apply(q, k, v, dropout):
        cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=q.device)
        max_len = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))
        if flash_attn_varlen_func is not None:
            return flash_attn_varlen_func(
                q, k, v, cu, cu, max_len, max_len, dropout_p=dropout, softmax_scale=scaling, causal=True
            )
        if dropout == 0.0 and varlen_attn is not None:
            return varlen_attn(
                q, k, v, cu, cu, max_len, max_len,
                scale=scaling, window_size=CAUSAL_WINDOW, enable_gqa=q.shape[1] != k.shape[1],
            )
    if dropout > 0.0 and not q.is_cuda:
        warnings.warn(
            "attention dropout > 0 on CPU: torch's fused CPU attention has no dropout, so sdpa "
            "falls back to its math kernel, which stores an L x L matrix per segment",
            stacklevel=2,
        )
    kv_repeat = 1
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        kv_repeat = cpu_backward_kv_heads(q.shape[1], k.shape[1], torch.get_num_threads()) // k.shape[1]
    pieces = []
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        qs = _contiguous_heads(q[a:b])
        ks, vs = (_contiguous_heads(t[a:b], kv_repeat) for t in (k, v))
        attend = kv_groups_as_batch if qs.is_cuda and qs.shape[1] != ks.shape[1] else _sdpa_gqa
        out = attend(qs, ks, vs, dropout_p=dropout, is_causal=True, scale=scaling)
        pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces, dim=0)


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """sdpa on [1, Hq, L, D] / [1, Hk, L, D], its own GQA broadcast when Hq != Hk."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kwargs)


def kv_groups_as_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
                       ) -> torch.Tensor:
    """sdpa of q [1, Hq, L, D] on k [1, Hk, L, D], v [1, Hk, L, Dv] (query head h on kv head
    h // (Hq / Hk)) with each kv head's query group as one batch entry: q viewed as
    [Hk, Hq / Hk, L, D], k and v broadcast over the group by a zero-stride expand (no copy).
    The same attention as sdpa's `enable_gqa`, which CUDA's fused kernels do not take: with it
    sdpa falls back to its math kernel, which stores L x L (and raises where math is excluded:
    "No available kernel", docs/gpu-check.md), while CUDA's memory-efficient kernel takes the
    broadcast layout. Returns [1, Hq, L, Dv]."""
    heads, kv_heads, length = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    grouped_q = q.reshape(kv_heads, group, length, q.shape[-1])
    grouped_k, grouped_v = (t.transpose(0, 1).expand(kv_heads, group, length, t.shape[-1])
                            for t in (k, v))
    out = F.scaled_dot_product_attention(grouped_q, grouped_k, grouped_v, **kwargs)
    return out.reshape(1, heads, length, v.shape[-1])


def _contiguous_heads(segment: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """[L, H, D] -> [1, H * repeat, L, D], contiguous, each head repeated `repeat` times in place
    (one copy either way: `repeat_interleave` writes a contiguous result itself)."""
    heads = segment.transpose(0, 1).unsqueeze(0)
    return heads.repeat_interleave(repeat, dim=1) if repeat > 1 else heads.contiguous()


def cpu_backward_kv_heads(q_heads: int, kv_heads: int, threads: int) -> int:
    """How many kv heads (of one sample) to hand CPU's fused attention kernel in training.

    Its backward runs one kv head (with the query heads that share it) per thread, so with
    `kv_heads` below `threads` it cannot use them all. Returns the fewest heads, a multiple of
    `kv_heads` that divides `q_heads`, reaching `threads` (`q_heads` if none does): each kv
    head repeated that many times over, the query heads of a group still sharing one copy. The result is the same
    up to fp32 rounding: autograd sums a repeated head's gradients in another order.
    """
    group = q_heads // kv_heads
    for repeat in range(1, group + 1):
        if group % repeat == 0 and kv_heads * repeat >= threads:
            return kv_heads * repeat
    return q_heads


def flash_kernels_apply(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> bool:
    """Whether the flash varlen kernels (torch's `varlen_attn`, flash-attn) take these inputs.

    They need CUDA on compute capability 8.0 or newer, bf16 or fp16, one head dim for q, k and v
    that is a multiple of 8 and at most 256, and one of the two kernels (torch's `varlen_attn`
    with the arguments vlmcp passes, or flash-attn). Like torch's own sdpa dispatch, training with head
    dims in (192, 224] (or above 224 with dropout) is left to sdpa on sm86/89/12x, whose shared
    memory is too small for that flash backward.
    """
    if not q.is_cuda or q.dtype not in FLASH_DTYPES:
        return False
    if varlen_attn is None and flash_attn_varlen_func is None:
        return False
    dim = q.shape[-1]
    if dim % 8 or dim > FLASH_MAX_HEAD_DIM or k.shape[-1] != dim or v.shape[-1] != dim:
        return False
    major, minor = torch.cuda.get_device_capability(q.device)
    if major < 8:
        return False
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    small_smem = (major, minor) in ((8, 6), (8, 9)) or major == 12
    too_big = 192 < dim <= 224 or (dim > 224 and dropout > 0.0)
    return not (training and small_smem and too_big)
