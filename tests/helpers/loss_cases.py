"""Packs and objectives for in-process checks of the loss terms (`Loss.shard_loss`) with the
model-side tensors (logp, entropy, keep) on a device of the caller's choice: every objective
type and option, the mismatch correction at both levels, several terms and the preference
objectives, on text-only packs of host tensors laid out as the data path packs them; and
sentinel logprobs that put a log-ratio of about 100 on one token of each objective that
exponentiates one; inputs of the chunked per-token logprobs.

Legend: S = packed length, N = this shard's targets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vlmcp.config import LossTerm
from vlmcp.data.batch import IGNORE_INDEX, REF_LOGP, PackedBatch
from vlmcp.model.loss_terms import Loss
from vlmcp.model.token_logprobs import shard_token_logprobs
from vlmcp.parallel.shard import ShardPlan

VOCAB = 50
#: (prompt length, completion length) of each token sample.
TOKEN_SAMPLES = ((3, 6), (2, 9), (4, 5))
#: (prompt length, chosen length, rejected length) of each pair.
PAIRS = ((3, 4, 6), (2, 5, 3))
#: ppo_clip's (and gspo's, cispo's) clip range in the cases.
PPO_CLIP = dict(clip_low=0.2, clip_high=0.25)


def objectives() -> dict[str, Loss]:
    """Every token-level objective and option, and every preference objective."""
    terms = {
        "ce_sequence": [LossTerm("ce", normalize="sequence")],
        "ce_weighted_terms": [LossTerm("ce", weights="sft_weights", normalize="sequence")],
        "weighted_ce": [LossTerm("weighted_ce")],
        "policy_gradient_constant": [LossTerm("policy_gradient", normalize="constant",
                                              normalize_constant=40.0)],
        "ppo_clip_kl_dual_clip": [LossTerm("ppo_clip", kl_coef=0.1, clip_ratio_c=1.4, **PPO_CLIP)],
        "tis_token": [LossTerm("policy_gradient", mismatch="tis", mismatch_cap=1.5)],
        "tis_sequence_sum": [LossTerm("ppo_clip", mismatch="tis", mismatch_level="sequence",
                                      mismatch_reduce="sum", **PPO_CLIP)],
        "mis_token": [LossTerm("cispo", mismatch="mis", mismatch_low=0.6, mismatch_high=1.6,
                               **PPO_CLIP)],
        "mis_sequence_mean": [LossTerm("policy_gradient", normalize="sequence", mismatch="mis",
                                       mismatch_level="sequence", mismatch_reduce="mean")],
        "dppo": [LossTerm("dppo", delta_low=0.05, delta_high=0.05, kl_tau=0.05)],
        "gspo": [LossTerm("gspo", normalize="sequence", clip_low=0.08, clip_high=0.08)],
        "cispo": [LossTerm("cispo", **PPO_CLIP)],
        "opd": [LossTerm("opd", mismatch="tis", mismatch_level="sequence")],
        "opd_importance": [LossTerm("opd", opd_form="importance")],
        "three_terms": [LossTerm("ppo_clip", **PPO_CLIP),
                        LossTerm("ce", weights="sft_weights", coef=0.5),
                        LossTerm("opd", weights="distill_weights", normalize="sequence",
                                 coef=0.3)],
    }
    out = {name: Loss(tuple(t)) for name, t in terms.items()}
    out.update(dpo=Loss((LossTerm("dpo", beta=0.1),)), ipo=Loss((LossTerm("ipo", beta=0.1),)),
               simpo=Loss((LossTerm("simpo", beta=2.0, gamma=0.5),)))
    return out


#: Per case: the objective, the sentinel it meets on the pack's first target (`place_sentinel`),
#: and whether that token's branch is not selected (its gradient is then 0).
SENTINELS = {
    "ppo_clip_clipped": (LossTerm("ppo_clip", **PPO_CLIP),
                         {"old_logprobs": -100.0, "advantages": 1.5}, True),
    "ppo_clip_dual_clip": (LossTerm("ppo_clip", clip_ratio_c=3.0, **PPO_CLIP),
                           {"old_logprobs": -100.0, "advantages": -1.5}, True),
    "ppo_clip_k3": (LossTerm("ppo_clip", kl_coef=0.1, **PPO_CLIP),
                    {"logp": -95.0, "ref_logprobs": -1.0, "advantages": 1.0}, False),
    "dppo_dropped": (LossTerm("dppo", kl_tau=0.01),
                     {"logp": -0.5, "inference_logprobs": -100.0, "advantages": 1.5}, False),
    "gspo_clipped": (LossTerm("gspo", normalize="sequence"),
                     {"old_logprobs_sample": -100.0, "advantages_sample": 1.0}, True),
    "cispo": (LossTerm("cispo", **PPO_CLIP), {"old_logprobs": -100.0}, False),
    "tis_sequence": (LossTerm("policy_gradient", mismatch="tis", mismatch_level="sequence"),
                     {"inference_logprobs": -100.0}, False),
    "mis_token": (LossTerm("policy_gradient", mismatch="mis"),
                  {"inference_logprobs": -100.0}, True),
}


def place_sentinel(batch: PackedBatch, logp: torch.Tensor, sentinel: dict[str, float]) -> None:
    """Write `sentinel` (array -> value) at the pack's first target, in place: "logp" is the
    shard's first logprob (`shard_inputs`, SP 1), a name ending in "_sample" sets that array on
    every target of sample 0."""
    is_target = batch.targets != IGNORE_INDEX
    first = int(is_target.nonzero()[0])
    sample0 = torch.zeros_like(is_target)
    sample0[:batch.seq_lens[0]] = True
    for key, value in sentinel.items():
        if key == "logp":
            logp[0] = value
        elif key.endswith("_sample"):
            batch.token_arrays[key.removesuffix("_sample")][sample0 & is_target] = value
        else:
            batch.token_arrays[key][first] = value


def _pack(gen: torch.Generator, parts: list[tuple[int, int, dict[str, torch.Tensor]]],
          source: str, pairs: list[tuple[int, int]] | None = None,
          references: list[float] | None = None) -> PackedBatch:
    """A text pack of samples (prompt length, completion length, arrays aligned with labels),
    shifted as `vlmcp.data.pack.build_batch` shifts them: targets[t] = labels[t + 1], the
    arrays likewise, IGNORE_INDEX / 0 at each sample's last token. (Built here, not through the
    data path, which imports PyAV for video and so does not import on the lent GPU machine.)"""
    ids, targets, arrays = [], [], {}
    for prompt, completion, sample_arrays in parts:
        length = prompt + completion
        sample_ids = torch.randint(1, VOCAB, (length,), generator=gen)
        labels = sample_ids.clone()
        labels[:prompt] = IGNORE_INDEX
        ids.append(sample_ids)
        targets.append(torch.cat([labels[1:], torch.tensor([IGNORE_INDEX])]))
        for name, values in sample_arrays.items():
            arrays.setdefault(name, []).append(torch.cat([values[1:], values.new_zeros(1)]))
    lens = [p + c for p, c, _ in parts]
    total = sum(lens)
    return PackedBatch(
        input_ids=torch.cat(ids), targets=torch.cat(targets),
        position_ids=torch.cat([torch.arange(n) for n in lens]).expand(3, total).clone(),
        mm_token_type_ids=torch.zeros(total, dtype=torch.long), seq_lens=lens,
        sample_ids=[f"{source}:{i + 1}" for i in range(len(lens))],
        token_arrays={name: torch.cat(values) for name, values in arrays.items()},
        pairs=pairs or [],
        sample_values={} if references is None else {
            REF_LOGP: torch.tensor(references, dtype=torch.float64)})


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
    return _pack(gen, [(p, c, make(gen, p + c)) for p, c in TOKEN_SAMPLES], "t.jsonl")


def pair_batch(seed: int = 0) -> PackedBatch:
    """A pack of the `PAIRS` (each half a prompt and a completion), with reference sums."""
    gen = torch.Generator().manual_seed(seed)
    halves = [(prompt, n, {}) for prompt, *completions in PAIRS for n in completions]
    return _pack(gen, halves, "p.jsonl", [(2 * i, 2 * i + 1) for i in range(len(PAIRS))],
                 [-2.0 * n for _, n, _ in halves])


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


def sentinel_step(name: str, move: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`shard_step` of the `SENTINELS` case `name` on a token pack at SP 1, with logp, entropy
    and keep put on the model's device by `move`."""
    term, sentinel, _ = SENTINELS[name]
    batch = token_batch()
    plan = ShardPlan.build(batch.seq_lens)
    logp, entropy, keep = shard_inputs(batch, plan)
    place_sentinel(batch, logp, sentinel)
    return shard_step(Loss((term,)), batch, plan, move(logp), move(entropy), move(keep))


def logprob_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, nn.Linear]:
    """(hidden [9, 8], targets [9] with two IGNORE_INDEX, temperatures [9] in [0.5, 1.5], an
    lm_head of 40 tokens) for the chunked logprobs, on the host."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 8, generator=gen)
    targets = torch.randint(0, 40, (9,), generator=gen)
    targets[[0, 4]] = IGNORE_INDEX
    temperatures = 0.5 + torch.rand(9, generator=gen)
    head = nn.Linear(8, 40)
    with torch.no_grad():
        head.weight.copy_(0.3 * torch.randn(40, 8, generator=gen))
        head.bias.copy_(0.1 * torch.randn(40, generator=gen))
    return hidden, targets, temperatures, head


def chunked_logprobs(hidden: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor,
                     head: nn.Linear, grad: bool, zero3: bool
                     ) -> tuple[torch.Tensor | None, ...]:
    """(logprobs, entropy, keep, d/d hidden, d/d head weight) of `shard_token_logprobs` in
    3-row chunks, the gradients of sum(logprobs) (None without `grad`); `zero3` marks the head
    partitioned (its checkpointed path)."""
    if zero3:
        head.weight.ds_id = 0
    with torch.set_grad_enabled(grad):
        hidden = hidden.detach().requires_grad_(grad)
        out = shard_token_logprobs(hidden, targets, head, 40 * 4 * 3 / 2**20, temperatures)
        if grad:
            (out.logprobs.sum() + out.anchor).backward()
    return out.logprobs, out.entropy, out.keep, hidden.grad, head.weight.grad


def case_step(name: str, size: int, rank: int,
              move: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`shard_step` of the `objectives()` case `name` on SP rank `rank` of `size`, with logp,
    entropy and keep put on the model's device by `move`."""
    loss = objectives()[name]
    batch = batch_for(loss)
    plan = ShardPlan.build(batch.seq_lens, size, rank)
    return shard_step(loss, batch, plan, *(move(t) for t in shard_inputs(batch, plan)))
