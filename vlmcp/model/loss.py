"""Sharded loss and its global normalisation.

Every rank sums the cross-entropy of the targets in its own shard. The optimizer step's loss is
sum(all target CE) / N, with N the number of target tokens over SP ranks, DP ranks and the
gradient-accumulation micro-batches of the step. DeepSpeed sums gradients over all W = P x DP
ranks, divides by DP, and divides the loss by the accumulation steps in `engine.backward`; the
scaling below undoes both, so the accumulated gradient is exactly d(sum CE / N).

The lm_head and the cross-entropy run in chunks of target rows, so `[rows, vocab]` logits exist
for one chunk at a time. The chunk's row count follows from a memory budget and the vocabulary
size (`vocab_chunk_rows`), never from a fixed token count: the transient stays within the budget
at any vocabulary and any shard length. With gradients, `FusedLinearCrossEntropy` recomputes each
chunk's logits in backward and accumulates the lm_head's weight gradient in place in one buffer.
A ZeRO-3-partitioned lm_head (its weight exists only inside the module's own hooks) instead runs
each chunk through the module under activation checkpointing (`zero3_chunked_ce`, the same chunk
count on every rank, since each call gathers the weight), whose transient is
higher (`CHECKPOINTED_CE_BYTES_PER_LOGIT`, and autograd sums the chunks' weight gradients out of
place).

Every path also returns the sum of the policy's softmax entropy over the targets (a metric, never
differentiated), from the same chunks: per row log Z and sum_v exp(s_v) s_v of the max-shifted
logits s, the latter over column blocks (`softmax_dot_shifted`): the fused and no-grad paths hold
no extra `[rows, vocab]` tensor for it, the ZeRO-3 path one (within its 12-byte budget: in forward
no log-softmax backward buffers exist yet).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.parallel import comm

#: Default memory budget (MiB) of one lm_head + cross-entropy chunk (`train.loss_chunk_mb`):
#: 180 rows at a 248,320-token vocabulary.
DEFAULT_LOSS_CHUNK_MB = 256.0

#: Peak bytes one target row of a fused cross-entropy chunk holds, per vocabulary entry: a bf16
#: head's logits (2) next to their fp32 copy (4) in forward and in the backward's recomputation,
#: then the fp32 logit gradient (4) next to its bf16 copy for the matmuls (2). An fp32 head holds
#: 4 (one fp32 [rows, vocab] tensor, transformed in place).
CE_BYTES_PER_LOGIT = 6

#: The same for the checkpointed chunks of a ZeRO-3-partitioned head: three fp32 [rows, vocab]
#: tensors at once in the backward of log-softmax (its saved output, the incoming gradient and the
#: outgoing one). Measured on CPU with the lm_head frozen: 129 MiB at 43 rows and 250 MiB at 86
#: rows of a 248,320-token vocabulary, against 122 and 244 MiB predicted.
CHECKPOINTED_CE_BYTES_PER_LOGIT = 3 * 4

#: The entropy by-product of a loss chunk (`softmax_dot_shifted`) runs over this many column blocks
#: of the chunk's logits, so it adds at most 1/ENTROPY_BLOCKS to the chunk's transient.
ENTROPY_BLOCKS = 16


def vocab_chunk_rows(budget_mb: float, vocab_size: int, bytes_per_logit: int) -> int:
    """Rows per chunk of a per-token computation over the vocabulary that keeps the chunk's
    transient within `budget_mb` MiB, when each row holds `bytes_per_logit` bytes per vocabulary
    entry at its peak. At least one row."""
    if budget_mb <= 0:
        raise ValueError(f"loss chunk budget must be > 0 MiB, got {budget_mb}")
    return max(1, int(budget_mb * 2**20) // (vocab_size * bytes_per_logit))


def shard_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Linear,
                   chunk_mb: float = DEFAULT_LOSS_CHUNK_MB) -> tuple[torch.Tensor, int]:
    """Sum of cross-entropy over this shard's targets and their number (`shard_ce_and_entropy`
    without the entropy)."""
    total, count, _ = shard_ce_and_entropy(hidden, targets, lm_head, chunk_mb)
    return total, count


def shard_ce_and_entropy(hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Linear,
                         chunk_mb: float = DEFAULT_LOSS_CHUNK_MB
                         ) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Sum of cross-entropy over this shard's targets, their number, and the sum of the policy's
    softmax entropy at those positions (a by-product of the same chunks, no autograd).

    hidden: [S_local, hidden] final-norm hidden states; targets: [S_local] token ids or
    IGNORE_INDEX; lm_head: a Linear with `out_features` = vocab; chunk_mb: memory budget of one
    chunk of rows (`vocab_chunk_rows`). Returns (0-dim fp32 sum, number of targets, 0-dim fp32
    entropy sum). A shard without targets returns a zero that still depends on the lm_head, so
    every rank runs the same backward.

    Paths: without autograd, plain chunks through the module; with autograd,
    `FusedLinearCrossEntropy` on the head's weight and bias (`CE_BYTES_PER_LOGIT`); with a
    ZeRO-3-partitioned head (weight has `ds_id`), with or without autograd, chunks through the
    module, the same number on every rank (`zero3_chunked_ce`, `CHECKPOINTED_CE_BYTES_PER_LOGIT`).
    """
    keep = targets != IGNORE_INDEX
    count = int(keep.sum())
    vocab = lm_head.out_features
    if zero3_partitioned(lm_head):
        rows = vocab_chunk_rows(chunk_mb, vocab, CHECKPOINTED_CE_BYTES_PER_LOGIT)
        total, entropy_sum = zero3_chunked_ce(hidden, keep, targets, lm_head, rows)
        return total, count, entropy_sum
    if count == 0:
        zero = lm_head(hidden[:1]).float().sum() * 0.0
        return zero, 0, zero.detach()
    hidden, targets = hidden[keep], targets[keep]
    rows = vocab_chunk_rows(chunk_mb, vocab, CE_BYTES_PER_LOGIT)
    if not torch.is_grad_enabled():
        total, _, entropy = _ce_sum_and_lse(lm_head, hidden, targets, rows)
        return total, count, entropy.sum()
    total, entropy_sum = FusedLinearCrossEntropy.apply(hidden, targets, lm_head.weight,
                                                       lm_head.bias, rows)
    return total, count, entropy_sum


def zero3_partitioned(module: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions `module`'s own parameters (they carry `ds_id`).

    Reads the parameters by iterating them, never as `module.weight`: inside a ZeRO-3 forward
    that attribute read gathers a partitioned weight (an all-gather) on this rank alone, while a
    rank without targets never reaches this check, so the ranks' collectives would mismatch.
    """
    return any(hasattr(param, "ds_id") for param in module.parameters(recurse=False))


class FusedLinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden[i] @ weight.T + bias, targets[i]) in chunks of `rows` rows.

    hidden: [N, hidden]; targets: [N] token ids (no IGNORE_INDEX); weight: [vocab, hidden];
    bias: [vocab] or None. Logits are fp32 and exist for one chunk at a time, in forward and in
    backward (recomputed). Saves hidden, targets, the parameters and each row's log-sum-exp ([N]
    fp32). Backward writes the hidden-state gradient chunk by chunk into one [N, hidden] buffer
    and accumulates the weight (and bias) gradient in place in one buffer of the parameter's
    dtype, so nothing weight-sized exists beyond the gradient itself. Returns two 0-dim fp32
    tensors: the CE sum, and the sum of the rows' softmax entropies (a by-product of the forward
    chunks, `chunk_entropy`; not differentiable).
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        total, lse, entropy = _ce_sum_and_lse(lambda h: F.linear(h, weight, bias), hidden, targets,
                                              rows)
        ctx.save_for_backward(hidden, targets, weight, bias, lse)
        ctx.rows = rows
        entropy_sum = entropy.sum()
        ctx.mark_non_differentiable(entropy_sum)
        return total, entropy_sum

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _grad_entropy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden, targets, weight, bias, lse = ctx.saved_tensors

        def grad_logits_of(start: int, stop: int, logits: torch.Tensor) -> torch.Tensor:
            # softmax - onehot, times the incoming gradient, built in place in the fp32 logits.
            logits.sub_(lse[start:stop, None]).exp_()
            logits[torch.arange(stop - start, device=targets.device), targets[start:stop]] -= 1.0
            return logits.mul_(grad_total)

        grad_hidden, grad_weight, grad_bias = linear_head_backward(
            ctx, hidden, weight, bias, ctx.rows, grad_logits_of)
        return grad_hidden, None, grad_weight, grad_bias, None


def linear_head_backward(
    ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
    grad_logits_of: Callable[[int, int, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The input, weight and bias gradients of `logits = hidden @ weight.T + bias`, chunk by chunk.

    hidden: [N, hidden]; weight: [vocab, hidden]; bias: [vocab] or None; ctx: the autograd
    context whose `needs_input_grad` starts (hidden, targets, weight, bias, ...).
    grad_logits_of(start, stop, logits) turns the recomputed fp32 logits of rows [start, stop)
    ([stop - start, vocab], its own to change in place) into their gradient. The hidden gradient is
    written into one [N, hidden] buffer and the weight (and bias) gradient accumulated in place in
    one buffer of the parameter's dtype, so nothing weight-sized exists beyond the gradient.
    """
    need_hidden, _, need_weight, need_bias = ctx.needs_input_grad[:4]
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros_like(weight) if need_weight else None
    grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
    for start in range(0, hidden.shape[0], rows):
        stop = min(start + rows, hidden.shape[0])
        h = hidden[start:stop]
        grad_logits = grad_logits_of(start, stop, F.linear(h, weight, bias).float())
        if grad_bias is not None:
            grad_bias.add_(grad_logits.sum(0))
        grad_logits = grad_logits.to(weight.dtype)
        if grad_hidden is not None:
            torch.mm(grad_logits, weight, out=grad_hidden[start:stop])
        if grad_weight is not None:
            grad_weight.addmm_(grad_logits.t(), h)
        del grad_logits
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


def _ce_sum_and_lse(project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: torch.Tensor, rows: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CE sum over chunks of `rows` rows of `project(hidden)` (the lm_head, [rows, vocab]
    logits), without autograd, each row's log-sum-exp and each row's softmax entropy ([N] fp32
    both). One chunk's fp32 logits exist at a time, turned into exp(logits - max) in place."""
    lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    entropy = torch.empty_like(lse)
    total = hidden.new_zeros((), dtype=torch.float32)
    with torch.no_grad():
        for start in range(0, hidden.shape[0], rows):
            stop = min(start + rows, hidden.shape[0])
            logits = project(hidden[start:stop]).float()
            target_logits = logits.gather(1, targets[start:stop, None])[:, 0]
            row_max = logits.amax(1, keepdim=True)
            shifted_dot = softmax_dot_shifted(logits.sub_(row_max))
            row_lse = logits.exp_().sum(1).log_().add_(row_max[:, 0])
            del logits
            lse[start:stop] = row_lse
            entropy[start:stop] = chunk_entropy(row_lse - row_max[:, 0], shifted_dot)
            total += (row_lse - target_logits).sum()
    return total, lse, entropy


def softmax_dot_shifted(shifted: torch.Tensor) -> torch.Tensor:
    """sum_v exp(s_v) * s_v of each row of shifted logits s = logits - row max: [rows, vocab] ->
    [rows] fp32. Runs over blocks of vocab/ENTROPY_BLOCKS columns, so its transient is at most
    1/ENTROPY_BLOCKS of the chunk's logits; `shifted` is not modified."""
    out = shifted.new_zeros(shifted.shape[0])
    width = max(1, -(-shifted.shape[1] // ENTROPY_BLOCKS))
    for block in shifted.split(width, dim=1):
        out += block.exp().mul_(block).sum(1)
    return out


def chunk_entropy(log_z: torch.Tensor, shifted_dot: torch.Tensor) -> torch.Tensor:
    """Softmax entropy of rows from log Z = lse - max and `softmax_dot_shifted`: H = log Z -
    sum_v exp(s_v) s_v / Z ([rows] fp32)."""
    return log_z - shifted_dot * torch.exp(-log_z)


def zero3_chunked_ce(hidden: torch.Tensor, keep: torch.Tensor, targets: torch.Tensor,
                     lm_head: nn.Module, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CE sum of a ZeRO-3-partitioned lm_head, whose weight exists only inside the module's own
    hooks: every chunk of `rows` target rows runs through the module.

    hidden: [S_local, hidden]; keep: [S_local] bool, the target rows; targets: [S_local]. Every
    module call gathers the weight (a collective over the ZeRO group), so every rank of the world
    makes the same calls (`zero3_chunks`). Only one chunk's intermediates exist at a time.
    Returns 0-dim fp32 tensors: the CE sum and the entropy sum (no autograd).
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    entropy = hidden.new_zeros((), dtype=torch.float32)
    for h, t, weight, recompute in zero3_chunks(hidden, keep, targets, rows):
        if recompute:
            ce, ent = checkpoint(_chunk_ce, h, t, lm_head, use_reentrant=False)
        else:
            ce, ent = _chunk_ce(h, t, lm_head)
        total = total + ce * weight
        entropy += ent.detach() * weight
    return total, entropy


def zero3_chunks(hidden: torch.Tensor, keep: torch.Tensor, targets: torch.Tensor, rows: int
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor, float, bool]]:
    """The chunks of a ZeRO-3-partitioned head's loss: (hidden [r, hidden], targets [r], weight,
    recompute), the same number on every rank of the world.

    The chunk count is the largest over the world (one all-reduce; at least one); a rank with
    fewer target chunks gets the rest as chunks of one row with weight zero (the same graph as a
    real chunk, so the module's hooks fire in the same order in backward and ZeRO-3's gathers
    line up across ranks). `recompute`: with autograd, every chunk is checkpointed exactly when
    the count is above one.
    """
    real_hidden, real_targets = hidden[keep], targets[keep]
    mine = torch.tensor([-(-real_targets.numel() // rows)], dtype=torch.float64)
    chunks = max(1, int(comm.all_reduce_max(mine)[0]))
    recompute = torch.is_grad_enabled() and chunks > 1
    for start in range(0, chunks * rows, rows):
        h, t = real_hidden[start : start + rows], real_targets[start : start + rows]
        if t.numel() == 0:
            yield hidden[:1], targets.new_zeros(1), 0.0, recompute
        else:
            yield h, t, 1.0, recompute


def _chunk_ce(hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Module
              ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float()
    ce = F.cross_entropy(logits, targets, reduction="sum")
    return ce, logits_entropy(logits).sum()


def logits_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Softmax entropy of each row of fp32 `logits` ([rows, vocab] -> [rows]), without autograd;
    one [rows, vocab] transient besides `logits`, which is not modified."""
    with torch.no_grad():
        row_max = logits.amax(1, keepdim=True)
        shifted = logits - row_max
        dot = softmax_dot_shifted(shifted)
        log_z = shifted.exp_().sum(1).log_()
        return chunk_entropy(log_z, dot)


def scale_for_deepspeed(loss_sum: torch.Tensor, global_targets: float, dp_size: int,
                        grad_accum: int) -> torch.Tensor:
    """The value to hand to `engine.backward` so the step's gradient is d(sum CE / N).

    loss_sum: this rank's shard CE sum for one micro-batch; global_targets: N for the whole step
    (a count, or any positive normaliser; 0, a step without targets, divides by 1).
    """
    return loss_sum * (dp_size * grad_accum / (global_targets or 1))
