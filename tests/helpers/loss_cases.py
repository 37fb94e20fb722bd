"""Packs and objectives for in-process checks of the loss terms (`Loss.shard_loss`) with the
model-side tensors (logp, entropy, keep) on a device of the caller's choice: every objective
type and option, the mismatch correction at both levels, several terms and the preference
objectives, on text-only packs built with `build_batch` (the data path's host tensors).

Legend: S = packed length, N = this shard's targets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vlmcp.config import LossTerm
from vlmcp.data.batch import IGNORE_INDEX, REF_LOGP, PackedBatch
from vlmcp.data.formats import Sample
from vlmcp.data.pack import build_batch
from vlmcp.model.loss_terms import Loss
from vlmcp.parallel.shard import ShardPlan

VOCAB = 50
#: (prompt length, completion length) of each token sample.
TOKEN_SAMPLES = ((3, 6), (2, 9), (4, 5))
#: (prompt length, chosen length, rejected length) of each pair.
PAIRS = ((3, 4, 6), (2, 5, 3))
_PPO = dict(clip_low=0.2, clip_high=0.25)


def objectives() -> dict[str, Loss]:
    """Every token-level objective and option, and every preference objective."""
    terms = {
        "ce_sequence": [LossTerm("ce", normalize="sequence")],
        "ce_weighted_terms": [LossTerm("ce", weights="sft_weights", normalize="sequence")],
        "weighted_ce": [LossTerm("weighted_ce")],
        "policy_gradient_constant": [LossTerm("policy_gradient", normalize="constant",
                                              normalize_constant=40.0)],
        "ppo_clip_kl_dual_clip": [LossTerm("ppo_clip", kl_coef=0.1, clip_ratio_c=1.4, **_PPO)],
        "tis_token": [LossTerm("policy_gradient", mismatch="tis", mismatch_cap=1.5)],
        "tis_sequence_sum": [LossTerm("ppo_clip", mismatch="tis", mismatch_level="sequence",
                                      mismatch_reduce="sum", **_PPO)],
        "mis_token": [LossTerm("cispo", mismatch="mis", mismatch_low=0.6, mismatch_high=1.6,
                               **_PPO)],
        "mis_sequence_mean": [LossTerm("policy_gradient", normalize="sequence", mismatch="mis",
                                       mismatch_level="sequence", mismatch_reduce="mean")],
        "dppo": [LossTerm("dppo", delta_low=0.05, delta_high=0.05, kl_tau=0.05)],
        "gspo": [LossTerm("gspo", normalize="sequence", clip_low=0.08, clip_high=0.08)],
        "cispo": [LossTerm("cispo", **_PPO)],
        "opd": [LossTerm("opd", mismatch="tis", mismatch_level="sequence")],
        "three_terms": [LossTerm("ppo_clip", **_PPO),
                        LossTerm("ce", weights="sft_weights", coef=0.5),
                        LossTerm("opd", weights="distill_weights", normalize="sequence",
                                 coef=0.3)],
    }
    out = {name: Loss(tuple(t)) for name, t in terms.items()}
    out.update(dpo=Loss((LossTerm("dpo", beta=0.1),)), ipo=Loss((LossTerm("ipo", beta=0.1),)),
               simpo=Loss((LossTerm("simpo", beta=2.0, gamma=0.5),)))
    return out


def _sample(gen: torch.Generator, prompt: int, completion: int, source: str,
            arrays: dict[str, torch.Tensor], pair: str | None = None,
            values: dict[str, float] | None = None) -> Sample:
    length = prompt + completion
    ids = torch.randint(1, VOCAB, (length,), generator=gen)
    labels = ids.clone()
    labels[:prompt] = IGNORE_INDEX
    return Sample(input_ids=ids.tolist(), labels=labels.tolist(), image_paths=[],
                  pixel_values=None, image_grid_thw=None,
                  mm_token_type_ids=torch.zeros(length, dtype=torch.long),
                  position_ids=torch.arange(length).expand(3, length).clone(), source=source,
                  token_arrays=arrays, pair=pair, values=values or {})


def token_arrays(gen: torch.Generator, length: int) -> dict[str, torch.Tensor]:
    """Every per-token array the token objectives read ([L] fp32), logprobs about -2."""
    old = -2.0 + 0.3 * torch.randn(length, generator=gen)
    return {"loss_weights": 2 * torch.rand(length, generator=gen),
            "advantages": torch.randn(length, generator=gen),
            "old_logprobs": old,
            "inference_logprobs": old + 0.3 * torch.randn(length, generator=gen),
            "ref_logprobs": -2.0 + 0.3 * torch.randn(length, generator=gen),
            "teacher_logprobs": -2.0 + 0.5 * torch.randn(length, generator=gen),
            "sft_weights": (torch.rand(length, generator=gen) < 0.5).float(),
            "distill_weights": (torch.rand(length, generator=gen) < 0.6).float()}


def token_batch(seed: int = 0, arrays: Callable | None = None) -> PackedBatch:
    """A pack of the `TOKEN_SAMPLES`, each with `arrays(gen, length)` (default `token_arrays`)."""
    gen = torch.Generator().manual_seed(seed)
    make = arrays or token_arrays
    return build_batch([_sample(gen, p, c, f"t.jsonl:{i + 1}", make(gen, p + c))
                        for i, (p, c) in enumerate(TOKEN_SAMPLES)])


def pair_batch(seed: int = 0) -> PackedBatch:
    """A pack of the `PAIRS` (each half a prompt and a completion), with reference sums."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, (prompt, chosen, rejected) in enumerate(PAIRS):
        for role, completion in (("chosen", chosen), ("rejected", rejected)):
            samples.append(_sample(gen, prompt, completion, f"p.jsonl:{i + 1}", {}, role,
                                   {REF_LOGP: float(-2.0 * completion)}))
    return build_batch(samples)


def batch_for(loss: Loss, seed: int = 0) -> PackedBatch:
    return pair_batch(seed) if loss.pairwise else token_batch(seed)


def shard_inputs(batch: PackedBatch, plan: ShardPlan, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp [N] fp32 about -2, entropy [N], keep [S_local] bool) of `plan`'s shard, on the
    host."""
    keep = plan.shard(batch.targets, dim=0, pad_value=IGNORE_INDEX) != IGNORE_INDEX
    gen = torch.Generator().manual_seed(seed + 1)
    n = int(keep.sum())
    return -2.0 + 0.3 * torch.randn(n, generator=gen), torch.rand(n, generator=gen), keep


def shard_step(loss: Loss, batch: PackedBatch, plan: ShardPlan, logp: torch.Tensor,
               entropy: torch.Tensor, keep: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(shard loss, metric sums, d loss / d logp) of `loss` with the step's denominators taken
    from this one pack; logp, entropy and keep on the model's device, the batch on the host."""
    counts = loss.batch_counts(batch)
    logp = logp.detach().requires_grad_(True)
    total, stats = loss.shard_loss(logp, entropy, keep, batch, plan, loss.denominators(counts))
    total.backward()
    return total, stats, logp.grad
