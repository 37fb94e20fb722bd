"""A rollout step in one process (no process group: every agreement is the identity): its counts
and sample names come from the length index and equal those of its loaded packs; its packs stream
(none loads before the step iterates them); rank 0's index turns any exception into the step's
error line (a meta.json with an integer Python cannot read) or, for a record, into a bad sample
that `on_bad_sample: "skip"` drops; a policy_step ahead of the step is refused, naming meta.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.images import save_png
from tests.helpers.launching import tiny_job
from vlmcp.config import LossTerm, job_from_dict
from vlmcp.data.index import build_index
from vlmcp.data.pack import first_fit
from vlmcp.data.rollouts import STABLE, step_dir
from vlmcp.data.stream import SampleReader
from vlmcp.errors import DataError, RolloutError
from vlmcp.model.loss_terms import Loss
from vlmcp.parallel.groups import SequenceParallel
from vlmcp.training.objective_step import index_counts, pack_counts, weight_arrays
from vlmcp.training.steps.rollout_steps import RolloutSteps

IDS = [1, 10, 11, 12, 13, 2]
LABELS = [-100, -100, 11, 12, 13, 2]
PROMPT = [{"role": "user", "content": "<image>What digit is this?"}]


def _tokens(**arrays) -> dict:
    return {"input_ids": IDS, "labels": LABELS, "advantages": [None, None, 1, -1, 0.5, 2],
            **arrays}


def _pair(chosen: str, rejected: str) -> dict:
    return {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}], "images": ["img/a.png"],
            "ref_chosen_logp": -3.0, "ref_rejected_logp": -4.0}


@pytest.mark.parametrize("objective,records,pack_len", [
    (Loss((LossTerm("policy_gradient", weights="loss_weights"),
           LossTerm("ce", normalize="sequence", weights="sft_weights", coef=0.5),
           LossTerm("ce", normalize="sequence"))),
     [_tokens(loss_weights=[None, None, 1, 0, 1e-50, 2], sft_weights=[None, None, 0, 0, 0, 0],
              inference_logprobs=[None, None, -1, -2, -3, -4]),
      _tokens(loss_weights=[None, None, 1, 1, 1, 1], sft_weights=[None, None, 0, 1, 0, 0]),
      _tokens(loss_weights=[None, None, 0, 0, 0, 3], sft_weights=[None, None, 1, 1, 1, 1],
              inference_logprobs=[None, None, -1, -1, -1, -1])], 12),
    (Loss((LossTerm("dpo"),)), [_pair("7", "1"), _pair("3", "8 or 9"), _pair("0", "6")], 80),
])
def test_a_steps_counts_from_the_index_equal_those_of_its_loaded_packs(
        objective, records, pack_len, tiny_processor, tmp_path):
    save_png(tmp_path / "img" / "a.png", 32, 32)
    path = tmp_path / "step.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n"
                            for r in records))
    names = ("loss_weights", "advantages", "inference_logprobs", "sft_weights")
    index, problems = build_index([path], tiny_processor, pack_len, array_names=names,
                                  count_nonzero=weight_arrays(objective))
    assert problems == [] and len(index) == len(records)
    reader = SampleReader(index, tiny_processor, pack_len, False)
    packs = first_fit(index.tokens.tolist(), pack_len)
    assert len(packs) > 1
    loaded = [reader.pack(pack) for pack in packs]
    rows = [row for pack in packs for row in pack]
    assert index_counts(objective, index, rows) == pack_counts(objective, loaded)
    assert index_counts(objective, index, packs[0]) == pack_counts(objective, loaded[:1])


def _job(checkpoint: Path, rollouts: Path, max_seq_len: int = 6, loss: str = "policy_gradient",
         **rollout_keys):
    raw = tiny_job(checkpoint, Path("unused"), rollouts.parent / "out",
                   data={"max_seq_len": max_seq_len, "num_workers": 0},
                   loss={"type": loss},
                   rollouts={"dir": str(rollouts), **rollout_keys})
    del raw["data"]["train"]
    return job_from_dict(raw)


def _step(rollouts: Path, number: int, lines: list[str], meta: str | None = None) -> Path:
    path = step_dir(rollouts, number)
    path.mkdir(parents=True, exist_ok=True)
    (path / "rollouts.jsonl").write_text("".join(line + "\n" for line in lines))
    if meta is not None:
        (path / "meta.json").write_text(meta)
    (path / STABLE).write_text("")
    return path


def _image_line(name: str) -> str:
    return json.dumps({"messages": [PROMPT[0], {"role": "assistant", "content": "7"}],
                       "images": [name]})


def test_a_rollout_steps_packs_stream_with_counts_and_names_before_any_pack_loads(
        tiny_checkpoint, tiny_processor, tmp_path):
    rollouts = tmp_path / "rollouts"
    path = _step(rollouts, 1, [json.dumps(_tokens()) for _ in range(4)])
    steps = RolloutSteps(_job(tiny_checkpoint, rollouts, 19, "ce"), tiny_processor,
                         SequenceParallel.single())
    fetched = steps.step_batches(0)
    assert fetched.weights == [1.0] * 2 and fetched.micro_batches == 2
    assert fetched.counts["targets"] == 4 * 4 and fetched.counts["seqs0"] == 4
    data = path / "rollouts.jsonl"
    assert fetched.sample_ids == [[f"{data}:1", f"{data}:2", f"{data}:3"], [f"{data}:4"]]
    first = next(fetched.batches)
    assert first.sample_ids == fetched.sample_ids[0] and first.num_targets == 3 * 4
    assert steps.step_batches(0) is fetched  # asked again (a non-finite abort): the same step

    # a pack that fails loads only when the step reaches it: the packs before it train
    for k in range(3):
        save_png(step_dir(rollouts, 2) / f"img{k}.png", 32, 32, seed=k)
    path = _step(rollouts, 2, [_image_line(f"img{k}.png") for k in range(3)])
    fetched = steps.step_batches(1)
    assert len(fetched.weights) == 3
    (path / "img2.png").write_bytes((path / "img2.png").read_bytes()[:40])
    assert [b.sample_ids for b in (next(fetched.batches), next(fetched.batches))] == \
        fetched.sample_ids[:2]
    with pytest.raises(DataError, match=r"rollouts.jsonl:3"):
        next(fetched.batches)


def test_a_dp_ranks_share_of_a_step_counts_only_its_own_packs(tiny_checkpoint, tiny_processor,
                                                              tmp_path):
    rollouts = tmp_path / "rollouts"
    _step(rollouts, 1, [json.dumps(_tokens()) for _ in range(3)])
    shares = []
    for dp_rank in (0, 1):
        sp = SequenceParallel(size=1, rank=0, group=None, dp_size=2, dp_rank=dp_rank, mpu=None)
        shares.append(RolloutSteps(_job(tiny_checkpoint, rollouts), tiny_processor,
                                   sp).step_batches(0))
    assert [s.weights for s in shares] == [[1.0, 1.0], [1.0, 0.0]]
    assert [s.counts["targets"] for s in shares] == [8, 4]
    assert all(s.micro_batches == 3 for s in shares)


def test_rank_0s_index_turns_any_exception_into_the_steps_error_or_a_skipped_sample(
        tiny_checkpoint, tiny_processor, tmp_path):
    rollouts = tmp_path / "rollouts"
    huge = "9" * 400  # a finite JSON integer too large for a float (OverflowError)
    good = json.dumps(_tokens())
    _step(rollouts, 1, [good, good.replace('"advantages": [null, null, 1,',
                                           f'"advantages": [null, null, {huge},'), good])
    path = _step(rollouts, 2, [good], meta='{"policy_step": 0, "note": ' + "7" * 5000 + "}")
    steps = RolloutSteps(_job(tiny_checkpoint, rollouts, on_bad_sample="skip"), tiny_processor,
                         SequenceParallel.single())
    fetched = steps.step_batches(0)
    assert fetched.row["rollout_samples"] == 2 and fetched.row["rollout_skipped_samples"] == 1
    with pytest.raises(RolloutError) as info:
        steps.step_batches(1)
    assert len(info.value.problems) == 1 and str(path) in info.value.problems[0]


def test_a_policy_step_ahead_of_the_step_is_refused_naming_meta_json(
        tiny_checkpoint, tiny_processor, tmp_path):
    rollouts = tmp_path / "rollouts"
    _step(rollouts, 1, [json.dumps(_tokens())], meta='{"policy_step": 0}')
    path = _step(rollouts, 2, [json.dumps(_tokens())], meta='{"policy_step": 2}')
    steps = RolloutSteps(_job(tiny_checkpoint, rollouts), tiny_processor, SequenceParallel.single())
    assert steps.step_batches(0).row["policy_lag"] == 0
    with pytest.raises(RolloutError) as info:
        steps.step_batches(1)
    assert info.value.problems == [
        f"{path / 'meta.json'}: policy_step 2, newer than the weights of step 1, which train "
        "step 2 (policy lag -1): a producer bug, or another run's rollouts.dir"]
