"""The train-inference mismatch of one shard: how far the inference engine's logprobs of the
sampled tokens (the data's `inference_logprobs`, mu) lie from the trainer's (logp, at the same
per-token temperature).

Per target token whose mu is finite (a pack fills NaN in for samples without the array,
`data.batch.ARRAY_FILL`), with d_t = logp_t - mu_t: the shard's sums of mu_t - logp_t and of
k3_t = exp(d_t) - 1 - d_t (Schulman's k3 estimate of KL(mu || pi) from tokens that mu sampled,
>= 0; PrimeRL's "mismatch KL"), and how many tokens they cover. The loop divides both sums by the
step's global count (`MISMATCH_KEYS`). Computed in float64 from the fp32 logprobs, so that the k3
of a tiny d (about d^2 / 2) is not rounded away as fp32's exp(d) - 1 would. No autograd.
"""

from __future__ import annotations

import torch

#: The metric sums `mismatch_sums` returns, in order.
MISMATCH_KEYS = ("mismatch_logprob_diff", "mismatch_kl", "mismatch_targets")


def mismatch_sums(logp: torch.Tensor, inference_logprobs: torch.Tensor) -> torch.Tensor:
    """[3] float64: sum of (mu - logp), sum of k3, and the number of tokens with a finite mu.

    logp: [N] the trainer's logprobs of one shard's targets; inference_logprobs: [N] mu at the
    same targets (NaN where the data gives none).
    """
    with torch.no_grad():
        mu = inference_logprobs.detach().double()
        present = torch.isfinite(mu)
        d = logp.detach().double()[present] - mu[present]
        return torch.stack([(-d).sum(), (torch.expm1(d) - d).sum(),
                            present.sum().to(torch.float64)])
