"""The background publish's copy off a GPU model (training/weights/shards.py `StagedShare`), under
the real DeepSpeed engine on cuda:0 (one rank over gloo), ZeRO 2 and 3:

- the fence: the copy, captured right after `engine.step()` and made on a side stream that waits
  for an event on the training thread's current stream, holds exactly that step's weights
  (bitwise), although the next step's forward and backward run on the GPU while it copies and
  its `engine.step()` follows the fence (a copy that raced DeepSpeed's own streams would hold
  the weights before the step, or after the next);
- the pinned staging buffers take the host memory the publisher counts (`buffers_held_bytes`,
  `bytes_to_stage`: each rounded up to a power of two, as torch's caching host allocator holds
  it): the bytes the allocator hands out for the first copy equal that count; its own growth and
  the resident set's are recorded beside it (measured on the lent H200, torch 2.11: 167,854,080
  bytes counted and handed out for 151,076,868 bytes of weights, ZeRO 2 and 3).

With VLMCP_GPU_CHECK_NOTES set (make gpu-check), the measured bytes are appended there as JSON
lines for the report. Marked `cuda` (runs only under `make gpu-check` / VLMCP_TEST_CUDA=1).
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from tests.helpers.distributed import run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU and VLMCP_TEST_CUDA=1 (make gpu-check)"),
]

ONE_GPU_OVER_GLOO = {"DS_ACCELERATOR": "cuda", "VLMCP_DIST_BACKEND": "gloo", "LOCAL_RANK": "0"}
#: Eight 2048 x 2048 layers (128 MiB in fp32) and one of 2049 rows, whose buffer is not a power
#: of two: copies long enough to overlap the next step's work.
LAYERS, WIDTH = 8, 2048


def _note(record: dict) -> None:
    path = os.environ.get("VLMCP_GPU_CHECK_NOTES")
    if path:
        with open(path, "a") as notes:
            notes.write(json.dumps(record) + "\n")


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _host_stats() -> dict[str, int]:
    """torch's caching host allocator's byte and block counts (empty: this torch has none)."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return {k: int(v) for k, v in stats.items()
            if k.endswith("current") or k.startswith("num_host")}


def _host_allocator_bytes(stats: dict[str, int]) -> int | None:
    """Bytes of the pinned blocks the allocator has handed out (its rounded sizes; None: this
    torch does not say). Its `allocated_bytes` may grow by less: it hands out blocks it cached
    (gloo stages CUDA tensors through pinned memory too)."""
    found = [v for k, v in stats.items() if k.startswith("active_bytes") and k.endswith("current")]
    return found[0] if found else None


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, WIDTH + 1))


def _weights_now(named: dict[str, torch.Tensor], zero3: bool) -> dict[str, torch.Tensor]:
    """Every parameter as the GPU holds it now (after a device sync), on the host."""
    torch.cuda.synchronize()
    if zero3:  # one rank: its partition is the whole (padded) parameter
        return {k: p.ds_tensor.detach().reshape(-1)[:p.ds_numel].view(p.ds_shape)
                .to("cpu", copy=True) for k, p in named.items()}
    return {k: p.detach().to("cpu", copy=True) for k, p in named.items()}


def _copies_after_steps(stage: int) -> dict:
    import deepspeed

    from vlmcp.training.weights.shards import (SharePlan, StagedShare, buffers_held_bytes,
                                               bytes_to_stage)

    model = _model().cuda()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config={"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
                "zero_optimization": {"stage": stage}})
    zero3 = stage == 3
    named = dict(engine.module.named_parameters())
    keys = tuple(named)
    sizes = tuple(int(torch.Size(getattr(p, "ds_shape", p.shape)).numel()) * p.element_size()
                  for p in named.values())
    plan = SharePlan(keys=keys, files=("model.safetensors",), keys_of=(keys,), writer_of=(0,),
                     share_bytes=(sum(sizes),), total_parameters=0)
    x = torch.randn(64, WIDTH, device="cuda")

    def forward_backward() -> None:
        engine.backward(engine(x).square().mean())

    buffers: dict[str, torch.Tensor] = {}
    mismatches = []
    forward_backward()
    engine.step()
    # the first publish's copy alone, so that the allocator's growth is the buffers' own (gloo
    # stages CUDA tensors through pinned host memory too)
    torch.cuda.synchronize()
    stats_before, rss_before = _host_stats(), _rss_bytes()
    StagedShare.capture(named, plan, 0, zero3, buffers).stage()
    stats_after, rss_after = _host_stats(), _rss_bytes()
    for step in range(3):
        truth = _weights_now(named, zero3)
        staged = StagedShare.capture(named, plan, 0, zero3, buffers)
        copy = threading.Thread(target=staged.stage)
        copy.start()
        forward_backward()  # the next step's work, on the GPU while the copy runs
        copy.join()  # the fence
        engine.step()
        share = staged.collect(None, lambda: False)
        mismatches += [f"step {step}: {k}" for k in keys if not torch.equal(share[k], truth[k])]
    counted = buffers_held_bytes(buffers)
    held_before, held_after = _host_allocator_bytes(stats_before), _host_allocator_bytes(stats_after)
    held = None if held_before is None or held_after is None else held_after - held_before
    record = {"zero": stage, "weight_bytes": sum(sizes), "counted_bytes": counted,
              "budgeted_bytes": bytes_to_stage(named, plan, 0, zero3),
              "allocator_bytes": held, "rss_growth_bytes": rss_after - rss_before,
              "pinned_buffers": sum(b.is_pinned() for b in buffers.values()),
              "buffers": len(buffers), "host_stats_before": stats_before,
              "host_stats_after": stats_after}
    _note({"test": "publish_staging", **record})
    return {"mismatches": mismatches, **record}


@pytest.mark.parametrize("stage", [2, 3])
def test_the_background_copy_holds_exactly_its_steps_weights_and_the_host_memory_counted(stage):
    (result,) = run_ranks(_copies_after_steps, 1, stage, env=ONE_GPU_OVER_GLOO)
    assert result["mismatches"] == [], result["mismatches"][:5]
    assert result["counted_bytes"] == result["budgeted_bytes"], result
    if result["allocator_bytes"] is not None:
        assert result["allocator_bytes"] == result["counted_bytes"], result
    assert result["counted_bytes"] > result["weight_bytes"], "the odd layer's buffer is rounded up"
