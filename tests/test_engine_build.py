"""vlmcp's own build of DeepSpeed's engine (training/ds/initialize.py `build_own_engine`, the path
every expert-parallel run takes: deepspeed.initialize's steps with vlmcp's engine subclass) builds,
on a module without AutoEP, the engine deepspeed.initialize builds: the same optimizer, the same
groups and sizes, the same config, and the same weights after a clipped step. At world 2 under
vlmcp's SP mpu, ZeRO 0 (DeepSpeed's own clipping path), 1 and 3, in one set of processes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.e2e

STAGES = (0, 1, 3)


def _engines(stages: tuple[int, ...]) -> dict[int, dict]:
    """Per stage: what each way's engine holds (rank's view)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from vlmcp.parallel.groups import SequenceParallel
    from vlmcp.training.ds.initialize import build_own_engine
    from vlmcp.training.ds.zero3_sp import sp_exact_zero_settings

    sp = SequenceParallel.initialize(2)
    results = {}
    for stage in stages:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
        config = sp_exact_zero_settings({
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.01, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}, sp.size, 32 * 16)
        seen = {}
        for way in ("deepspeed.initialize", "vlmcp"):
            copied = copy.deepcopy(module)
            optimizer = torch.optim.AdamW(copied.parameters(), lr=0.1)
            if way == "vlmcp":
                engine = build_own_engine(copied, copy.deepcopy(config), sp.mpu,
                                          optimizer=optimizer)
            else:
                engine = deepspeed.initialize(model=copied, config=copy.deepcopy(config),
                                              mpu=sp.mpu, optimizer=optimizer)[0]
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
            engine.backward(engine(x).pow(2).sum())
            engine.step()
            inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
            seen[way] = {
                "optimizer": type(engine.optimizer).__name__,
                "inner": type(inner).__name__,
                "groups": [{k: v for k, v in g.items() if k != "params"}
                           for g in inner.param_groups],
                "sizes": (engine.dp_world_size, engine.seq_dp_world_size, engine.mp_world_size,
                          engine.sequence_parallel_size),
                "config": engine.config,
                "zero": engine.zero_optimization_stage(),
                "weights": [(p if stage == 0 else safe_get_full_fp32_param(p)).detach().clone()
                            for p in engine.module.parameters()],
            }
            del engine
        results[stage] = seen
    return results


@pytest.fixture(scope="module")
def built():
    return run_ranks(_engines, 2, STAGES)


@pytest.mark.parametrize("stage", STAGES)
def test_vlmcps_own_build_is_deepspeeds_engine_on_a_module_without_expert_parallelism(built,
                                                                                     stage):
    for rank in built:
        theirs, ours = rank[stage]["deepspeed.initialize"], rank[stage]["vlmcp"]
        for key in ("optimizer", "inner", "groups", "sizes", "config", "zero"):
            assert ours[key] == theirs[key], key
        assert all(torch.equal(a, b) for a, b in zip(ours["weights"], theirs["weights"]))
