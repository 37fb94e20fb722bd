"""Sequence-level quantities under SP: per-sample sums of per-token values, over the whole sample.

A sample's tokens may lie on several SP ranks, so any sum over a sample (the GSPO sequence ratio,
a preference pair's logprob, SimPO's length-normalised logprob) taken on one shard is silently
wrong. `SampleTargets` is built once per micro-batch from the shard plan (never from positions):
which sample each of this rank's targets belongs to. `sums` adds a shard's per-token columns into
per-sample partial sums and reduces them over the SP group in one autograd-aware all-reduce
(`comm.all_reduce_sum_autograd`): every rank gets the whole samples' sums, and the gradient of
anything computed from them flows back to the targets of every shard.

Legend: N = this shard's targets (kept positions, in order), B = samples of the pack, K = columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
from vlmcp.parallel import comm
from vlmcp.parallel.shard import ShardPlan


@dataclass(frozen=True)
class SampleTargets:
    """Which sample each target belongs to, on this shard and in the whole pack.

    local:      [N] long, the sample (index in the pack) of each of this shard's targets.
    whole:      [N_pack] long, the same for every target of the pack, in order (from the
                global targets every rank holds).
    counts:     [B] float64, the targets of each sample (the whole sample, not the shard).
    num_samples: B.
    group:      the SP group the sums are reduced over.
    """

    local: torch.Tensor
    whole: torch.Tensor
    counts: torch.Tensor
    num_samples: int
    group: comm.ProcessGroup | None

    @classmethod
    def build(cls, batch: PackedBatch, plan: ShardPlan, keep: torch.Tensor) -> SampleTargets:
        """keep: [S_local] bool, this shard's target positions (`TokenLogprobs.keep`)."""
        segment = torch.repeat_interleave(torch.arange(len(plan.seq_lens)),
                                          torch.tensor(plan.seq_lens))
        local = plan.shard(segment, dim=0).to(keep.device)[keep]
        is_target = batch.targets != IGNORE_INDEX
        whole = segment[:len(batch.targets)][is_target]
        counts = torch.bincount(whole, minlength=plan.num_samples).double()
        return cls(local, whole, counts, plan.num_samples, plan.group)

    def sums(self, columns: torch.Tensor) -> torch.Tensor:
        """Whole-sample sums of this shard's per-token columns: [N, K] -> [B, K] (fp32 in, the
        same dtype out), identical on every rank of the SP group; differentiable, the gradient
        reaching every shard's targets. Every rank of the group must call it (and, when one
        rank's columns need a gradient, run the backward)."""
        partial = columns.new_zeros((self.num_samples, columns.shape[1]))
        partial = partial.index_add(0, self.local, columns)
        return comm.all_reduce_sum_autograd(partial, self.group)

    def whole_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sample sums of a per-token array of the whole pack, no communication: [N_pack]
        (the array at the pack's targets, in order) -> [B] float64."""
        out = torch.zeros(self.num_samples, dtype=torch.float64, device=values.device)
        return out.index_add(0, self.whole.to(values.device), values.double())
