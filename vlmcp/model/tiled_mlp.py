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
    Under expert parallelism the block is AutoEP's `AutoEPMoELayer` (`rebind`), and each tile's
    forward and recompute run its all-to-all: the agreed shard count below keeps the ranks' calls
    in step.

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

Routing replay (model.router_replay) needs each tile's rows: a router must select the routes of
the tokens it sees, in the forward and again in the backward's recompute. DeepSpeed's function
shards one input, so while routes are replayed the row numbers travel inside it: the MoE block's
input gets the int64 row number of each token appended as extra columns (its bytes reinterpreted
as the hidden dtype, `8 / itemsize` columns; copies keep bytes exactly), the tile's forward splits
them off and names its rows to the replay (`RouterReplay.tile`), and returns zero columns in their
place (TiledMLP's backward takes the output to have the input's shape); the extra columns get no
gradient and are cut off the output.

Legend: S_local tokens on this rank, H hidden size.
"""

from __future__ import annotations

import functools
import math

import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
from torch import nn

from vlmcp.model.router_replay import RouterReplay
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
    DeepSpeed's TiledMLP with the shard count of the current micro-batch (`plan`); `replay`: the
    MoE model's routing replay, told each tile's rows while it replays routes."""

    def __init__(self, language_model: nn.Module, replay: RouterReplay | None = None) -> None:
        self.replay = replay
        self.language_model = language_model
        self.hidden_size = language_model.config.hidden_size
        self.shards = 1
        self.modules: list[nn.Module] = []
        self.rebind()

    def rebind(self) -> None:
        """Tile every decoder layer's MLP as it is now: again after DeepSpeed's AutoEP replaced
        the MoE blocks (`parallel.ep_size`), whose `AutoEPMoELayer`s then tile as the blocks did
        (every rank runs the same number of tiles, so each tile's expert all-to-all meets its
        peers'), and the replaced blocks are let go."""
        self.modules = [layer.mlp for layer in self.language_model.layers]
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
        numbered = self.replay is not None and self.replay.needs_rows
        x = _with_row_numbers(hidden_states) if numbered else hidden_states
        if params and not x.requires_grad:
            x = x.detach().requires_grad_(True)
        if not numbered:
            return TiledMLP.apply(_class_forward, mlp, x, self.shards, params)
        forward = functools.partial(_numbered_forward, self.replay, hidden_states.shape[-1])
        return TiledMLP.apply(forward, mlp, x, self.shards, params)[..., :hidden_states.shape[-1]]


def _with_row_numbers(hidden_states: torch.Tensor) -> torch.Tensor:
    """[1, S_local, H] -> [1, S_local, H + 8 / itemsize]: each row's number (int64) appended as
    the hidden dtype's bytes."""
    rows = torch.arange(hidden_states.shape[-2], dtype=torch.int64, device=hidden_states.device)
    columns = rows[:, None].view(hidden_states.dtype)
    return torch.cat([hidden_states, columns.expand(*hidden_states.shape[:-1], -1)], dim=-1)


def _numbered_forward(replay: RouterReplay, hidden_size: int, mlp: nn.Module, x: torch.Tensor
                      ) -> torch.Tensor:
    """The MoE block on one tile of `_with_row_numbers` rows ([1, s, H + c] or [s, H + c]): its
    rows named to `replay`, zeros in the number columns of the output."""
    hidden, numbers = x[..., :hidden_size], x[..., hidden_size:]
    rows = numbers.detach().reshape(-1, numbers.shape[-1]).contiguous().view(torch.int64)
    with replay.tile(rows.reshape(-1)):
        out = _class_forward(mlp, hidden)
    return torch.cat([out, torch.zeros_like(numbers)], dim=-1)


def _class_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The transformers forward of `mlp` on a shard [1, s, H] (forward) or [s, H] (TiledMLP's
    backward flattens it), as [1, s, H] (the MoE block reads a batch dim), in x's shape."""
    return type(mlp).forward(mlp, x.reshape(1, -1, x.shape[-1])).reshape(x.shape)
