"""The rank-parallel, background publish and the rank-parallel final export, on 2 real ranks over
gloo with a real DeepSpeed engine (one process pair per case: ZeRO-3 on a dense model with tied
embeddings, ZeRO-3 and ZeRO-2 on a MoE; each case makes several checks on one run; ZeRO-2 on the
dense model: tests/test_train_resume.py).

* After optimizer step 1, the same weights are published three ways: rank 0 alone with
  save_pretrained (`publish.sharded: false`, the writer before rank-parallel shards),
  rank-parallel and synchronous, and rank-parallel in the background. The background publish's
  copy off the live model is held back until the next step (`train_step`) is at its fence, right
  before its optimizer step, and its write until that step has changed every trained weight:
  every rank's fence waited (`publish_fence_wait_s`), and its step_1 still equals the other two
  bit for bit (every tensor; every file, index included, of the synchronous one) and loads with
  `from_pretrained`. With every share above publish.buffer_mb, the ranks write before training
  on, and with DeepSpeed's all-gather instead of the gather to each tensor's owner (the path of
  NVMe-offloaded partitions, on the training's thread, written in the background), the step is
  the same.
* The final export (every rank its shard) equals, tensor for tensor and in its config files, the
  export of the same weights by save_pretrained on rank 0.
* A second background publish (of step 2, into the host buffers of the first) equals the
  synchronous one; a publisher whose fence does not wait, its copy held until the next step is
  done, publishes other weights (the fence is what keeps step N exact).
* A background publish still in flight at a stop is abandoned within publish.stop_wait_s, its
  write held back (ZeRO-2) or its gather slowed on rank 1 with the ranks' threads agreeing before
  every tensor (ZeRO-3): no step_N appears, its `.tmp-` directory holds no STABLE, the next start
  removes it, and a publish over the same publish group afterwards equals the synchronous one.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

from tests.helpers.distributed import run_ranks
from tests.helpers.launching import tiny_job
from vlmcp.data.rollouts import STABLE
from vlmcp.model.tiny import build_tiny_checkpoint
from vlmcp.training.weights.hf_format import INDEX_NAME, WEIGHTS_NAME, read_hf_weights

pytestmark = pytest.mark.e2e


def _tied_checkpoint(out: Path) -> Path:
    """A tiny dense checkpoint whose lm_head is tied to the input embeddings."""
    build_tiny_checkpoint(out)
    config = json.loads((out / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(out / WEIGHTS_NAME)
    del weights["lm_head.weight"]
    save_file(weights, out / WEIGHTS_NAME, metadata={"format": "pt"})
    return out


def _held_writes(gate: threading.Event) -> None:
    """Shard writes wait for `gate` (a slow disk, in this process only)."""
    from vlmcp.training.weights import sharded_write

    real = sharded_write.write_shard

    def held(tensors, path):
        gate.wait()
        real(tensors, path)

    sharded_write.write_shard = held


def _holdable_copies() -> list:
    """The publish threads' copies off the live model (training/weights/shards.py) first call
    hold[0] when it is set (a slow copy, in this process only); returns hold."""
    from vlmcp.training.weights import shards

    hold: list = [None]
    real = shards.StagedShare.stage

    def held(self):
        if hold[0] is not None:
            hold[0]()
        real(self)

    shards.StagedShare.stage = held
    return hold


def _slowable_gathers(slow: list) -> None:
    """Each gather to a tensor's owner (`comm.gather_into`) first sleeps slow[0] seconds."""
    from vlmcp.parallel import comm

    real = comm.gather_into

    def slowed(*args):
        time.sleep(slow[0])
        real(*args)

    comm.gather_into = slowed


def _publish_ways(checkpoint: str, train_file: str, out: str, zero: int) -> dict:
    """On every rank: one step, its weights published three ways; a background publish whose
    copy the next optimizer step must wait for; the final export two ways; a second background
    publish and one without the fence; then a write abandoned at a stop, mid-gather under
    ZeRO-3, and a publish after it."""
    from vlmcp.config import job_from_dict
    from vlmcp.parallel import comm
    from vlmcp.training.weights import shards
    from vlmcp.training.weights.export import engine_hf_state_dict, save_final
    from vlmcp.training.weights.hf_format import save_hf
    from vlmcp.training.loop import start_run, train_step
    from vlmcp.training.weights.publish import Publisher

    out = Path(out)
    job = job_from_dict(tiny_job(Path(checkpoint), Path(train_file), out / "run",
                                 data={"max_seq_len": 64},
                                 deepspeed={"zero_optimization": {"stage": zero}},
                                 publish={"dir": str(out / "unused")}, train={"max_steps": 4}))

    def way(name: str, start_step: int = 0, **publish) -> Publisher:
        variant = dataclasses.replace(job, publish=dataclasses.replace(
            job.publish, dir=str(out / name), **publish))
        return Publisher(variant, run.engine, run.module, start_step=start_step)

    run = start_run(job)
    run.engine.train()
    train_step(run, 0)
    result: dict = {"serial": way("serial", sharded=False).publish(1),
                    "sync": way("sync", background=False).publish(1)}
    over_budget = way("over_budget", buffer_mb=0.0)  # every share is larger: written inline
    result["over_budget"] = over_budget.publish(1) + over_budget.check()
    owner_gatherable = shards._owner_gatherable
    shards._owner_gatherable = lambda param: False  # as under NVMe offload: DeepSpeed's gather
    by_modules = way("by_modules")
    by_modules.publish(1)
    by_modules.close()
    shards._owner_gatherable = owner_gatherable

    # The copy waits until the next step's optimizer step is at the fence; the write is held
    # back until that step has changed every trained weight.
    gate = threading.Event()
    _held_writes(gate)
    hold = _holdable_copies()
    background = way("background")
    at_fence = threading.Event()
    fence = background.fence
    background.fence = lambda: (at_fence.set(), fence())
    hold[0] = lambda: (at_fence.wait(), time.sleep(0.3))
    result["background_publish"] = background.publish(1)
    run.publisher = background
    train_step(run, 1)
    hold[0] = None
    result["background_check"] = background.check()
    gate.set()
    result["background_close"] = background.close()

    hf_model, source = run.module.hf_model, job.resolve_input(job.model.path)
    save_final(run.engine, hf_model, source, out / "final")
    state = engine_hf_state_dict(run.engine, run.module, hf_model)
    if comm.rank() == 0:
        save_hf(hf_model, state, source, out / "final_rank0")
    comm.barrier()

    # The second background publish refills the host buffers of the first.
    way("sync", start_step=1, background=False).publish(2)
    background.publish(2)
    result["second_close"] = background.close()

    # Without the fence, a copy held until the next step is done publishes that step instead.
    unfenced = way("unfenced")
    unfenced.fence = lambda: None
    stepped = threading.Event()
    hold[0] = stepped.wait
    unfenced.publish(2)
    run.publisher = unfenced
    train_step(run, 2)
    stepped.set()
    unfenced.close()
    hold[0] = None

    # A stop while the write is held back (ZeRO 0-2), or while rank 1 gathers slowly, with the
    # ranks' threads agreeing before every tensor (ZeRO-3): abandoned within the stop budget.
    stopped = threading.Event()
    _held_writes(stopped)
    slow = [0.05 if comm.rank() == 1 else 0.0]
    _slowable_gathers(slow)
    shards.AGREE_BYTES = 1
    background.publish(3)
    result["stop_close"] = background.close(0.2)
    comm.barrier()
    tmp = out / "background" / ".tmp-step_3"
    result["after_stop"] = {"step_3": (out / "background" / "step_3").exists(),
                            "tmp": tmp.is_dir(), "tmp_stable": (tmp / STABLE).exists()}
    comm.barrier()
    way("background", start_step=3)
    result["tmp_after_restart"] = tmp.exists()
    slow[0] = 0.0
    stopped.set()
    # The publish thread's group is whole after the abandoned gather.
    way("sync", start_step=2, background=False).publish(3)
    background.publish(3)
    result["after_stop_close"] = background.close()
    return result


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key, value in a.items():
        assert value.dtype == b[key].dtype and torch.equal(value, b[key]), f"{what}: {key}"


@pytest.mark.parametrize("zero, moe", [(3, False), (3, True), (2, True)],
                         ids=["zero3-dense-tied", "zero3-moe", "zero2-moe"])
def test_rank_parallel_and_background_publishes_and_the_final_export_equal_rank0s_bit_for_bit(
        zero, moe, digits_jsonl, tmp_path):
    checkpoint = (build_tiny_checkpoint(tmp_path / "moe", moe=True) if moe
                  else _tied_checkpoint(tmp_path / "tied"))
    ranks = run_ranks(_publish_ways, 2, str(checkpoint), str(digits_jsonl / "train.jsonl"),
                      str(tmp_path), zero)
    rank0 = ranks[0]

    serial, sync, background = (tmp_path / name / "step_1"
                                for name in ("serial", "sync", "background"))
    assert [p.name for p in serial.iterdir() if p.suffix == ".safetensors"] == [WEIGHTS_NAME]
    shards = sorted(p.name for p in sync.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((sync / INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    reference = load_file(serial / WEIGHTS_NAME)
    assert index["weight_map"].keys() == reference.keys()
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size()
                                                  for v in reference.values())
    _assert_same_tensors(read_hf_weights(sync), reference, "rank-parallel step_1")
    assert _files(background) == _files(sync), "background and synchronous step_1 differ"
    assert _files(tmp_path / "over_budget" / "step_1") == _files(sync)
    assert _files(tmp_path / "by_modules" / "step_1") == _files(sync)
    assert [r["step"] for r in rank0["over_budget"]] == [1]
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (sync / name).read_bytes() == (serial / name).read_bytes(), name
    stable = json.loads((background / STABLE).read_text())
    assert stable["step"] == 1 and stable["written_by"] == "vlmcp publish"
    loaded = AutoModelForImageTextToText.from_pretrained(str(background), dtype=torch.float32,
                                                         local_files_only=True).state_dict()
    for key, value in reference.items():
        assert torch.equal(loaded[key], value), key
    if not moe:
        assert "lm_head.weight" not in reference

    # Step 2's optimizer step waited at the fence for the held copy, then changed the weights
    # during the held-back write; the rows came when it completed.
    final = read_hf_weights(tmp_path / "final")
    assert any(not torch.equal(final[k], v) for k, v in reference.items())
    assert rank0["background_check"] == []
    (row,) = rank0["background_close"]
    assert row["step"] == 1 and row["publish_s"] <= row["publish_total_s"]
    assert row["publish_bytes"] == sum(len(b) for b in _files(background).values())
    for result in ranks:  # every rank's optimizer step waited for its own held copy
        (row,) = result["background_close"]
        assert row["publish_fence_wait_s"] >= 0.25 and row["publish_s"] >= 0.25
    assert [r["step"] for r in rank0["serial"] + rank0["sync"]] == [1, 1]

    _assert_same_tensors(final, load_file(tmp_path / "final_rank0" / WEIGHTS_NAME),
                         "final export")
    assert [r["step"] for r in rank0["second_close"]] == [2]
    assert _files(tmp_path / "background" / "step_2") == _files(tmp_path / "sync" / "step_2")
    unfenced = read_hf_weights(tmp_path / "unfenced" / "step_2")
    step_2 = read_hf_weights(tmp_path / "sync" / "step_2")
    assert any(not torch.equal(unfenced[k], v) for k, v in step_2.items()), \
        "a copy the fence does not hold back reads the next step's weights"
    assert len(list((tmp_path / "final").glob("model-*-of-00002.safetensors"))) == 2
    for name in ("config.json", "generation_config.json", "preprocessor_config.json"):
        assert (tmp_path / "final" / name).read_bytes() == \
            (tmp_path / "final_rank0" / name).read_bytes(), name

    for result in ranks:
        assert result["stop_close"] == []
        assert result["after_stop"] == {"step_3": False, "tmp": True, "tmp_stable": False}
        assert result["tmp_after_restart"] is False
    assert [r["step"] for r in rank0["after_stop_close"]] == [3]
    assert _files(tmp_path / "background" / "step_3") == _files(tmp_path / "sync" / "step_3")
