"""Preference pairs: TRL's conversational pairs (explicit and implicit prompt), LLaMA-Factory's
ShareGPT ranking format and token-format pairs become two samples that share their prompt tokens
and images, with the completions as targets; a pair is one row of the length index, so both
halves land in one pack, which holds the prompt's images once; each bad pair is one DataError
naming its file:line."""

from __future__ import annotations

import math

import pytest
import torch

from vlmcp.data.batch import IGNORE_INDEX, PAIR_VALUES, REF_LOGP
from vlmcp.data.dataset import load_samples
from vlmcp.data.index import build_index
from vlmcp.data.pack import build_batch, first_fit
from vlmcp.data.stream import SampleReader
from vlmcp.errors import DataError

IMAGES = {"img/a.png": (32, 32)}
PROMPT = [{"role": "user", "content": "<image>What digit is this?"}]


def _trl(chosen: str = "7", rejected: str = "1", **extra) -> dict:
    return {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}], "images": ["img/a.png"],
            **extra}


def _targets(sample) -> list[int]:
    return [label for label in sample.labels if label != IGNORE_INDEX]


def _prompt(sample) -> list[int]:
    first = next(t for t, label in enumerate(sample.labels) if label != IGNORE_INDEX)
    return sample.input_ids[:first]


def test_trl_pair_halves_share_prompt_tokens_and_images_and_target_only_the_completion(
        make_jsonl, tiny_processor):
    chosen, rejected = load_samples(make_jsonl([_trl()], IMAGES), tiny_processor, 256)
    tok = tiny_processor.tokenizer
    assert (chosen.pair, rejected.pair) == ("chosen", "rejected")
    assert _prompt(chosen) == _prompt(rejected)
    assert _targets(chosen) == tok("7<|im_end|>", add_special_tokens=False)["input_ids"]
    assert _targets(rejected) == tok("1<|im_end|>", add_special_tokens=False)["input_ids"]
    assert chosen.pixel_values.data_ptr() == rejected.pixel_values.data_ptr()  # decoded once
    assert chosen.source == rejected.source and chosen.source.endswith("data.jsonl:1")


def test_implicit_prompt_sharegpt_ranking_and_explicit_trl_pairs_tokenize_alike(make_jsonl,
                                                                                tiny_processor):
    implicit = {"chosen": PROMPT + [{"role": "assistant", "content": "7"}],
                "rejected": PROMPT + [{"role": "assistant", "content": "1"}],
                "images": ["img/a.png"]}
    sharegpt = {"conversations": [{"from": "human", "value": "<image>What digit is this?"}],
                "chosen": {"from": "gpt", "value": "7"}, "rejected": {"from": "gpt", "value": "1"},
                "images": ["img/a.png"]}
    path = make_jsonl([_trl(), implicit, sharegpt], IMAGES)
    samples = load_samples(path, tiny_processor, 256)
    explicit = samples[:2]
    for other in (samples[2:4], samples[4:6]):
        assert [s.input_ids for s in other] == [s.input_ids for s in explicit]
        assert [s.labels for s in other] == [s.labels for s in explicit]


def test_prompt_assistant_turns_are_not_targets_of_a_multi_turn_pair(make_jsonl, tiny_processor):
    prompt = PROMPT + [{"role": "assistant", "content": "7"},
                       {"role": "user", "content": "Are you sure?"}]
    record = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "Yes"}],
              "rejected": [{"role": "assistant", "content": "No"}], "images": ["img/a.png"]}
    chosen, _ = load_samples(make_jsonl([record], IMAGES), tiny_processor, 256)
    tok = tiny_processor.tokenizer
    assert _targets(chosen) == tok("Yes<|im_end|>", add_special_tokens=False)["input_ids"]


def test_token_pair_targets_every_completion_token_and_carries_reference_sums(make_jsonl,
                                                                              tiny_processor):
    record = {"prompt_input_ids": [1, 10, 11], "chosen_input_ids": [12, 13, 2],
              "rejected_input_ids": [14, 2], "ref_chosen_logp": -3.5, "ref_rejected_logp": -2.0}
    chosen, rejected = load_samples(make_jsonl([record]), tiny_processor, 64)
    assert chosen.input_ids == [1, 10, 11, 12, 13, 2] and _targets(chosen) == [12, 13, 2]
    assert rejected.input_ids == [1, 10, 11, 14, 2] and _targets(rejected) == [14, 2]
    assert (chosen.values[REF_LOGP], rejected.values[REF_LOGP]) == (-3.5, -2.0)


def test_a_pair_is_one_index_row_packed_whole_with_its_image_held_once(make_jsonl, tiny_processor):
    single = {"messages": PROMPT + [{"role": "assistant", "content": "3"}], "images": ["img/a.png"]}
    path = make_jsonl([single, _trl(), _trl("4", "5", ref_chosen_logp=-1.0,
                                            ref_rejected_logp=-2.0)], IMAGES)
    index, problems = build_index([path], tiny_processor, 256)
    assert not problems
    samples = load_samples(path, tiny_processor, 256)
    assert index.chosen_tokens.tolist() == [0, len(samples[1]), len(samples[3])]
    assert index.tokens.tolist() == [len(samples[0]), len(samples[1]) + len(samples[2]),
                                     len(samples[3]) + len(samples[4])]
    assert index.images.tolist() == [1, 1, 1]
    assert index.lacking(PAIR_VALUES[0]).tolist() == [0, 1]
    # a pack too short for both halves of two pairs still holds each pair whole
    packs = first_fit(index.tokens.tolist(), int(index.tokens[1:].max()))
    assert all(len(p) == 1 or 0 in p for p in packs)
    reader = SampleReader(index, tiny_processor, 256, False)
    batch = reader.pack([1, 2])
    assert batch.pairs == [(0, 1), (2, 3)]
    assert len(batch.image_grid_thw) == 2 and batch.image_index.tolist() == [0, 0, 1, 1]
    assert batch.pixel_values.shape[0] == int(batch.image_grid_thw.prod(-1).sum())
    assert REF_LOGP not in batch.sample_values  # the first pair has none
    with_reference = reader.pack([2])
    assert with_reference.sample_values[REF_LOGP].tolist() == [-1.0, -2.0]


def test_a_score_file_sets_reference_sums_on_the_halves_of_each_pair(make_jsonl, tiny_processor):
    path = make_jsonl([_trl()], IMAGES)
    index, _ = build_index([path], tiny_processor, 256)
    reader = SampleReader(index, tiny_processor, 256, False,
                          reference_logps=torch.tensor([[-4.0, -5.0]]).numpy())
    assert reader.pack([0]).sample_values[REF_LOGP].tolist() == [-4.0, -5.0]


def test_a_pack_with_half_a_pair_is_refused(make_jsonl, tiny_processor):
    chosen, rejected = load_samples(make_jsonl([_trl()], IMAGES), tiny_processor, 256)
    with pytest.raises(ValueError, match="without its rejected half"):
        build_batch([chosen])
    with pytest.raises(ValueError, match="without its chosen half"):
        build_batch([rejected])


@pytest.mark.parametrize("record,expected", [
    ({"chosen": PROMPT + [{"role": "assistant", "content": "7"}],
      "rejected": [{"role": "user", "content": "<image>Which digit?"},
                   {"role": "assistant", "content": "1"}], "images": ["img/a.png"]},
     "chosen and rejected do not share a prompt"),
    ({"chosen": PROMPT + [{"role": "assistant", "content": "7"}],
      "rejected": PROMPT + [{"role": "assistant", "content": "1"},
                            {"role": "user", "content": "again"},
                            {"role": "assistant", "content": "2"}], "images": ["img/a.png"]},
     "completion holds a 'user' turn"),
    (_trl(chosen="<image>7"), "completion holds an image"),
    (_trl(ref_chosen_logp=-1.0), '"ref_chosen_logp" is given without "ref_rejected_logp"'),
    (_trl(ref_chosen_logp=-1.0, ref_rejected_logp=math.inf), '"ref_rejected_logp" must be a finite'),
    ({"prompt": "What digit?", "chosen": "7", "rejected": "1"}, "conversational form"),
    (_trl(advantages=[1.0]), "carries no per-token arrays"),
    ({"prompt_input_ids": [1, 10], "chosen_input_ids": [11, 2]}, "'rejected_input_ids'] missing"),
])
def test_a_bad_pair_is_one_data_error_naming_its_line(record, expected, make_jsonl,
                                                       tiny_processor):
    path = make_jsonl([_trl(), record], IMAGES)
    with pytest.raises(DataError) as info:
        load_samples(path, tiny_processor, 256)
    assert str(info.value).startswith(f"{path}:2: ") and expected in str(info.value)


@pytest.mark.parametrize("truncate", [False, True])
def test_a_pair_split_by_max_seq_len_is_an_error_naming_it_even_with_truncation(
        truncate, make_jsonl, tiny_processor):
    path = make_jsonl([_trl()], IMAGES)
    chosen, rejected = load_samples(path, tiny_processor, 256)
    with pytest.raises(DataError, match=rf"{path}:1: the pair has {len(chosen)} \+ "
                                        rf"{len(rejected)} tokens, more than max_seq_len"):
        load_samples(path, tiny_processor, len(chosen) + len(rejected) - 1, truncate)
