"""What a resume at another layout keeps, and what it refuses before any rank loads anything.

The data position follows the global batch: a step trains the same samples whatever the split of
the global batch into data-parallel ranks and train.grad_accum (`vlmcp.data.pack`). A resume that
would change which samples a step trains (the global batch, data.max_seq_len, data.shuffle,
data.train's samples, parallel.sp_dynamic, parallel.sp_size under sp_dynamic, train.seed with
shuffle), or which parameters train, or that DeepSpeed's universal checkpoint cannot convert
(ZeRO 0 in fp32 and another stage), is one `error:` line naming the key; what is allowed is
logged (a renamed data.train with the same samples, train.seed without shuffle). The
checkpoints are manifests written as a save writes them (training/layout.py), checked by the
preflight every rank and `vlmcp validate` run; the universal checkpoint's two forms of the
routed experts are one another's exact rearrangement.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.launching import tiny_job, vlmcp_frames, write_job
from vlmcp.cli import main
from vlmcp.config import load_job
from vlmcp.data.pack import PackedDataset
from vlmcp.training.layout import checkpoint_record, data_of, legacy_layout
from vlmcp.training.preflight import run_preflight
from vlmcp.training.weights.universal import AUTOEP, FUSED, expert_form_of, set_expert_form


def _job(checkpoint: Path, digits: Path, out: Path, **sections) -> dict:
    base = {"data": {"max_seq_len": 64, "shuffle": True},
            "deepspeed": {"zero_optimization": {"stage": 2}},
            "train": {"seed": 3, "grad_accum": 2}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return tiny_job(checkpoint, digits / "train.jsonl", out, **base)


def _save_manifest(job: dict, world: int, path: Path) -> None:
    """The manifest a save of `job` over `world` ranks after 2 steps writes (no DeepSpeed files)."""
    loaded = load_job(write_job(path.parent / "saved.json", job), [])
    report = run_preflight(loaded, world)
    assert report.problems == []
    index = report.train_index
    data = data_of(loaded, world, None if index is None else index.tokens,
                   report.train_file_sizes, report.train_weights)
    record = checkpoint_record(loaded, world, report.ds_config, data)
    tag = Path(job["output_dir"]) / "checkpoints" / "step2"
    tag.mkdir(parents=True)
    (tag / "manifest.json").write_text(json.dumps(
        {"step": 2, "ep_size": record["layout"]["ep_size"], **record, "files": {}}))
    (tag.parent / "latest").write_text("step2")


@pytest.fixture
def saved(tiny_checkpoint, digits_jsonl, tmp_path) -> tuple[dict, Path]:
    """A checkpoint of SP 2 over world 4 (DP 2) with grad_accum 2: global batch 4."""
    job = _job(tiny_checkpoint, digits_jsonl, tmp_path / "out", parallel={"sp_size": 2})
    _save_manifest(job, 4, tmp_path / "saved.json")
    return job, tmp_path


def _problems(job: dict, world: int, tmp: Path, *overrides: str) -> list[str]:
    loaded = load_job(write_job(tmp / "resume.json", {**job, "train": {**job["train"],
                                                                        "resume": True}}),
                      list(overrides))
    return run_preflight(loaded, world).problems


#: A changed key: (world size, --set overrides, what its one line says).
REFUSED = {
    "train.grad_accum": (4, ["train.grad_accum=1"],
                         "the global batch would be 2 (data-parallel size 2 x train.grad_accum 1)"
                         ", but checkpoint"),
    "data.max_seq_len": (4, ["data.max_seq_len=96"], "another packing of the epoch"),
    "data.shuffle": (4, ["data.shuffle=false"], "another sample order"),
    "parallel.sp_dynamic": (4, ["parallel.sp_dynamic=true"], "another slot plan"),
    "train.seed": (4, ["train.seed=4"], "every epoch's order comes from it"),
    "lora.r": (4, ["lora.r=4"], "its optimizer state is that of other parameters"),
    "model.freeze_vision": (4, ["model.freeze_vision=false"],
                            "its optimizer state is that of other parameters"),
    "deepspeed.zero_optimization.stage": (4, ["deepspeed.zero_optimization.stage=0"],
                                          "does not convert between ZeRO 0 in fp32"),
}


@pytest.mark.parametrize("key", list(REFUSED))
def test_a_resume_that_changes_a_refused_key_is_one_line_naming_it(key, saved):
    job, tmp = saved
    world, overrides, says = REFUSED[key]
    problems = _problems(job, world, tmp, *overrides)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"config key '{key}'") and says in problems[0], problems


def test_the_global_batch_refusal_names_the_grad_accum_that_keeps_it(saved):
    """World 4 (DP 2 x accum 2) resumed at world 2 SP 2 (DP 1): grad_accum 4 keeps the batch."""
    job, tmp = saved
    (problem,) = _problems(job, 2, tmp)
    assert "set train.grad_accum=4 to keep it" in problem
    assert _problems(job, 2, tmp, "train.grad_accum=4") == []


def test_sp_size_with_sp_dynamic_on_both_sides_is_refused(tiny_checkpoint, digits_jsonl, tmp_path):
    job = _job(tiny_checkpoint, digits_jsonl, tmp_path / "out",
               parallel={"sp_size": 2, "sp_dynamic": True})
    _save_manifest(job, 2, tmp_path / "saved.json")
    (problem,) = _problems(job, 4, tmp_path, "parallel.sp_size=4", "train.grad_accum=2")
    assert problem.startswith("config key 'parallel.sp_size': 4 with parallel.sp_dynamic")


def test_a_resume_at_another_layout_with_the_same_data_position_passes_and_says_how(
        saved, capsys):
    """World 4 -> world 1 at grad_accum 4 (the same global batch), ZeRO 3, data.train renamed
    (the same samples) and no shuffle change: `vlmcp validate` passes and says what the resume
    does."""
    job, tmp = saved
    renamed = tmp / "renamed.jsonl"
    shutil.copy(job["data"]["train"], renamed)
    for image in (Path(job["data"]["train"]).parent / "images").iterdir():
        (tmp / "images").mkdir(exist_ok=True)
        shutil.copy(image, tmp / "images" / image.name)
    path = write_job(tmp / "resume.json", {**job, "train": {**job["train"], "resume": True}})
    assert main(["validate", str(path), "--world-size", "1", "--set", "train.grad_accum=4",
                 "--set", "parallel.sp_size=1", "--set", "deepspeed.zero_optimization.stage=3",
                 "--set", f"data.train={renamed}"]) == 0
    out = capsys.readouterr().out
    assert "through DeepSpeed's universal checkpoint" in out
    assert f"data.train names {renamed}" in out


def test_a_refusal_from_vlmcp_validate_is_one_error_line_without_a_traceback(saved, capsys):
    job, tmp = saved
    path = write_job(tmp / "resume.json", {**job, "train": {**job["train"], "resume": True}})
    assert main(["validate", str(path), "--world-size", "4", "--set",
                 "parallel.sp_dynamic=true"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "config key 'parallel.sp_dynamic'" in lines[0]
    assert vlmcp_frames(err) == [] and "Traceback" not in err


def test_a_checkpoint_saved_without_a_record_is_read_from_its_file_names(tmp_path):
    for name in ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"):
        (tmp_path / name).write_bytes(b"")
    layout = legacy_layout(tmp_path, ep_size=2)
    assert (layout["world_size"], layout["zero_stage"], layout["precision"], layout["ep_size"]) \
        == (2, 2, "bf16", 2)


@pytest.mark.parametrize("global_batch", [4, 6])
def test_a_step_trains_the_same_samples_whatever_the_split_of_the_global_batch(global_batch):
    """Optimizer step k trains the slots [k G, (k+1) G) of its epoch (wrapping at the epoch's
    end), whether G is dealt to G data-parallel ranks, accumulated G times on one, or between;
    epochs of several lengths, with and without SP's degree plan."""
    lengths = [int(n) for n in torch.randint(4, 60, (53,), generator=torch.Generator().manual_seed(1))]
    for sp_size, dynamic in ((1, False), (2, True)):
        trained = []
        for dp in (d for d in range(1, global_batch + 1) if global_batch % d == 0):
            accum = global_batch // dp
            ranks = [PackedDataset(lengths, 64, dp_rank=r, dp_size=dp, shuffle=True, seed=5,
                                   multiple_of=accum, sp_size=sp_size, sp_dynamic=dynamic)
                     for r in range(dp)]
            steps = []
            for epoch in range(3):
                slots = [rank.rank_slots(epoch) for rank in ranks]
                for step in range(len(slots[0]) // accum):
                    steps.append(sorted(slot.packs for rank_slots in slots
                                        for slot in rank_slots[step * accum:(step + 1) * accum]))
            n = len(ranks[0].slots(0))
            assert len(steps) >= 3 * math.ceil(n / global_batch) - 3
            trained.append(steps)
        assert all(steps == trained[0] for steps in trained[1:]), (sp_size, dynamic)


def _folder(zero: Path, name: str, value: torch.Tensor, expert: int | None = None) -> None:
    folder = zero / name
    folder.mkdir(parents=True)
    for key, scale in (("fp32", 1.0), ("exp_avg", 0.5), ("exp_avg_sq", 0.25)):
        marks = {} if expert is None else {"is_expert_param": True, "ep_num_experts": expert}
        torch.save({"param": value * scale, **marks}, folder / f"{key}.pt")
    torch.save(torch.tensor(2.0), folder / "step.pt")


def test_the_universal_checkpoints_two_forms_of_the_routed_experts_are_rearrangements(tmp_path):
    """AutoEP's w1/w2/w3, router and shared expert, and vlmcp's per-expert LoRA factors, to
    transformers' fused experts and PEFT's factors and back: every state of every tensor where it
    belongs (gate rows first in gate_up_proj; PEFT's A rows e*r.., B columns j*E+e)."""
    experts, inter, hidden, r = 4, 3, 5, 2
    gen = torch.Generator().manual_seed(0)
    zero = tmp_path / "zero"
    m = "language_model.layers.0.mlp"
    w = {k: torch.randn(experts, *shape, generator=gen)
         for k, shape in (("w1", (inter, hidden)), ("w2", (hidden, inter)), ("w3", (inter, hidden)))}
    for k, value in w.items():
        _folder(zero, f"{m}.experts.{k}", value, experts)
    _folder(zero, f"{m}.router.gate.weight", torch.randn(experts, hidden, generator=gen))
    _folder(zero, f"{m}.shared_experts.up_proj.weight", torch.randn(inter, hidden, generator=gen))
    _folder(zero, f"{m}.shared_experts_gate.weight", torch.randn(1, hidden, generator=gen))
    lora_a = torch.randn(experts, r, hidden, generator=gen)
    lora_b = torch.randn(experts, 2 * inter, r, generator=gen)
    _folder(zero, f"{m}.experts.lora_A_gate_up_proj", lora_a, experts)
    _folder(zero, f"{m}.experts.lora_B_gate_up_proj", lora_b, experts)
    adapters = {f"{m}.experts": [{"parameter": "gate_up_proj", "peft_name": f"{m}.experts",
                                  "adapter": "default", "num_experts": experts}]}
    before = {p.name: torch.load(p / "exp_avg.pt")["param"] for p in zero.iterdir()}
    assert set_expert_form(zero, FUSED, adapters) == FUSED
    fused = {p.name: torch.load(p / "exp_avg.pt")["param"] for p in zero.iterdir()}
    assert torch.equal(fused[f"{m}.experts.gate_up_proj"], 0.5 * torch.cat([w["w1"], w["w3"]], 1))
    assert torch.equal(fused[f"{m}.experts.down_proj"], 0.5 * w["w2"])
    assert f"{m}.gate.weight" in fused and f"{m}.shared_expert_gate.weight" in fused
    peft_a, peft_b = fused[f"{m}.experts.lora_A.default.weight"], fused[f"{m}.experts.lora_B.default.weight"]
    assert torch.equal(peft_a[2 * r:3 * r], 0.5 * lora_a[2])
    assert torch.equal(peft_b[:, 1 * experts + 2], 0.5 * lora_b[2][:, 1])
    assert expert_form_of(zero, adapters) == FUSED
    assert set_expert_form(zero, AUTOEP, adapters) == AUTOEP
    after = {p.name: torch.load(p / "exp_avg.pt")["param"] for p in zero.iterdir()}
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert torch.load(zero / f"{m}.experts.w1" / "fp32.pt")["ep_num_experts"] == experts
