"""A LoRA run's part of a push into engines (`publish.engines` with `lora.r` > 0): the merged
weights, computed on the trainer.

An engine serves the merged model, the model `vlmcp export --merge` writes (PEFT's
`merge_and_unload`), under its Hugging Face names. Each of its tensors is one of two kinds:

    trained   a function of the trained parameters: an adapted weight (a Linear layer's, or a
              routed-experts parameter under lora.target_parameters) is its frozen base plus
              PEFT's own delta of the adapter (`get_delta_weight`, added in place exactly as
              PEFT's `merge` adds it, so the bytes are those of the export), and a
              lora.modules_to_save copy is the trained copy itself;
    frozen    every other tensor (the vision tower, the embeddings, the norms, every weight the
              adapters do not touch), the base checkpoint's for the whole run.

Only trained tensors change from push to push: `MergedShare.trained()` is this rank's part of
them, handed to the push as its share (with publish.dense_every > 1 a push after the engine's
first sends only their changed elements: a LoRA push is sparse by construction), and
`MergedShare.whole()` this rank's part of the whole merged model, which a dense push (the
engine's first, an anchor) needs, computed only then.

Which rank computes which tensor: the merged tensors in state-dict order, spread over the ranks
by bytes (`shards.balanced_owners`), the trained and the frozen ones each balanced on their own.
Under ZeRO-3 every rank gathers each tensor's parameters with DeepSpeed's `GatheredParameters`
(an all-gather: every rank holds one whole tensor and its adapter at a time, W times the traffic
of a gather to the owner alone; a LoRA push gathers only the adapted weights and their adapters,
a dense anchor the whole model once), in the same order on every rank, and only the owner keeps
the result; under ZeRO 0-2 each owner reads its own replica, with no communication. Expert
parallelism is not covered (config/checks.py refuses it with publish.engines): AutoEP replaces
the experts module whose PEFT wrapper holds the routed experts' adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from peft.tuners.lora import LoraLayer
from peft.utils.other import ModulesToSaveWrapper
from torch import nn
from transformers import PreTrainedModel

from vlmcp.parallel import comm
from vlmcp.training.weights.hf_format import saved_tensors
from vlmcp.training.weights.shards import balanced_owners, full_nbytes

#: Path segments PEFT inserts into the names of the tensors it wraps.
_BASE = ".base_layer"
_SAVED_COPY = ".modules_to_save."
_ORIGINAL = ".original_module."
_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.",
                  ".lora_magnitude_vector.")


@dataclass(frozen=True)
class MergedTensor:
    """One tensor of the merged model: `key` its HF name, `source` the live tensor it starts from
    (the base weight, the trained copy, or the frozen tensor itself), `layer` the PEFT layer whose
    delta is added to it (None: taken as it is), `trained` whether training changes it."""

    key: str
    source: torch.Tensor
    layer: LoraLayer | None
    trained: bool

    def parameters(self) -> list[torch.Tensor]:
        """The live tensors its value reads (to gather under ZeRO-3)."""
        if self.layer is None:
            return [self.source]
        adapter = self.layer.active_adapters[0]
        return [self.source, *self.layer.lora_A[adapter].parameters(),
                *self.layer.lora_B[adapter].parameters()]

    def value(self) -> torch.Tensor:
        """Its value on the host [full shape]; under ZeRO-3 inside a gather of `parameters()`."""
        merged = self.source.detach().clone()
        if self.layer is not None:
            merged += self.layer.get_delta_weight(self.layer.active_adapters[0])
        return merged.cpu()


def merged_tensors(hf_model: PreTrainedModel) -> list[MergedTensor]:
    """Every tensor of `hf_model`'s merged model (PEFT's adapters injected in place, lora.py), in
    state-dict order, under the names `merge_and_unload` gives them."""
    deltas: dict[str, LoraLayer] = {}
    for path, module in hf_model.named_modules():
        if isinstance(module, LoraLayer):
            name = getattr(module, "parameter_name", "weight")
            deltas[f"{path.replace(_BASE, '')}.{name}"] = module
    copies = {path for path, module in hf_model.named_modules()
              if isinstance(module, ModulesToSaveWrapper)}
    out = []
    for key, tensor in saved_tensors(hf_model).items():
        if any(part in key for part in _ADAPTER_PARTS) or _ORIGINAL in key:
            continue
        if _SAVED_COPY in key:
            path, _, rest = key.partition(_SAVED_COPY)
            if path in copies:
                out.append(MergedTensor(f"{path}.{rest.partition('.')[2]}", tensor, None, True))
            continue
        merged = key.replace(_BASE, "")
        layer = deltas.get(merged)
        out.append(MergedTensor(merged, tensor, layer, layer is not None))
    return out


class MergedShare:
    """This rank's part of the merged model for the push (see the module docstring). Build it on
    every rank at the same point; `trained` and `whole` are collective under ZeRO-3 (every rank
    calls them at the same point, in the same order)."""

    def __init__(self, hf_model: PreTrainedModel, world: int, rank: int):
        self.tensors = merged_tensors(hf_model)
        self.rank = rank
        owners: dict[str, int] = {}
        for trained in (True, False):
            owners.update(balanced_owners(
                {t.key: full_nbytes(t.source) for t in self.tensors if t.trained == trained},
                world))
        self.owners = owners
        #: This rank's trained tensors of the latest `trained()` call.
        self._trained: dict[str, torch.Tensor] = {}

    def trained(self) -> dict[str, torch.Tensor]:
        """{merged name: host tensor} of this rank's trained tensors, now."""
        self._trained = self._compute(lambda t: t.trained)
        return self._trained

    def whole(self) -> dict[str, torch.Tensor]:
        """{merged name: host tensor} of this rank's part of the whole merged model, in state-dict
        order (the trained tensors as of the latest `trained()`)."""
        frozen = self._compute(lambda t: not t.trained)
        return {t.key: self._trained[t.key] if t.trained else frozen[t.key]
                for t in self.tensors if self.owners[t.key] == self.rank}

    def _compute(self, wanted: Callable[[MergedTensor], bool]) -> dict[str, torch.Tensor]:
        import deepspeed

        out = {}
        for tensor in self.tensors:
            if not wanted(tensor):
                continue
            # a no-op where ZeRO-3 partitioned none of them (DeepSpeed checks `ds_id` itself)
            with deepspeed.zero.GatheredParameters(tensor.parameters()):
                if self.owners[tensor.key] == self.rank:
                    out[tensor.key] = tensor.value()
        return out


def merged_share(module: nn.Module) -> MergedShare:
    """The `MergedShare` of a LoRA training module (`PackedVLM`: its `hf_model` holds the
    injected adapters), over the whole world."""
    return MergedShare(module.hf_model, comm.world_size(), comm.rank())
