"""Sharded loss and its global normalisation.

Every rank sums the cross-entropy of the targets in its own shard. The optimizer step's loss is
sum(all target CE) / N, with N the number of target tokens over SP ranks, DP ranks and the
gradient-accumulation micro-batches of the step. DeepSpeed sums gradients over all W = P x DP
ranks, divides by DP, and divides the loss by the accumulation steps in `engine.backward`; the
scaling below undoes both, so the accumulated gradient is exactly d(sum CE / N).

The lm_head and the cross-entropy run in checkpointed chunks of target rows, so `[rows, vocab]`
logits exist for one chunk at a time (recomputed in backward). The chunk's row count follows from a
memory budget and the vocabulary size (`vocab_chunk_rows`), never from a fixed token count: the
transient stays within the budget at any vocabulary and any shard length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.parallel import comm

#: Default memory budget (MiB) of one lm_head + cross-entropy chunk (`train.loss_chunk_mb`):
#: 90 rows at a 248,320-token vocabulary, so the loss's logits transient stays near 256 MiB.
DEFAULT_LOSS_CHUNK_MB = 256.0

#: Peak bytes one target row of a cross-entropy chunk holds, per vocabulary entry: three fp32
#: [rows, vocab] tensors at once (in the backward of log-softmax: its saved output, the incoming
#: gradient and the outgoing one). Measured on CPU with the lm_head frozen, fp32 and bf16 heads
#: alike (the bf16 logits are cast and freed before that peak): 129 MiB at 43 rows and 250 MiB at
#: 86 rows of a 248,320-token vocabulary, against 122 and 244 MiB predicted.
CE_BYTES_PER_LOGIT = 3 * 4


def vocab_chunk_rows(budget_mb: float, vocab_size: int, bytes_per_logit: int) -> int:
    """Rows per chunk of a per-token computation over the vocabulary that keeps the chunk's
    transient within `budget_mb` MiB, when each row holds `bytes_per_logit` bytes per vocabulary
    entry at its peak. At least one row."""
    if budget_mb <= 0:
        raise ValueError(f"loss chunk budget must be > 0 MiB, got {budget_mb}")
    return max(1, int(budget_mb * 2**20) // (vocab_size * bytes_per_logit))


def shard_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Module,
                   chunk_mb: float = DEFAULT_LOSS_CHUNK_MB) -> tuple[torch.Tensor, int]:
    """Sum of cross-entropy over this shard's targets.

    hidden: [S_local, hidden] final-norm hidden states; targets: [S_local] token ids or
    IGNORE_INDEX; lm_head: a Linear with `out_features` = vocab; chunk_mb: memory budget of one
    chunk of rows (`vocab_chunk_rows` with `CE_BYTES_PER_LOGIT`). Returns (0-dim fp32 sum, number
    of targets). A shard without targets returns a zero that still depends on the lm_head, so
    every rank runs the same backward.
    """
    keep = targets != IGNORE_INDEX
    count = int(keep.sum())
    if count == 0:
        return lm_head(hidden[:1]).float().sum() * 0.0, 0
    rows = vocab_chunk_rows(chunk_mb, lm_head.out_features, CE_BYTES_PER_LOGIT)
    return chunked_sum(_chunk_ce, hidden[keep], targets[keep], lm_head, rows), count


def chunked_sum(fn: Callable[[torch.Tensor, torch.Tensor, nn.Module], torch.Tensor],
                hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Module,
                rows: int) -> torch.Tensor:
    """Sum of `fn(hidden_chunk, targets_chunk, lm_head)` over chunks of `rows` rows.

    hidden: [N, hidden]; targets: [N]. With autograd on and more than one chunk, each chunk is
    checkpointed (recomputed in backward), so only one chunk's intermediates exist at a time.
    Returns a 0-dim fp32 tensor.
    """
    count = hidden.shape[0]
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, count, rows):
        h, t = hidden[start : start + rows], targets[start : start + rows]
        if torch.is_grad_enabled() and count > rows:
            total = total + checkpoint(fn, h, t, lm_head, use_reentrant=False)
        else:
            total = total + fn(h, t, lm_head)
    return total


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
