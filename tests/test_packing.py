"""Packing: first-fit order, boundaries, shifted targets, pixel order, MRoPE positions, DP split."""

from __future__ import annotations

import pytest
import torch

from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.data.dataset import load_samples
from vlmcp.data.formats import Sample
from vlmcp.data.pack import PackedDataset, first_fit, pack_samples
from vlmcp.data.positions import mrope_positions
from vlmcp.model.tiny import tiny_qwen3_5_config


def _text_sample(length: int, tag: int) -> Sample:
    ids = [100 + (tag * 7 + i) % 300 for i in range(length)]
    ids_t = torch.tensor(ids)
    mm = torch.zeros(length, dtype=torch.long)
    return Sample(input_ids=ids, labels=[IGNORE_INDEX] + ids[1:], image_paths=[],
                  pixel_values=None, image_grid_thw=None, mm_token_type_ids=mm,
                  position_ids=mrope_positions(ids_t, mm, None, 2), source=f"s:{tag}")


def _image_record(images: list[str], answer: str = "7") -> dict:
    markers = "".join("<image>" for _ in images)
    return {"messages": [{"role": "user", "content": f"{markers}What digit is this?"},
                         {"role": "assistant", "content": answer}], "images": images}


@pytest.fixture
def image_samples(make_jsonl, tiny_processor) -> list[Sample]:
    """Samples with 0, 1 and 2 images of different grid sizes."""
    images = {"img/a.png": (64, 32), "img/b.png": (32, 32), "img/c.png": (64, 96)}
    path = make_jsonl([_image_record([]), _image_record(["img/a.png"]),
                       _image_record(["img/b.png", "img/c.png"], "3 and 5")], images)
    return load_samples(path, tiny_processor, max_seq_len=256)


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration(tiny_qwen3_5_config()).eval()


def test_first_fit_puts_each_sample_in_the_first_pack_with_room():
    assert first_fit([6, 6, 3, 4, 2, 1], max_seq_len=10) == [[0, 2, 5], [1, 3], [4]]


def test_first_fit_rejects_a_sample_longer_than_max_seq_len():
    with pytest.raises(ValueError, match="longer than max_seq_len 4"):
        first_fit([3, 5], max_seq_len=4)


def test_packs_hold_whole_samples_in_data_order_within_max_seq_len():
    samples = [_text_sample(n, i) for i, n in enumerate([5, 9, 3, 7, 2, 8, 4])]
    batches = pack_samples(samples, max_seq_len=12)
    assert [b.sample_ids for b in batches] == [["s:0", "s:2", "s:4"], ["s:1"], ["s:3", "s:6"],
                                              ["s:5"]]
    for batch in batches:
        assert batch.num_tokens == sum(batch.seq_lens) <= 12
        expected = [t for sid in batch.sample_ids for t in samples[int(sid[2:])].input_ids]
        assert batch.input_ids.tolist() == expected


def test_targets_never_cross_sample_boundaries():
    samples = [_text_sample(n, i) for i, n in enumerate([5, 4, 6])]
    (batch,) = pack_samples(samples, max_seq_len=32)
    offset = 0
    for sample in samples:
        targets = batch.targets[offset:offset + len(sample)].tolist()
        assert targets[:-1] == sample.labels[1:]
        assert targets[-1] == IGNORE_INDEX
        offset += len(sample)
    assert batch.num_targets == sum(len(s) - 1 for s in samples)


def test_position_ids_restart_at_every_sample(image_samples):
    (batch,) = pack_samples(image_samples, max_seq_len=256)
    starts = [sum(batch.seq_lens[:i]) for i in range(len(batch.seq_lens))]
    assert all(batch.position_ids[:, s].tolist() == [0, 0, 0] for s in starts)
    assert batch.position_ids.shape == (3, batch.num_tokens)


def test_pixel_values_follow_placeholder_order(image_samples, tiny_processor):
    ordered = [image_samples[2], image_samples[0], image_samples[1]]
    (batch,) = pack_samples(ordered, max_seq_len=256)
    assert batch.image_grid_thw.tolist() == [[1, 2, 2], [1, 6, 4], [1, 2, 4]]
    assert batch.pixel_values.equal(torch.cat([ordered[0].pixel_values,
                                               ordered[2].pixel_values]))
    runs = torch.unique_consecutive(batch.input_ids, return_counts=True)
    image_runs = runs[1][runs[0] == tiny_processor.image_token_id].tolist()
    assert image_runs == [tiny_processor.num_placeholders(g) for g in batch.image_grid_thw]
    assert batch.mm_token_type_ids.sum().item() == sum(image_runs)


def test_mrope_positions_equal_model_get_rope_index(image_samples, tiny_model):
    assert [0 if s.image_grid_thw is None else len(s.image_grid_thw) for s in image_samples] == \
        [0, 1, 2]
    for sample in image_samples:
        ids = torch.tensor(sample.input_ids)
        ours = mrope_positions(ids, sample.mm_token_type_ids, sample.image_grid_thw, 2)
        theirs, _ = tiny_model.model.get_rope_index(
            ids[None], sample.mm_token_type_ids[None], image_grid_thw=sample.image_grid_thw)
        assert ours.equal(theirs[:, 0])
        assert sample.position_ids.equal(ours)


def test_packed_positions_equal_model_get_rope_index_per_sample(image_samples, tiny_model):
    (batch,) = pack_samples(image_samples, max_seq_len=256)
    offset = 0
    for sample in image_samples:
        span = slice(offset, offset + len(sample))
        theirs, _ = tiny_model.model.get_rope_index(
            batch.input_ids[None, span], batch.mm_token_type_ids[None, span],
            image_grid_thw=sample.image_grid_thw)
        assert batch.position_ids[:, span].equal(theirs[:, 0])
        offset += len(sample)


def test_mrope_positions_reject_a_run_that_does_not_match_its_grid():
    ids = torch.tensor([1, 5, 5, 2])
    mm = torch.tensor([0, 1, 1, 0])
    with pytest.raises(ValueError, match="needs 1"):
        mrope_positions(ids, mm, torch.tensor([[1, 2, 2]]), 2)


def _dataset(lengths: list[int], **kwargs) -> PackedDataset:
    return PackedDataset(lengths, max_seq_len=10, **kwargs)


def test_every_rank_runs_the_same_number_of_micro_batches_and_wraps_deterministically():
    lengths = [10] * 7  # one sample per pack: 7 packs
    ranks = [_dataset(lengths, dp_rank=r, dp_size=3) for r in range(3)]
    assert [d.num_micro_batches(0) for d in ranks] == [3, 3, 3]
    served = [[pack[0] for pack in d.rank_packs(0)] for d in ranks]
    assert served == [[0, 3, 6], [1, 4, 0], [2, 5, 1]]


def test_micro_batch_count_rounds_up_to_multiple_of():
    dataset = _dataset([10] * 7, dp_rank=1, dp_size=2, multiple_of=3)
    assert dataset.num_micro_batches(0) == 6
    assert len(dataset.rank_packs(0)) == 6


def test_a_weighted_mixture_packs_each_files_draws_by_their_index_in_samples():
    dataset = _dataset([4] * 5, file_sizes=[2, 3], weights=[2.0, 1.0])
    assert dataset.order(0) == [0, 1, 0, 1, 2, 3, 4]
    assert dataset.packs(0) == [[0, 1], [0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="do not describe 5 samples"):
        _dataset([4] * 5, file_sizes=[2, 2])


def test_unshuffled_epochs_pack_in_data_order():
    dataset = _dataset([4, 4, 4, 4, 4])
    assert dataset.packs(0) == dataset.packs(1) == [[0, 1], [2, 3], [4]]


def test_shuffle_is_seeded_same_on_every_rank_and_new_each_epoch():
    lengths = [3, 5, 2, 7, 4, 6, 1, 8, 2, 3, 5, 4]
    a = _dataset(lengths, dp_rank=0, dp_size=2, shuffle=True, seed=1)
    b = _dataset(lengths, dp_rank=1, dp_size=2, shuffle=True, seed=1)
    assert a.packs(0) == b.packs(0)
    assert a.packs(1) == b.packs(1)
    assert a.order(0) != a.order(1)
    assert sorted(a.order(1)) == list(range(len(lengths)))
    assert _dataset(lengths, shuffle=True, seed=2).order(0) != a.order(0)
    covered = sorted(i for pack in a.packs(0) for i in pack)
    assert covered == list(range(len(lengths)))
