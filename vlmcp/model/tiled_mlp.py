"""`train.tiled_mlp`: every decoder layer's MLP through DeepSpeed's `TiledMLP`.

DeepSpeed's `deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP` runs a module's forward on
shards of the sequence without autograd and, in backward, recomputes one shard at a time under
autograd, so only the MLP's input stays saved, never its [S_local, intermediate] activations. It
sets `ds_grad_is_ready` on the parameters so that ZeRO reduces their gradients once, after the
last shard. vlmcp installs it per layer instance (the transformers class is left alone) on:
  * a dense layer's MLP (gate/up/down projections, PEFT LoRA adapters on them included);
  * a MoE layer's whole sparse block (router, routed experts, shared expert): everything in it is
    per token, so the block tiles as a whole. DeepSpeed's function shards one input only, and the
    routed experts take the router's per-token choices next to it, so they cannot tile alone.

Shard count, agreed once per micro-batch (`TiledMLPs.plan`): ceil(S_local / hidden) as DeepSpeed's
example and ArcticTraining derive it, the largest over the world (one max all-reduce), then
lowered until `torch.chunk` splits every rank's rows into exactly that many shards (k(k-1) < rows
of the shortest shard), so every rank makes the same module calls (ZeRO-3 gathers per call).

DeepSpeed's function is an autograd Function whose parameters come in a list, which autograd does
not look into: its output needs gradients only when its input does. Where the input needs none
(the first layers under LoRA, whose base weights are frozen) but the MLP has trainable parameters
(LoRA adapters on its projections), the input enters as a detached copy that requires gradients,
so the adapters still get theirs (the copy's own gradient goes nowhere).

The recompute in backward replays the forward exactly only when it draws no random numbers, so
this does not combine with dropout in the MLP (lora.dropout > 0) (the job checks refuse it).

Legend: S_local tokens on this rank, H hidden size.
"""

from __future__ import annotations

import functools
import math

import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
from torch import nn

from vlmcp.parallel import comm


def agreed_shards(local_rows: int, hidden_size: int) -> int:
    """The shard count every rank uses for TiledMLP on [S_local, H] inputs (see the module
    docstring); one all-reduce over the world when it is initialised."""
    mine = comm.all_reduce_max(torch.tensor([math.ceil(local_rows / hidden_size), -local_rows],
                                            dtype=torch.float64))
    wanted, fewest_rows = int(mine[0]), int(-mine[1])
    return shards_for(wanted, fewest_rows)


def shards_for(wanted: int, fewest_rows: int) -> int:
    """The largest k <= `wanted` (at least 1) for which torch.chunk splits any row count >=
    `fewest_rows` into exactly k pieces: k (k - 1) < fewest_rows."""
    shards = max(1, wanted)
    while shards > 1 and shards * (shards - 1) >= fewest_rows:
        shards -= 1
    return shards


class TiledMLPs:
    """The MLP (dense) or sparse MoE block of every decoder layer of `language_model`, run through
    DeepSpeed's TiledMLP with the shard count of the current micro-batch (`plan`)."""

    def __init__(self, language_model: nn.Module) -> None:
        self.hidden_size = language_model.config.hidden_size
        self.shards = 1
        self.modules = [layer.mlp for layer in language_model.layers]
        for mlp in self.modules:
            mlp.forward = functools.partial(self._tiled_forward, mlp)

    def plan(self, local_rows: int) -> int:
        """Agree on the shard count for a micro-batch of `local_rows` tokens per rank (every rank
        calls this once per micro-batch, before its forward). Returns it."""
        self.shards = agreed_shards(local_rows, self.hidden_size)
        return self.shards

    def _tiled_forward(self, mlp: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """[1, S_local, H] -> [1, S_local, H], the class's forward per shard; without autograd
        (evaluation, generation: nothing is saved) the class's forward, untiled."""
        if not torch.is_grad_enabled():
            return type(mlp).forward(mlp, hidden_states)
        params = [p for p in mlp.parameters() if p.requires_grad]
        if params and not hidden_states.requires_grad:
            hidden_states = hidden_states.detach().requires_grad_(True)
        return TiledMLP.apply(_class_forward, mlp, hidden_states, self.shards, params)


def _class_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The transformers forward of `mlp` on a shard [1, s, H] (forward) or [s, H] (TiledMLP's
    backward flattens it), as [1, s, H] (the MoE block reads a batch dim), in x's shape."""
    return type(mlp).forward(mlp, x.reshape(1, -1, x.shape[-1])).reshape(x.shape)
