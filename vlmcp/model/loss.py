"""Sharded loss and its global normalisation.

Every rank sums the cross-entropy of the targets in its own shard. The optimizer step's loss is
sum(all target CE) / N, with N the number of target tokens over SP ranks, DP ranks and the
gradient-accumulation micro-batches of the step. DeepSpeed sums gradients over all W = P x DP
ranks, divides by DP, and divides the loss by the accumulation steps in `engine.backward`; the
scaling below undoes both, so the accumulated gradient is exactly d(sum CE / N).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.parallel import comm

#: Target tokens per chunk of the lm_head + cross-entropy, recomputed in backward so that the
#: [tokens, vocab] logits never exist for the whole shard at once.
LOSS_CHUNK_TOKENS = 2048


def shard_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Module) -> tuple[torch.Tensor, int]:
    """Sum of cross-entropy over this shard's targets.

    hidden: [S_local, hidden] final-norm hidden states; targets: [S_local] token ids or
    IGNORE_INDEX. Returns (0-dim fp32 sum, number of targets). A shard without targets returns a
    zero that still depends on the lm_head, so every rank runs the same backward.
    """
    keep = targets != IGNORE_INDEX
    count = int(keep.sum())
    if count == 0:
        return lm_head(hidden[:1]).float().sum() * 0.0, 0
    hidden, targets = hidden[keep], targets[keep]
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, count, LOSS_CHUNK_TOKENS):
        h, t = hidden[start : start + LOSS_CHUNK_TOKENS], targets[start : start + LOSS_CHUNK_TOKENS]
        if torch.is_grad_enabled() and count > LOSS_CHUNK_TOKENS:
            total = total + checkpoint(_chunk_ce, h, t, lm_head, use_reentrant=False)
        else:
            total = total + _chunk_ce(h, t, lm_head)
    return total, count


def _chunk_ce(hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    logits = lm_head(hidden).float()
    return F.cross_entropy(logits, targets, reduction="sum")


def global_target_count(local_count: int, group: comm.ProcessGroup | None = None) -> int:
    """Sum of per-rank shard target counts over `group` (the whole world when None)."""
    total = torch.tensor([local_count], dtype=torch.float64)
    return int(comm.all_reduce_sum(total, group)[0])


def scale_for_deepspeed(loss_sum: torch.Tensor, global_targets: int, dp_size: int, grad_accum: int) -> torch.Tensor:
    """The value to hand to `engine.backward` so the step's gradient is d(sum CE / N).

    loss_sum: this rank's shard CE sum for one micro-batch; global_targets: N for the whole step.
    """
    return loss_sum * (dp_size * grad_accum / max(global_targets, 1))
