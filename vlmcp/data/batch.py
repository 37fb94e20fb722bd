"""The packed micro-batch: the one structure the data path hands to the model.

Dimension legend: S = packed length (sum of seq_lens), N_patch = vision patches of all images in
the pack, I = images in the pack. Every tensor here is global (the whole pack); sharding over a
sequence-parallel group happens later, in `vlmcp.parallel.shard`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Label value that carries no loss (the transformers convention).
IGNORE_INDEX = -100

#: The optional per-token arrays of the tokens data format, aligned with labels: the inputs of
#: `loss.type`, the inference engine's logprob of each sampled token (`inference_logprobs`, for
#: the train-inference mismatch metrics) and the temperature it was sampled at (`temperatures`:
#: the trainer's logprob of that token is log_softmax(logits / temperature)).
TOKEN_ARRAYS = ("loss_weights", "advantages", "old_logprobs", "ref_logprobs", "inference_logprobs",
                "temperatures")

#: Arrays a pack keeps when only some of its samples carry them, with this value at the positions
#: of the others: temperature 1 (plain log_softmax), or NaN for "no inference logprob here" (the
#: mismatch metrics count only finite entries). Every other array is kept only when every sample
#: of the pack carries it.
ARRAY_FILL = {"temperatures": 1.0, "inference_logprobs": float("nan")}


@dataclass
class PackedBatch:
    """One packed sequence of whole samples.

    input_ids:         [S] token ids, samples back to back.
    targets:           [S] the token that position t must predict, or IGNORE_INDEX. Already
                       shifted inside each sample (targets[t] = labels[t+1]); the last token of
                       every sample has no target, so no sample is predicted from its neighbour.
    position_ids:      [3, S] MRoPE (t, h, w) positions, computed for each sample alone
                       (they restart at 0 at every sample start).
    mm_token_type_ids: [S] 1 on image placeholder tokens, 0 elsewhere.
    seq_lens:          lengths of the samples in order; the one source of sample boundaries.
    pixel_values:      [N_patch, C*T*P*P] patches of every image, in placeholder order, or None.
    image_grid_thw:    [I, 3] (t, h, w) patch grid of each image, in placeholder order, or None.
    sample_ids:        "file:line" of each sample, for error messages.
    token_arrays:      per-token arrays by name (`TOKEN_ARRAYS`), each [S] fp32 and shifted like
                       targets: token_arrays[k][t] belongs to the prediction of targets[t]. Only
                       arrays that every sample of the pack carries, and those of `ARRAY_FILL`
                       that any sample carries (filled in for the others).
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

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())
