"""Per-token logprobs of the targets (and the policy's entropy there), chunked over the vocabulary.

The token-level objectives (`model.objectives`) and scoring need log pi(y_t) = -CE_t for every
target row, not only the CE sum. A token sampled at temperature tau_t (the data's per-token
`temperatures`) gets log_softmax(logits_t / tau_t)[y_t]: each chunk's fp32 logits are divided by
their rows' temperatures in place, in forward and in the backward's recomputation (whose logit
gradient is then (onehot - softmax(logits / tau)) g / tau), and the entropy is that of the
tempered distribution. The same chunking as the loss (`model.loss`) applies: `[rows,
vocab]` logits exist for one chunk of `vocab_chunk_rows` rows at a time, in forward and in the
backward's recomputation, and gradients flow through any function of the per-token logprobs
(their incoming gradient [N] weights each row's softmax - onehot). The entropy comes out of the
same chunks (`softmax_dot_shifted`) and is never differentiated.

Paths, as for the loss: no autograd -> plain chunks through the module; autograd ->
`FusedLinearLogprobs` on the head's weight and bias; a ZeRO-3-partitioned head -> every chunk
through the module under activation checkpointing, the same chunk count on every rank
(`zero3_chunks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.model.loss import (
    CE_BYTES_PER_LOGIT,
    CHECKPOINTED_CE_BYTES_PER_LOGIT,
    chunk_entropy,
    linear_head_backward,
    logits_entropy,
    softmax_dot_shifted,
    vocab_chunk_rows,
    zero3_chunks,
    zero3_partitioned,
)


@dataclass
class TokenLogprobs:
    """One shard's per-target results.

    keep:     [S_local] bool, the target positions (targets != IGNORE_INDEX).
    logprobs: [N] fp32 log pi(target) at the kept positions, in order (differentiable).
    entropy:  [N] fp32 softmax entropy at the kept positions (no autograd).
    anchor:   0-dim zero that depends on the lm_head (add it to the loss: every rank, even one
              without targets, then runs the same backward).
    """

    keep: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor
    anchor: torch.Tensor


def shard_token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Linear,
                         chunk_mb: float, temperatures: torch.Tensor | None = None
                         ) -> TokenLogprobs:
    """Per-token target logprobs and entropies of one shard.

    hidden: [S_local, hidden] final-norm hidden states; targets: [S_local] token ids or
    IGNORE_INDEX; chunk_mb: memory budget of one chunk (`vocab_chunk_rows`); temperatures:
    [S_local] fp32 sampling temperature of each position's target (read at the targets only),
    or None for 1 everywhere.
    """
    keep = targets != IGNORE_INDEX
    vocab = lm_head.out_features
    real_temperatures = None if temperatures is None else temperatures[keep].float()
    if zero3_partitioned(lm_head):
        rows = vocab_chunk_rows(chunk_mb, vocab, CHECKPOINTED_CE_BYTES_PER_LOGIT)
        return _zero3_logprobs(hidden, keep, targets, lm_head, rows, real_temperatures)
    if not bool(keep.any()):
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return TokenLogprobs(keep, empty, empty, lm_head(hidden[:1]).float().sum() * 0.0)
    rows = vocab_chunk_rows(chunk_mb, vocab, CE_BYTES_PER_LOGIT)
    real_hidden, real_targets = hidden[keep], targets[keep]
    anchor = hidden.new_zeros((), dtype=torch.float32)
    if not torch.is_grad_enabled():
        logprobs, _, entropy = _logprob_chunks(lm_head, real_hidden, real_targets, rows,
                                               real_temperatures)
        return TokenLogprobs(keep, logprobs, entropy, anchor)
    logprobs, entropy = FusedLinearLogprobs.apply(real_hidden, real_targets, lm_head.weight,
                                                  lm_head.bias, rows, real_temperatures)
    return TokenLogprobs(keep, logprobs, entropy, anchor)


def _tempered(logits: torch.Tensor, temperatures: torch.Tensor | None, start: int,
              stop: int) -> torch.Tensor:
    """fp32 chunk logits [stop - start, vocab] divided in place by the rows' temperatures."""
    if temperatures is not None:
        logits.div_(temperatures[start:stop, None])
    return logits


def _logprob_chunks(project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: torch.Tensor, rows: int, temperatures: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Without autograd, over chunks of `rows` rows of `project(hidden)` ([rows, vocab] logits,
    divided by `temperatures` [N] when given): each row's target logprob, log-sum-exp and entropy
    ([N] fp32 each). One chunk's fp32 logits exist at a time, turned into exp(logits - max) in
    place."""
    n = hidden.shape[0]
    logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(logprobs)
    entropy = torch.empty_like(logprobs)
    with torch.no_grad():
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            logits = _tempered(project(hidden[start:stop]).float(), temperatures, start, stop)
            target_logits = logits.gather(1, targets[start:stop, None])[:, 0]
            row_max = logits.amax(1, keepdim=True)
            dot = softmax_dot_shifted(logits.sub_(row_max))
            log_z = logits.exp_().sum(1).log_()
            del logits
            lse[start:stop] = log_z + row_max[:, 0]
            logprobs[start:stop] = target_logits - lse[start:stop]
            entropy[start:stop] = chunk_entropy(log_z, dot)
    return logprobs, lse, entropy


class FusedLinearLogprobs(torch.autograd.Function):
    """log softmax((hidden[i] @ weight.T + bias) / tau_i)[targets[i]] for every row, in chunks of
    `rows`.

    hidden: [N, hidden]; targets: [N] token ids (no IGNORE_INDEX); weight: [vocab, hidden]; bias:
    [vocab] or None; temperatures: [N] fp32 tau, or None for 1. Returns (logprobs [N] fp32,
    entropy [N] fp32, not differentiable). Saves hidden, targets, the parameters, the temperatures
    and each row's log-sum-exp; backward recomputes each chunk's (tempered) logits and turns them
    in place into (g_i / tau_i) * (onehot - softmax), with g the incoming gradient of the
    logprobs, then accumulates the weight (and bias) gradient in place in one buffer, like
    `FusedLinearCrossEntropy`.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, rows: int, temperatures: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs, lse, entropy = _logprob_chunks(lambda h: F.linear(h, weight, bias), hidden,
                                                 targets, rows, temperatures)
        ctx.save_for_backward(hidden, targets, weight, bias, lse, temperatures)
        ctx.rows = rows
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor, _grad_entropy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden, targets, weight, bias, lse, temperatures = ctx.saved_tensors
        grad_logprobs = grad_logprobs.float()
        if temperatures is not None:
            grad_logprobs = grad_logprobs / temperatures

        def grad_logits_of(start: int, stop: int, logits: torch.Tensor) -> torch.Tensor:
            # d logprob / d logits = (onehot - softmax) / tau, times g, built in place in the fp32
            # logits (the 1 / tau is already in g).
            g = grad_logprobs[start:stop]
            _tempered(logits, temperatures, start, stop)
            logits.sub_(lse[start:stop, None]).exp_().mul_(-g[:, None])
            logits[torch.arange(stop - start, device=targets.device), targets[start:stop]] += g
            return logits

        grad_hidden, grad_weight, grad_bias = linear_head_backward(
            ctx, hidden, weight, bias, ctx.rows, grad_logits_of)
        return grad_hidden, None, grad_weight, grad_bias, None, None


def _zero3_logprobs(hidden: torch.Tensor, keep: torch.Tensor, targets: torch.Tensor,
                    lm_head: nn.Module, rows: int, temperatures: torch.Tensor | None
                    ) -> TokenLogprobs:
    """`TokenLogprobs` of a ZeRO-3-partitioned head: every chunk runs through the module, the same
    number of chunks on every rank (`zero3_chunks`; the zero-weight filler chunks go into the
    anchor). temperatures: [N] of the target rows, or None."""
    logprobs, entropy = [], []
    anchor = hidden.new_zeros((), dtype=torch.float32)
    chunks = zero3_chunks(hidden, keep, targets, rows)
    for index, (h, t, weight, recompute) in enumerate(chunks):
        tau = None if temperatures is None or not weight else \
            temperatures[index * rows:index * rows + t.numel()]
        if recompute:
            chunk_logprobs, chunk_entropy_ = checkpoint(_chunk_logprobs, h, t, lm_head, tau,
                                                        use_reentrant=False)
        else:
            chunk_logprobs, chunk_entropy_ = _chunk_logprobs(h, t, lm_head, tau)
        if weight:
            logprobs.append(chunk_logprobs)
            entropy.append(chunk_entropy_)
        anchor = anchor + chunk_logprobs.sum() * 0.0
    empty = hidden.new_zeros(0, dtype=torch.float32)
    return TokenLogprobs(keep, torch.cat(logprobs) if logprobs else empty,
                         torch.cat(entropy) if entropy else empty, anchor)


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Module,
                    temperatures: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float()
    if temperatures is not None:
        logits = logits / temperatures[:, None]
    logprobs = -F.cross_entropy(logits, targets, reduction="none")
    return logprobs, logits_entropy(logits)
