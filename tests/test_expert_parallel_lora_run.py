"""`vlmcp train` with LoRA on the routed experts under expert parallelism (`parallel.ep_size` 2
on the SP group of 2, world 2, ZeRO 2, the tiny MoE model, AdamW): each rank trains its experts'
adapter pairs, and the run trains as the same job without EP does (losses to fp32 rounding, the
final PEFT adapter, every expert's pairs in PEFT's own layout, too); the published adapter of the
last step is the final one; SIGTERM then resume at the same E is bit-exact; `vlmcp export` of the
last checkpoint writes the final adapter again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

from tests.helpers.launching import (assert_ok, run_vlmcp, tiny_job, train_losses,
                                     stop_by_sigterm_then_resume, write_job)

pytestmark = pytest.mark.e2e

STEPS = 4
ADAPTER = "adapter_model.safetensors"


def _job(checkpoint: Path, digits: Path, out: Path, *, ep: int = 2) -> dict:
    return tiny_job(checkpoint, digits / "train.jsonl", out, parallel={"sp_size": 2, "ep_size": ep},
                    data={"max_seq_len": 64, "shuffle": True},
                    deepspeed={"zero_optimization": {"stage": 2}},
                    lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "down_proj"],
                          "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
                    publish={"dir": str(out / "weights"), "every": 2},
                    train={"max_steps": STEPS, "save_every": 2, "seed": 3, "grad_accum": 2})


def _train(job: dict, path: Path, *extra: str) -> Path:
    assert_ok(run_vlmcp(["train", str(write_job(path, job)), *extra], launcher="torchrun", nproc=2))
    return Path(job["output_dir"])


def _adapter(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / ADAPTER)


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.fixture(scope="module")
def lora_ep_run(tiny_moe_checkpoint, digits_jsonl, tmp_path_factory) -> Path:
    """The LoRA job at SP 2 and EP 2, four steps straight."""
    root = tmp_path_factory.mktemp("lora_ep_run")
    return _train(_job(tiny_moe_checkpoint, digits_jsonl, root / "out"), root / "job.json")


def test_a_lora_ep_run_trains_the_experts_adapters_as_without_ep_and_writes_peft_files(
        lora_ep_run, tiny_moe_checkpoint, digits_jsonl, tmp_path):
    plain = _train(_job(tiny_moe_checkpoint, digits_jsonl, tmp_path / "plain", ep=1),
                   tmp_path / "plain.json")
    assert train_losses(lora_ep_run) == pytest.approx(train_losses(plain), rel=1e-5)
    final, reference = _adapter(lora_ep_run / "final"), _adapter(plain / "final")
    assert final.keys() == reference.keys()
    assert any(".mlp.experts.lora_A." in key for key in final)
    for key, value in final.items():
        torch.testing.assert_close(value, reference[key], rtol=1e-4, atol=1e-5, msg=key)
    base = Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_moe_checkpoint, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, lora_ep_run / "final")
    expert_a = next(p for n, p in loaded.named_parameters() if ".mlp.experts." in n and "lora_A" in n)
    assert expert_a.abs().sum() > 0
    _assert_equal(_adapter(lora_ep_run / "weights" / f"step_{STEPS}"), final)
    exported = tmp_path / "exported"
    assert_ok(run_vlmcp(["export", str(lora_ep_run.parent / "job.json"), "--tag", f"step{STEPS}",
                         "--out", str(exported)]))
    _assert_equal(_adapter(exported), final)


def test_sigterm_then_resume_of_a_lora_ep_run_is_bit_exact(
        lora_ep_run, tiny_moe_checkpoint, digits_jsonl, tmp_path):
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.json", _job(tiny_moe_checkpoint, digits_jsonl, out))
    stop_by_sigterm_then_resume(job, out, tmp_path / "log")
    assert train_losses(out) == train_losses(lora_ep_run)
    _assert_equal(_adapter(out / "final"), _adapter(lora_ep_run / "final"))
