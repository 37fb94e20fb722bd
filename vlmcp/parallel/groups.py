"""Sequence-parallel (SP) and data-parallel (DP) groups.

World size W = P x DP. Ranks [g*P, (g+1)*P) form SP group g, which holds one packed sequence,
split contiguously; DP rank = g. The groups come from DeepSpeed's sequence-parallel API, and the
same module is the `mpu` handed to `deepspeed.initialize` (through `UlyssesMpu`), so DeepSpeed
reduces gradients over the sequence-data-parallel group (all W ranks) and averages them by DP.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vlmcp.parallel import comm


class UlyssesMpu:
    """DeepSpeed's Ulysses `mpu` (`parallel_state_sp`) that also answers the tensor-parallel
    size: 1, as it is (SP splits the sequence, never a weight).

    Why: `parallel_state_sp` aliases the model-parallel size to the SP size, and DeepSpeed's AutoEP
    (`engine._configure_expert_parallel`) reads that through `bwc_tensor_model_parallel_world_size`
    and refuses the run ("AutoEP does not currently support tensor model parallelism from mpu
    (bwc_tensor_model_parallel_world_size=2)") although no tensor is split. ZeRO already treats
    this mpu as SP (it tests for `initialize_sequence_parallel`); every other name is the module's.
    """

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    @staticmethod
    def get_tensor_model_parallel_world_size() -> int:
        return 1


@dataclass(frozen=True)
class SequenceParallel:
    """Where this rank sits. `group` is None when P == 1 (every collective is then the identity)."""

    size: int
    rank: int
    group: comm.ProcessGroup | None
    dp_size: int
    dp_rank: int
    mpu: UlyssesMpu | None

    @classmethod
    def single(cls) -> SequenceParallel:
        """One process, no parallelism: the packed single-rank path."""
        return cls(size=1, rank=0, group=None, dp_size=1, dp_rank=0, mpu=None)

    @classmethod
    def initialize(cls, sp_size: int) -> SequenceParallel:
        """Build the groups for `sp_size` over the current world (after `comm.init_distributed`).

        Raises ValueError naming `parallel.sp_size` when the world size is not a multiple of it.
        """
        world = comm.world_size()
        if sp_size < 1 or world % sp_size:
            raise ValueError(
                f"parallel.sp_size={sp_size} must divide the world size ({world} processes)"
            )
        global_rank = comm.rank()
        dp_size, dp_rank = world // sp_size, global_rank // sp_size
        if sp_size == 1:
            return cls(size=1, rank=0, group=None, dp_size=dp_size, dp_rank=dp_rank, mpu=None)
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        parallel_state_sp.initialize_sequence_parallel(sp_size)
        group = parallel_state_sp.get_sequence_parallel_group()
        return cls(
            size=sp_size,
            rank=comm.group_rank(group),
            group=group,
            dp_size=dp_size,
            dp_rank=dp_rank,
            mpu=UlyssesMpu(parallel_state_sp),
        )
