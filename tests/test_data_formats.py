"""JSONL formats -> samples: the documented targets, and one clear error per bad input."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.data.dataset import load_samples, validate_data
from vlmcp.data.formats import Sample
from vlmcp.errors import DataError

QUESTION = "What digit is this?"


def _messages(answer: str = "7", image: bool = True) -> dict:
    user = f"<image>{QUESTION}" if image else QUESTION
    record = {"messages": [{"role": "user", "content": user},
                           {"role": "assistant", "content": answer}]}
    record["images"] = ["img/a.png"] if image else []
    return record


def _one(path: Path, processor, max_seq_len: int = 512, truncate: bool = False) -> Sample:
    (sample,) = load_samples(path, processor, max_seq_len, truncate)
    return sample


def _target_ids(sample: Sample) -> list[int]:
    return [label for label in sample.labels if label != IGNORE_INDEX]


def _collapse_images(ids: list[int], image_token_id: int) -> list[int]:
    """Each run of image tokens -> one image token (the rendering before expansion)."""
    return [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != t]


def test_messages_format_targets_are_assistant_reply_and_im_end(make_jsonl, tiny_processor):
    tok = tiny_processor.tokenizer
    sample = _one(make_jsonl([_messages("7")], {"img/a.png": (32, 32)}), tiny_processor)
    assert _target_ids(sample) == tok("7<|im_end|>", add_special_tokens=False)["input_ids"]
    first_target = next(i for i, label in enumerate(sample.labels) if label != IGNORE_INDEX)
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert sample.input_ids[first_target - len(header):first_target] == header
    assert sample.labels[-1] == IGNORE_INDEX  # the "\n" after <|im_end|>
    assert sample.source.endswith("data.jsonl:1")


def test_decoded_tokens_equal_chat_template_rendering(make_jsonl, tiny_processor):
    record = {"messages": [{"role": "user", "content": "<image>and<image>: which is larger?"},
                           {"role": "assistant", "content": "The second one."}],
              "images": ["img/a.png", "img/b.png"]}
    sample = _one(make_jsonl([record], {"img/a.png": (32, 32), "img/b.png": (64, 64)}),
                  tiny_processor)
    tok = tiny_processor.tokenizer
    rendering = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                      {"type": "image"},
                                      {"type": "text", "text": ": which is larger?"}]},
         {"role": "assistant", "content": "The second one."}], tokenize=False)
    collapsed = _collapse_images(sample.input_ids, tiny_processor.image_token_id)
    assert tok.decode(collapsed) == rendering


def test_image_pads_expand_to_grid_count_and_carry_no_loss(make_jsonl, tiny_processor):
    record = {**_messages(), "images": ["img/a.png"]}
    sample = _one(make_jsonl([record], {"img/a.png": (64, 96)}), tiny_processor)
    assert sample.image_grid_thw.tolist() == [[1, 6, 4]]
    image_positions = [i for i, t in enumerate(sample.input_ids)
                       if t == tiny_processor.image_token_id]
    assert len(image_positions) == 6 * 4 // 4
    assert image_positions == list(range(image_positions[0], image_positions[0] + 6))
    assert all(sample.labels[i] == IGNORE_INDEX for i in image_positions)
    assert sample.mm_token_type_ids.nonzero().flatten().tolist() == image_positions
    assert sample.pixel_values.shape == (24, 3 * 2 * 16 * 16)


def test_typed_content_and_sharegpt_give_the_same_sample_as_messages(make_jsonl, tiny_processor):
    images = {"img/a.png": (32, 32)}
    system = "You are a helpful assistant."
    plain = {"messages": [{"role": "system", "content": system}, *_messages()["messages"]],
             "images": ["img/a.png"]}
    typed = {"messages": [
        {"role": "system", "content": [{"type": "text", "text": system}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": [{"type": "text", "text": "7"}]}],
        "images": ["img/a.png"]}
    sharegpt = {"conversations": [{"from": "system", "value": system},
                                  {"from": "human", "value": f"<image>{QUESTION}"},
                                  {"from": "gpt", "value": "7"}],
                "images": ["img/a.png"]}
    samples = load_samples(make_jsonl([plain, typed, sharegpt], images), tiny_processor, 512)
    for other in samples[1:]:
        assert other.input_ids == samples[0].input_ids
        assert other.labels == samples[0].labels
        assert other.position_ids.equal(samples[0].position_ids)


def test_multi_turn_targets_are_every_reply_and_im_end_but_no_header(make_jsonl, tiny_processor):
    record = {"messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "<image>What digit is this?"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "And in words?"},
        {"role": "assistant", "content": "seven"}],
        "images": ["img/a.png"]}
    sample = _one(make_jsonl([record], {"img/a.png": (32, 32)}), tiny_processor)
    tok = tiny_processor.tokenizer
    spans = [[sample.input_ids[i] for i in group]
             for key, group in itertools.groupby(range(len(sample)),
                                                 key=lambda i: sample.labels[i] != IGNORE_INDEX)
             if key]
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert spans == [encode("7<|im_end|>"), encode("seven<|im_end|>")]


def test_tokens_format_round_trips_a_chat_sample(make_jsonl, tiny_processor):
    images = {"img/a.png": (64, 64)}
    chat = _one(make_jsonl([_messages()], images), tiny_processor)
    tokens = {"input_ids": chat.input_ids, "labels": chat.labels, "images": ["img/a.png"]}
    again = _one(make_jsonl([tokens], images, name="tokens.jsonl"), tiny_processor)
    assert again.input_ids == chat.input_ids
    assert again.labels == chat.labels
    assert again.pixel_values.equal(chat.pixel_values)
    assert again.position_ids.equal(chat.position_ids)


def test_text_only_sample_has_no_images_and_plain_positions(make_jsonl, tiny_processor):
    sample = _one(make_jsonl([_messages(image=False)]), tiny_processor)
    assert sample.pixel_values is None and sample.image_grid_thw is None
    assert sample.position_ids.tolist() == [list(range(len(sample)))] * 3


def _tokens_record(tiny_processor, placeholders: int) -> dict:
    pad = tiny_processor.image_token_id
    ids = [1, 3] + [pad] * placeholders + [4, 40, 2, 1, 41, 2]
    labels = [IGNORE_INDEX] * (len(ids) - 2) + [41, 2]
    return {"input_ids": ids, "labels": labels, "images": ["img/a.png"]}


BAD_LINES = {
    "missing image": (lambda p: {**_messages(), "images": ["img/missing.png"]},
                      "image not found: {dir}/img/missing.png"),
    "corrupt png": (lambda p: {**_messages(), "images": ["img/corrupt.png"]},
                    "cannot decode image {dir}/img/corrupt.png"),
    "placeholder mismatch": (lambda p: _tokens_record(p, 2),
                             "image {dir}/img/a.png has 2 placeholders"),
    "over-long": (lambda p: _messages("7 " * 300), "more than max_seq_len 64"),
    "no targets": (lambda p: {"messages": [{"role": "user", "content": "<image>hi"}],
                              "images": ["img/a.png"]}, "no target tokens"),
    "malformed json": (lambda p: '{"messages": [', "malformed JSON"),
    "unknown format": (lambda p: {"text": "hello"}, "unknown format"),
    "labels length": (lambda p: {**_tokens_record(p, 1), "labels": [IGNORE_INDEX, 2]},
                      "2 labels for 9 input_ids"),
    "shifted labels": (lambda p: {**_tokens_record(p, 1),
                                  "labels": [IGNORE_INDEX] * 6 + [41, 2, IGNORE_INDEX]},
                       "labels must be unshifted"),
    "marker count": (lambda p: {**_messages(), "images": ["img/a.png", "img/a.png"]},
                     "1 image markers (<image> or typed image entries) for 2 paths"),
    "missing video": (lambda p: {"messages": [{"role": "user", "content": "<video>hi"},
                                              {"role": "assistant", "content": "7"}],
                                 "videos": ["clip.mp4"]}, "video not found: {dir}/clip.mp4"),
    "unknown role": (lambda p: {"messages": [{"role": "robot", "content": "hi"}]},
                     'unknown role "robot"'),
}


def _bad_file(make_jsonl, tmp_path: Path, bad_line) -> Path:
    """Line 1 good, line 2 bad; img/corrupt.png is a real PNG cut in half."""
    path = make_jsonl([_messages(), bad_line], {"img/a.png": (32, 32), "img/corrupt.png": (32, 32)})
    corrupt = tmp_path / "img" / "corrupt.png"
    corrupt.write_bytes(corrupt.read_bytes()[: corrupt.stat().st_size // 2])
    return path


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_raises_one_data_error_naming_file_and_line(
    case, make_jsonl, tmp_path, tiny_processor
):
    make_line, expected = BAD_LINES[case]
    path = _bad_file(make_jsonl, tmp_path, make_line(tiny_processor))
    with pytest.raises(DataError) as info:
        load_samples(path, tiny_processor, max_seq_len=64)
    message = str(info.value)
    assert message.startswith(f"{path}:2: ")
    assert expected.format(dir=tmp_path) in message
    assert isinstance(info.value, ValueError)


def test_validate_data_lists_every_problem_once(make_jsonl, tmp_path, tiny_processor):
    bad = [make_line(tiny_processor) for make_line, _ in BAD_LINES.values()]
    path = make_jsonl([_messages(), *bad, _messages()], {"img/a.png": (32, 32)})
    (tmp_path / "img" / "corrupt.png").write_bytes(b"not an image")
    problems = validate_data(path, tiny_processor, max_seq_len=64)
    assert [p.split(": ")[0] for p in problems] == [f"{path}:{i}" for i in range(2, 2 + len(bad))]


def test_validate_data_is_empty_for_a_clean_file(digits_jsonl, tiny_processor):
    assert validate_data(digits_jsonl / "train.jsonl", tiny_processor, max_seq_len=64) == []


def test_validate_data_reports_a_missing_file(tmp_path, tiny_processor):
    problems = validate_data(tmp_path / "nope.jsonl", tiny_processor, max_seq_len=64)
    assert len(problems) == 1 and "nope.jsonl: cannot open" in problems[0]


def test_truncate_cuts_before_an_image_it_would_split_and_drops_it(make_jsonl, tiny_processor):
    record = {"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "<image>What digit is this?"},
                           {"role": "assistant", "content": "7"}],
              "images": ["img/a.png"]}
    path = make_jsonl([record], {"img/a.png": (64, 64)})
    full = _one(path, tiny_processor)
    vision_start = full.input_ids.index(tiny_processor.vision_start_id)
    cut = _one(path, tiny_processor, max_seq_len=vision_start + 3, truncate=True)
    assert cut.input_ids == full.input_ids[:vision_start]
    assert cut.labels == full.labels[:vision_start]
    assert cut.pixel_values is None and cut.image_grid_thw is None and cut.image_paths == []
    assert cut.position_ids.equal(full.position_ids[:, :vision_start])


def test_truncate_inside_the_second_image_keeps_the_first_whole(make_jsonl, tiny_processor):
    record = {"messages": [{"role": "user", "content": "<image>this one?"},
                           {"role": "assistant", "content": "yes"},
                           {"role": "user", "content": "<image>and this one?"},
                           {"role": "assistant", "content": "no"}],
              "images": ["img/a.png", "img/b.png"]}
    path = make_jsonl([record], {"img/a.png": (32, 64), "img/b.png": (64, 64)})
    full = _one(path, tiny_processor)
    assert full.image_grid_thw.tolist() == [[1, 4, 2], [1, 4, 4]]
    second_start = len(full) - 1 - full.input_ids[::-1].index(tiny_processor.vision_start_id)
    cut = _one(path, tiny_processor, max_seq_len=second_start + 2, truncate=True)
    assert cut.input_ids == full.input_ids[:second_start]
    assert cut.image_grid_thw.tolist() == [[1, 4, 2]]
    assert cut.pixel_values.equal(full.pixel_values[:8])
    assert cut.image_paths == full.image_paths[:1]


def test_truncate_that_leaves_no_target_is_an_error(make_jsonl, tiny_processor):
    path = make_jsonl([_messages("seven " * 20)], {"img/a.png": (32, 32)})
    with pytest.raises(DataError, match=r"data.jsonl:1: no target tokens .*after truncation"):
        _one(path, tiny_processor, max_seq_len=8, truncate=True)
