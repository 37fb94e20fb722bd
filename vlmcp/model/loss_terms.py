"""The step's loss over one objective or several (`loss`, `loss.terms`), on one shard of one
micro-batch, and the global counts it is normalised by.

    L = sum_k coef_k (sum_t c_kt l_kt) / N_k     over every target of the step's micro-batches

with l_kt the term's per-token loss (`model.objectives`) times its mismatch weight
(`model.mismatch`), w_kt its weight (the term's weight array `loss.weights`, else 1) and

    token      c_kt = w_kt               N_k = the step's targets with w_kt != 0
    sequence   c_kt = w_kt / n_ik        N_k = the step's samples with n_ik > 0, n_ik = the targets
                                         of t's sample with w != 0 (on the whole sample)
    constant   c_kt = w_kt               N_k = loss.normalize_constant

A preference objective (`model.pair_objectives`, always the only term) sums its pairs' losses and
N = the step's pairs. Counts are global: over the SP ranks, the DP ranks and the accumulation
micro-batches of the step (`batch_counts` on the whole pack, summed by the trainer,
training/objective_step.py). A term whose N_k is 0 (no target of the step has its weight)
contributes 0.

Sequence-level quantities (gspo's ratio, the pair sums) come from one all-reduce per micro-batch
of every column the terms need (`model.sample_sums.SampleTargets.sums`). A pair's loss enters
once, on SP rank 0 of its group; every other rank ties the sums into its loss with weight zero, so
that every rank runs the all-reduce's backward, which hands rank 0's gradient to every shard.

Metrics: `stat_specs` lists (row key, count key) per metric sum; the trainer divides each global
sum by the global count of that key ("targets", "pairs", "tokens{k}": term k's targets with
w != 0, "norm{k}": N_k). One objective reports its metrics under their own names; several report
"term{k}_loss" (its sum_t c l / N_k, without coef) and "term{k}_<metric>". Whatever the
objective, the train-inference mismatch metrics (`model.mismatch.mismatch_sums`) come last,
counted by "mismatch_targets" (the targets with a finite `inference_logprobs`); a step reports
them, and that count, only when it has such targets (`REPORTED_COUNTS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlmcp.config.schema import PAIR_OBJECTIVES, LossTerm
from vlmcp.data.batch import IGNORE_INDEX, REF_LOGP, PackedBatch
from vlmcp.model.mismatch import (MISMATCH_COUNT, MISMATCH_KEYS, mismatch_count, mismatch_sums,
                                  mismatch_weights)
from vlmcp.model.objectives import (metric_keys, required_arrays, sequence_log_ratio_column,
                                    token_losses, uses_sequence_ratio)
from vlmcp.model.pair_objectives import PAIR_METRICS, needs_reference, pair_losses
from vlmcp.model.sample_sums import SampleTargets
from vlmcp.parallel.shard import ShardPlan

#: Count keys whose metrics a step reports only when the count is not 0, with the count itself.
REPORTED_COUNTS = (MISMATCH_COUNT,)


def _scale(coef: float, denominators: Sequence[float] | None, k: int) -> float:
    """coef_k / N_k (N_k = 1 without `denominators`). A term whose global count is 0 (no target
    of the step has its weight, e.g. CE on `sft_weights` in a step without SFT tokens) has a sum
    of 0 on every shard: it contributes 0, and stays in the graph with weight 0."""
    if denominators is None:
        return coef
    return coef / denominators[k] if denominators[k] else 0.0


@dataclass(frozen=True)
class Loss:
    """The objectives of a job (one `LossTerm`, or `loss.terms`)."""

    terms: tuple[LossTerm, ...] = (LossTerm(),)

    @classmethod
    def of(cls, objective: LossTerm | Loss | None) -> Loss:
        """A `Loss` from one objective (None: plain CE), or `objective` itself."""
        if isinstance(objective, Loss):
            return objective
        return cls((objective or LossTerm(),))

    @property
    def plain_ce(self) -> bool:
        """Plain token-mean CE: computed by the fused CE sum, bit for bit as before."""
        (term, *rest) = self.terms
        return (not rest and term.type == "ce" and term.normalize == "token"
                and term.weights is None and term.coef == 1.0)

    @property
    def pairwise(self) -> bool:
        """Whether the loss is a preference objective (trains on pairs only)."""
        return self.terms[0].type in PAIR_OBJECTIVES

    @property
    def needs_reference(self) -> bool:
        """Whether every pair needs its reference sums (dpo, ipo)."""
        return needs_reference(self.terms[0])

    @property
    def required_arrays(self) -> tuple[str, ...]:
        """The per-token arrays every training sample must carry, each named once."""
        return tuple(dict.fromkeys(name for term in self.terms if term.type not in PAIR_OBJECTIVES
                                   for name in required_arrays(term)))

    def stat_specs(self) -> list[tuple[str, str]]:
        """(row key, count key) of each metric sum `shard_loss` returns, in order."""
        specs = [("entropy", "targets")]
        if self.pairwise:
            specs += [(key, "pairs") for key in PAIR_METRICS]
        elif len(self.terms) == 1:
            specs += [(key, "tokens0") for key in metric_keys(self.terms[0])]
        else:
            for k, term in enumerate(self.terms):
                specs += [(f"term{k}_loss", f"norm{k}")]
                specs += [(f"term{k}_{key}", f"tokens{k}") for key in metric_keys(term)]
        return specs + [(key, MISMATCH_COUNT) for key in MISMATCH_KEYS]

    def check_batch(self, batch: PackedBatch) -> None:
        """ValueError naming the pack's samples when it lacks what the loss needs (an array that
        only some samples carry is filled with NaN for the others, `data.batch.ARRAY_FILL`:
        it must be finite on every target)."""
        is_target = batch.targets != IGNORE_INDEX
        missing = [name for name in self.required_arrays if name not in batch.token_arrays
                   or not bool(torch.isfinite(batch.token_arrays[name][is_target]).all())]
        if missing:
            raise ValueError(f"the loss needs per-token {missing} in every sample; the pack of "
                             f"samples {batch.sample_ids} lacks them")
        if self.pairwise and 2 * len(batch.pairs) != len(batch.seq_lens):
            raise ValueError(f"loss.type {self.terms[0].type!r} trains on preference pairs only; "
                             f"the pack of samples {batch.sample_ids} holds others")
        if self.needs_reference and REF_LOGP not in batch.sample_values:
            raise ValueError(f"loss.type {self.terms[0].type!r} needs the reference sums of "
                             f"every pair; the pack of samples {batch.sample_ids} lacks them")

    def count_keys(self) -> list[str]:
        """The keys of `batch_counts`."""
        return ["targets", "pairs", MISMATCH_COUNT] + [
            f"{kind}{k}" for k in range(len(self.terms)) for kind in ("tokens", "seqs")]

    def batch_counts(self, batch: PackedBatch) -> dict[str, float]:
        """The counts of one whole pack (`stat_specs`' count keys, and "seqs{k}": the samples
        with a target of term k); no communication."""
        self.check_batch(batch)
        is_target = batch.targets != IGNORE_INDEX
        sample_of = torch.repeat_interleave(torch.arange(len(batch.seq_lens)),
                                            torch.tensor(batch.seq_lens))[is_target]
        inference = batch.token_arrays.get("inference_logprobs")
        counts = {"targets": float(is_target.sum()), "pairs": float(len(batch.pairs)),
                  MISMATCH_COUNT: float(mismatch_count(
                      None if inference is None else inference[is_target]))}
        for k, term in enumerate(self.terms):
            if term.weights is None:
                weighted = torch.ones(int(is_target.sum()), dtype=torch.bool)
            else:
                weighted = batch.token_arrays[term.weights][is_target] != 0
            per_sample = torch.bincount(sample_of[weighted], minlength=len(batch.seq_lens))
            counts[f"tokens{k}"] = float(weighted.sum())
            counts[f"seqs{k}"] = float((per_sample > 0).sum())
        return counts

    def denominators(self, counts: dict[str, float]) -> list[float]:
        """N_k of every term from the step's global `counts` (`batch_counts` summed)."""
        out = []
        for k, term in enumerate(self.terms):
            if term.type in PAIR_OBJECTIVES:
                out.append(counts["pairs"])
            elif term.normalize == "constant":
                out.append(float(term.normalize_constant))
            else:
                out.append(counts[f"tokens{k}" if term.normalize == "token" else f"seqs{k}"])
        return out

    def shard_loss(self, logp: torch.Tensor, entropy: torch.Tensor, keep: torch.Tensor,
                   batch: PackedBatch, plan: ShardPlan,
                   denominators: Sequence[float] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """This shard's share of the loss (0-dim fp32, differentiable through logp) and its
        metric sums ([len(stat_specs)] float64).

        logp, entropy: [N] this shard's target logprobs and entropies; keep: [S_local] bool,
        their positions. denominators: the step's N_k (`denominators`); None divides by 1 (one
        term: the caller divides by N_0). Every rank of the SP group must call it.
        """
        self.check_batch(batch)
        device = logp.device
        samples = SampleTargets.build(batch, plan, keep)
        arrays = {name: plan.shard(batch.token_arrays[name].to(device), dim=0)[keep]
                  for name in self.required_arrays}
        sums = self._sample_sums(logp, arrays, samples)
        total = logp.new_zeros(())
        stats = [entropy.double().sum()]
        for k, term in enumerate(self.terms):
            if term.type in PAIR_OBJECTIVES:
                term_sum, term_stats = self._pair_term(term, sums.pop(0), samples, batch, plan)
            else:
                term_sum, term_stats = self._token_term(term, logp, arrays, sums, samples, batch)
                if len(self.terms) > 1:
                    term_stats = [term_sum.detach().double()] + term_stats
            stats += term_stats
            total = total + term_sum * _scale(term.coef, denominators, k)
        inference = batch.token_arrays.get("inference_logprobs")
        if inference is not None:
            inference = plan.shard(inference.to(device), dim=0)[keep]
        stats += list(mismatch_sums(logp, inference).unbind())
        return total, torch.stack([s.to(torch.float64).cpu() for s in stats])

    def _sample_sums(self, logp: torch.Tensor, arrays: dict[str, torch.Tensor],
                     samples: SampleTargets) -> list[torch.Tensor]:
        """The whole-sample sums every term needs ([B] each, in term order), from one
        all-reduce over the SP group (none when no term needs one)."""
        columns = []
        for term in self.terms:
            if uses_sequence_ratio(term):
                columns.append(sequence_log_ratio_column(logp, arrays))
            elif term.type in PAIR_OBJECTIVES:
                columns.append(logp.float())
        if not columns:
            return []
        return list(samples.sums(torch.stack(columns, dim=1)).unbind(1))

    def _token_term(self, term: LossTerm, logp: torch.Tensor, arrays: dict[str, torch.Tensor],
                    sums: list[torch.Tensor], samples: SampleTargets, batch: PackedBatch
                    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """sum_t c_t l_t of one token-level term on this shard, and its metric sums."""
        log_ratio = None
        if uses_sequence_ratio(term):
            mean = sums.pop(0) / samples.counts.to(logp.device).clamp_min(1).float()
            log_ratio = mean.detach()[samples.local]
        losses, stats = token_losses(term, logp, arrays, log_ratio)
        is_target = batch.targets != IGNORE_INDEX
        if term.mismatch != "none":
            weight, mismatch_stats = mismatch_weights(
                term, arrays["old_logprobs"], arrays["inference_logprobs"],
                batch.token_arrays["old_logprobs"][is_target],
                batch.token_arrays["inference_logprobs"][is_target], samples)
            losses = losses * weight
            stats.update(mismatch_stats)
        coeff = arrays[term.weights] if term.weights is not None else torch.ones_like(logp)
        weighted = coeff != 0
        if term.normalize == "sequence":
            if term.weights is None:
                per_sample = samples.counts
            else:
                per_sample = samples.whole_sums(
                    (batch.token_arrays[term.weights][is_target] != 0).double())
            n = per_sample.to(logp.device)[samples.local]
            coeff = torch.where(n > 0, coeff / n.clamp_min(1).float(), torch.zeros_like(coeff))
        term_sum = (losses * coeff).sum()
        metric_sums = [(stats[key].double() * weighted).sum() for key in metric_keys(term)]
        return term_sum, metric_sums

    def _pair_term(self, term: LossTerm, sums: torch.Tensor, samples: SampleTargets,
                   batch: PackedBatch, plan: ShardPlan) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The pack's pair losses on SP rank 0 (a zero tied to the sums elsewhere), and the
        metric sums (rank 0's; zeros elsewhere)."""
        if plan.rank != 0:
            return sums.sum() * 0.0, [torch.zeros((), dtype=torch.float64) for _ in PAIR_METRICS]
        reference = batch.sample_values.get(REF_LOGP) if needs_reference(term) else None
        losses, stats = pair_losses(term, sums, samples.counts.to(sums.device), reference,
                                    batch.pairs)
        return losses.sum().float(), [stats[key].sum() for key in PAIR_METRICS]
