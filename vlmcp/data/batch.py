"""The packed micro-batch: the one structure the data path hands to the model.

Dimension legend: S = packed length (sum of seq_lens), B = samples in the pack (len(seq_lens)),
N_patch = vision patches of the pack's distinct images, I = those images, I_use = image
placeholder runs (one per image of each sample), N_vpatch = vision patches of all videos, V =
videos. Every tensor here is global (the whole pack); sharding over a sequence-parallel group
happens later, in `vlmcp.parallel.shard`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Label value that carries no loss (the transformers convention).
IGNORE_INDEX = -100

#: The optional per-token arrays of the tokens data format, aligned with labels: the inputs of
#: `loss.type` (`inference_logprobs`, the inference engine's logprob of each sampled token, also
#: feeds the train-inference mismatch metrics), and the temperature each token was sampled at
#: (`temperatures`: the trainer's logprob of that token is log_softmax(logits / temperature)).
#: A job may add weight arrays of its own names (`loss.terms[k].weights`, ending in "_weights").
TOKEN_ARRAYS = ("loss_weights", "advantages", "old_logprobs", "ref_logprobs",
                "inference_logprobs", "teacher_logprobs", "temperatures")

#: Arrays a pack keeps when only some of its samples carry them, with this value at the positions
#: of the others: temperature 1 (plain log_softmax), or NaN for "no inference logprob here" (the
#: mismatch metrics count only finite entries; an objective that needs the array needs it on
#: every sample, `model.loss_terms.Loss.check_batch`). Every other array is kept only when every
#: sample of the pack carries it.
ARRAY_FILL = {"temperatures": 1.0, "inference_logprobs": float("nan")}

#: Per-pair values of a preference pair record: the reference policy's summed target logprob of
#: each half (`loss.type` dpo / ipo).
PAIR_VALUES = ("ref_chosen_logp", "ref_rejected_logp")

#: `PackedBatch.sample_values` key: the reference logprob sum of each sample (a pair's half).
REF_LOGP = "ref_logp"


@dataclass
class PackedBatch:
    """One packed sequence of whole samples.

    input_ids:         [S] token ids, samples back to back.
    targets:           [S] the token that position t must predict, or IGNORE_INDEX. Already
                       shifted inside each sample (targets[t] = labels[t+1]); the last token of
                       every sample has no target, so no sample is predicted from its neighbour.
    position_ids:      [3, S] MRoPE (t, h, w) positions, computed for each sample alone
                       (they restart at 0 at every sample start).
    mm_token_type_ids: [S] 1 on image placeholder tokens, 2 on video placeholder tokens, 0
                       elsewhere.
    seq_lens:          lengths of the samples in order; the one source of sample boundaries.
    pixel_values:      [N_patch, C*T*P*P] patches of every distinct image, in order, or None.
    image_grid_thw:    [I, 3] (t, h, w) patch grid of each distinct image, in order, or None.
    image_index:       [I_use] long, the distinct image each placeholder run shows, in placeholder
                       order; None when every image is shown once (then I_use == I, in order).
                       The two halves of a preference pair show the prompt's images: they are
                       held (and encoded) once.
    pixel_values_videos: [N_vpatch, C*T*P*P] patches of every video, in placeholder order,
                       temporal group after temporal group, or None.
    video_grid_thw:    [V, 3] (groups, h, w) patch grid of each video, in placeholder order, or
                       None; each group fills one run of h*w / merge**2 video placeholders.
    sample_ids:        "file:line" of each sample, for error messages.
    token_arrays:      per-token arrays by name (`TOKEN_ARRAYS` and a job's weight arrays), each
                       [S] fp32 and shifted like targets: token_arrays[k][t] belongs to the
                       prediction of targets[t]. Only arrays that every sample of the pack
                       carries, and those of `ARRAY_FILL` that any sample carries (filled in for
                       the others).
    pairs:             (chosen, rejected) sample indices of each preference pair of the pack; both
                       halves of a pair are always in the same pack.
    sample_values:     per-sample values by name, each [B] float64 (`REF_LOGP`: a pair half's
                       reference logprob sum). Only values that every sample of the pack carries.
    routes:            [S, L_moe, K] uint8/uint16 MoE routes of the tokens, unshifted (row t: the
                       experts token t goes to in each MoE layer), NO_ROUTE rows where a sample
                       has none (`vlmcp.data.routes`); None when no sample of the pack has routes.
    sp_degree:         how many ranks of the SP group the pack is spread over: None, the group's
                       size P (one pack over the group, each rank a shard); 1, whole on this rank
                       while the group's other ranks run packs of their own
                       (`parallel.sp_dynamic`, `vlmcp.data.pack.Slot`).
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    mm_token_type_ids: torch.Tensor
    seq_lens: list[int]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    sample_ids: list[str] = field(default_factory=list)
    token_arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    image_index: torch.Tensor | None = None
    pairs: list[tuple[int, int]] = field(default_factory=list)
    sample_values: dict[str, torch.Tensor] = field(default_factory=dict)
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    routes: torch.Tensor | None = None
    sp_degree: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())
