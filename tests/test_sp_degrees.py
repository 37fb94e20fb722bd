"""The degree per micro-batch (`parallel.sp_dynamic`), without processes: the packer's plan and
the job checks. The exactness of a step that runs it is tests/test_train_sgd_step.py's."""

from __future__ import annotations

import random

import pytest

from vlmcp.config import job_from_dict
from vlmcp.data.pack import PackedDataset, Slot, dynamic_slots, rank_budget
from vlmcp.errors import ConfigError

MINIMAL = {"model": {"path": "ckpt"}, "data": {"train": "train.jsonl"}}


def _lengths(seed: int, n: int = 200, limit: int = 1000) -> list[int]:
    """An RL-like mix: mostly short samples, a few up to the limit."""
    rng = random.Random(seed)
    return [min(limit, max(1, int(rng.lognormvariate(4.5, 1.0)))) for _ in range(n)]


@pytest.mark.parametrize("sp_size", [2, 3, 4])
def test_dynamic_slots_hold_every_sample_once_and_degree_one_packs_fit_the_rank_budget(sp_size):
    lengths = _lengths(sp_size)
    slots = dynamic_slots(lengths, 1000, sp_size)
    budget = rank_budget(1000, sp_size)
    samples = [i for slot in slots for pack in slot.packs for i in pack]
    assert sorted(samples) == list(range(len(lengths)))
    for slot in slots:
        sizes = [sum(lengths[i] for i in pack) for pack in slot.packs]
        if slot.degree == 1:
            assert 1 <= len(slot.packs) <= sp_size and max(sizes) <= budget
            assert all(lengths[i] <= budget for pack in slot.packs for i in pack)
        else:
            assert slot.degree is None and len(slot.packs) == 1 and sizes[0] <= 1000
            assert any(lengths[i] > budget for i in slot.packs[0])
    assert {slot.degree for slot in slots} == {None, 1}, "the mix must run at both degrees"
    firsts = [min(min(pack) for pack in slot.packs) for slot in slots]
    assert firsts == sorted(firsts), "slots follow the packing order"


def test_the_plan_is_a_pure_function_of_the_epoch_on_every_rank():
    lengths = _lengths(7, n=60)
    plans = {}
    for dp_rank in range(2):
        for sp_rank in range(2):
            for copy in range(2):
                dataset = PackedDataset(lengths, 1000, dp_rank=dp_rank, dp_size=2, shuffle=True,
                                        seed=3, multiple_of=2, sp_size=2, sp_rank=sp_rank,
                                        sp_dynamic=True)
                plans[dp_rank, sp_rank, copy] = (dataset.slots(1), dataset.rank_slots(1),
                                                 dataset.rank_packs(1))
    assert len({repr(plan[0]) for plan in plans.values()}) == 1, "every rank sees one plan"
    for key, plan in plans.items():
        assert plan == plans[key[0], key[1], 0], "a fresh dataset (a resumed run) plans the same"
    counts = {len(plan[1]) for plan in plans.values()}
    assert len(counts) == 1 and counts.pop() % 2 == 0, "every rank runs the same micro-batches"
    for dp_rank in range(2):
        slots = plans[dp_rank, 0, 0][1]
        assert plans[dp_rank, 1, 0][1] == slots, "an SP group agrees on every slot's degree"
        for slot, pack0, pack1 in zip(slots, plans[dp_rank, 0, 0][2], plans[dp_rank, 1, 0][2]):
            if slot.degree is None:
                assert pack0 == pack1 == list(slot.packs[0])
            else:
                assert pack0 == list(slot.packs[0])
                assert pack1 == list(slot.packs[1 if len(slot.packs) > 1 else 0])


def test_a_short_degree_one_slot_repeats_its_first_pack_at_weight_zero_and_counts_once():
    slot = Slot(((4, 5),), degree=1)
    assert slot.pack_of(0) == ([4, 5], 1.0) and slot.pack_of(1) == ([4, 5], 0.0)
    assert slot.owns(0) and not slot.owns(1)
    full = Slot(((1,), (2,)), degree=1)
    assert full.pack_of(1) == ([2], 1.0) and full.owns(1)
    spread = Slot(((1, 2),))
    assert spread.pack_of(1) == ([1, 2], 1.0) and spread.owns(0) and not spread.owns(1)


def test_without_sp_dynamic_every_pack_is_spread_as_before():
    lengths = _lengths(1, n=40)
    fixed = PackedDataset(lengths, 1000, sp_size=2, sp_rank=1)
    assert [list(slot.packs[0]) for slot in fixed.slots(0)] == fixed.packs(0)
    assert {slot.degree for slot in fixed.slots(0)} == {None}
    assert fixed.rank_packs(0) == PackedDataset(lengths, 1000).rank_packs(0)


def test_validate_refuses_sp_dynamic_without_an_sp_group():
    def problems(raw):
        with pytest.raises(ConfigError) as info:
            job_from_dict(raw)
        return info.value.problems

    (one,) = problems({**MINIMAL, "parallel": {"sp_dynamic": True}})
    assert "'parallel.sp_dynamic'" in one and "'parallel.sp_size' is 1" in one
    rollouts = job_from_dict({"model": {"path": "ckpt"}, "rollouts": {"dir": "r"},
                              "parallel": {"sp_size": 2, "sp_dynamic": True}})
    assert rollouts.parallel.sp_dynamic is True
    job = job_from_dict({**MINIMAL, "parallel": {"sp_size": 2, "sp_dynamic": True}})
    assert job.parallel.sp_dynamic is True
    assert job_from_dict(MINIMAL).parallel.sp_dynamic is False
