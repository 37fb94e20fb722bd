"""Preference objectives (dpo, ipo, simpo) on the pairs of a pack, from whole-sample sums.

For a pair (c, r) of the pack: logpi(x) is the sum of the target logprobs of sample x over the
whole sample (`model.sample_sums`: reduced over the SP group, differentiable on every shard),
ref(x) its reference sum (`PackedBatch.sample_values[REF_LOGP]`) and |x| its target count. With
beta = `loss.beta` and gamma = `loss.gamma`:

    h      = beta [(logpi(c) - ref(c)) - (logpi(r) - ref(r))]
    dpo    -log sigmoid(h)
    ipo    (h / beta - 1 / (2 beta))^2
    simpo  -log sigmoid(beta logpi(c) / |c| - beta logpi(r) / |r| - gamma)     (no reference)

Computed in float64 from the fp32 sums. The step's loss is the mean over its pairs (their global
count over DP and accumulation, `model.loss_terms`).

Metrics, as TRL reports them (per pair; means over the step's pairs): "rewards/chosen" =
beta (logpi(c) - ref(c)) (simpo: beta logpi(c) / |c|), "rewards/rejected" likewise,
"rewards/accuracies" (1 where the chosen reward is above the rejected one), "rewards/margins"
(chosen - rejected), "logps/chosen" and "logps/rejected" (the summed logprobs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlmcp.config.schema import LossTerm

#: The metrics every preference objective reports (TRL's names).
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")


def needs_reference(term: LossTerm) -> bool:
    """Whether `term` needs each pair's reference sums (dpo, ipo; not simpo)."""
    return term.type in ("dpo", "ipo")


def pair_losses(term: LossTerm, sums: torch.Tensor, counts: torch.Tensor,
                reference: torch.Tensor | None, pairs: list[tuple[int, int]]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of every pair ([P] float64, differentiable through `sums`) and its metrics
    ([P] each, `PAIR_METRICS`).

    sums: [B] fp32 whole-sample target logprob sums; counts: [B] targets of each sample;
    reference: [B] float64 reference sums (None for simpo); pairs: (chosen, rejected) indices.
    """
    chosen = torch.tensor([c for c, _ in pairs], dtype=torch.long, device=sums.device)
    rejected = torch.tensor([r for _, r in pairs], dtype=torch.long, device=sums.device)
    logp = sums.double()
    beta = term.beta
    if term.type == "simpo":
        reward_c = beta * logp[chosen] / counts[chosen]
        reward_r = beta * logp[rejected] / counts[rejected]
        losses = -F.logsigmoid(reward_c - reward_r - term.gamma)
    else:
        ref = reference.to(sums.device)
        reward_c = beta * (logp[chosen] - ref[chosen])
        reward_r = beta * (logp[rejected] - ref[rejected])
        h = reward_c - reward_r
        losses = -F.logsigmoid(h) if term.type == "dpo" else (h / beta - 1.0 / (2.0 * beta)) ** 2
    with torch.no_grad():
        stats = dict(zip(PAIR_METRICS, (reward_c.detach(), reward_r.detach(),
                                        (reward_c > reward_r).double(),
                                        (reward_c - reward_r).detach(),
                                        logp[chosen].detach(), logp[rejected].detach())))
    return losses, stats
