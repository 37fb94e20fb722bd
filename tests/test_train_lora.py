"""LoRA through `vlmcp train` (torchrun, 2 ranks, SP 2, ZeRO-3, fp32, AdamW):

* OUTPUT_DIR/final is a PEFT adapter that `PeftModel.from_pretrained` loads onto the plain
  transformers model, and that model's eval loss (each sample alone) equals vlmcp's eval_loss
  (rel 1e-5 of it in float64, `assert_within_fp32_error`);
* a run resumed from its step-1 checkpoint (adapter and AdamW state, no frozen base weights)
  ends with the same losses and the same adapter as the unbroken run;
* `vlmcp export` writes the checkpoint's adapter, and `vlmcp export --merge` a merged HF model
  with the same eval loss;
* LoRA targets that match no module are one clear error from `vlmcp validate`.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import Qwen3_5ForConditionalGeneration

from tests.helpers.launching import assert_ok, run_vlmcp, tiny_job, train_losses, write_job
from tests.helpers.parity import assert_within_fp32_error, float64_reference, plain_sample_loss
from vlmcp.cli import main
from vlmcp.data.dataset import load_samples
from vlmcp.data.processor import load_processor

TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj", "k_proj",
           "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _job(checkpoint, digits, out, **train):
    return tiny_job(checkpoint, digits / "train.jsonl", out,
                    data={"max_seq_len": 64, "eval": str(digits / "eval.jsonl")},
                    optimizer={"type": "adamw", "lr": 1e-2},
                    parallel={"sp_size": 2},
                    deepspeed={"zero_optimization": {"stage": 3}},
                    lora={"r": 4, "alpha": 8, "target_modules": TARGETS},
                    train={"max_steps": 2, "eval_every": 2, "save_every": 1, **train})


def _eval_loss(model, samples) -> float:
    """sum CE / N of a plain transformers (or PEFT) model over `samples`, each forwarded alone."""
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            loss, n = plain_sample_loss(model, s)
            total += float(loss) * n
            count += n
    return total / count


def _plain(checkpoint):
    return Qwen3_5ForConditionalGeneration.from_pretrained(
        str(checkpoint), dtype=torch.float32, attn_implementation="sdpa").eval()


def _eval_row(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "eval_loss" in row][-1]


@pytest.mark.e2e
def test_lora_final_adapter_loads_in_peft_resumes_exactly_and_exports_merged(
        tiny_checkpoint, digits_jsonl, tmp_path):
    straight = tmp_path / "straight"
    job = write_job(tmp_path / "straight.json", _job(tiny_checkpoint, digits_jsonl, straight))
    assert_ok(run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2))
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert all(row["model_tflops"] > 0 and row["mfu"] > 0 for row in rows if "loss" in row)

    final = straight / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_checkpoint.absolute())
    adapter = load_file(final / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert not any("visual" in k or "lm_head" in k for k in adapter)
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if ".lora_B." in k)

    processor = load_processor(tiny_checkpoint)
    samples = load_samples(digits_jsonl / "eval.jsonl", processor, max_seq_len=64)
    peft_model = PeftModel.from_pretrained(_plain(tiny_checkpoint), str(final)).eval()
    vlmcp_eval = _eval_row(straight)
    assert vlmcp_eval["step"] == 2
    peft_loss, exact_loss = _eval_loss(peft_model, samples), float64_reference(_eval_loss, peft_model, samples)
    assert_within_fp32_error(vlmcp_eval["eval_loss"], peft_loss, exact_loss, at_least=1e-5, name="eval loss")
    assert _eval_loss(_plain(tiny_checkpoint), samples) != pytest.approx(vlmcp_eval["eval_loss"],
                                                                        rel=1e-3)

    # The checkpoints hold the adapters and their optimizer state, not the frozen base weights.
    step1 = straight / "checkpoints" / "step1"
    checkpoint_bytes = sum(p.stat().st_size for p in step1.rglob("*") if p.is_file())
    assert checkpoint_bytes < (tiny_checkpoint / "model.safetensors").stat().st_size / 2

    # Resume from the step-1 checkpoint in a fresh output_dir.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints", resumed / "checkpoints")
    shutil.rmtree(resumed / "checkpoints" / "step2")
    (resumed / "checkpoints" / "latest").write_text("step1")
    job = write_job(tmp_path / "resumed.json", _job(tiny_checkpoint, digits_jsonl, resumed,
                                                    resume=True))
    result = run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2)
    assert_ok(result)
    assert "resumed from" in result.stderr
    assert train_losses(resumed) == pytest.approx(train_losses(straight)[1:], rel=1e-6)
    resumed_adapter = load_file(resumed / "final" / "adapter_model.safetensors")
    assert resumed_adapter.keys() == adapter.keys()
    for key, value in adapter.items():
        torch.testing.assert_close(resumed_adapter[key], value, rtol=1e-6, atol=1e-7)

    exported = tmp_path / "exported"
    assert main(["export", str(job), "--tag", "step2", "--out", str(exported)]) == 0
    exported_adapter = load_file(exported / "adapter_model.safetensors")
    assert exported_adapter.keys() == adapter.keys()
    for key, value in adapter.items():
        torch.testing.assert_close(exported_adapter[key], value, rtol=1e-6, atol=1e-7)

    merged = tmp_path / "merged"
    assert main(["export", str(job), "--tag", "step2", "--out", str(merged), "--merge"]) == 0
    merged_model = Qwen3_5ForConditionalGeneration.from_pretrained(
        str(merged), dtype=torch.float32, attn_implementation="sdpa").eval()
    assert not any("lora" in k for k in merged_model.state_dict())
    assert_within_fp32_error(_eval_loss(merged_model, samples), peft_loss, exact_loss, at_least=1e-5,
                             name="merged eval loss")


def test_lora_targets_matching_no_module_are_one_clear_error(tiny_checkpoint, digits_jsonl,
                                                             tmp_path, capsys):
    job = tiny_job(tiny_checkpoint, digits_jsonl / "train.jsonl", tmp_path / "out",
                   lora={"r": 4, "target_modules": ["q_proj", "qkv_projection"]})
    path = write_job(tmp_path / "job.json", job)
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "config key 'lora.target_modules': 'qkv_projection' matches no module" in err
    assert err.count("error:") == 1


def test_lora_modules_to_save_under_zero3_is_one_clear_error(tiny_checkpoint, digits_jsonl,
                                                              tmp_path, capsys):
    job = tiny_job(tiny_checkpoint, digits_jsonl / "train.jsonl", tmp_path / "out",
                   deepspeed={"zero_optimization": {"stage": 3}},
                   lora={"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["norm"]})
    path = write_job(tmp_path / "job.json", job)
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "config key 'lora.modules_to_save' is not supported with ZeRO-3" in err
    assert err.count("error:") == 1
