"""Video records -> samples: the LLaMA-Factory / ms-swift / Qwen-VL shapes, the prompt form
inference uses (one timestamped block per temporal group), Qwen3.5's video MRoPE, truncation
between groups, the tokens format, job overrides of the checkpoint's video settings, generation
prompts, and one clear error per bad input, named by file:line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration

from tests.helpers.launching import tiny_job, write_job
from tests.helpers.videos import write_frames, write_video
from vlmcp.cli import main
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.data.formats import parse_record
from vlmcp.errors import DataError
from vlmcp.data.index import build_index
from vlmcp.data.positions import mrope_positions
from vlmcp.data.processor import load_processor
from vlmcp.data.stream import SampleReader
from vlmcp.training.evaluate import generation_prompt

QUESTION = "What happens?"


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """clip.mp4 (9 frames, 25 fps, 64x48), long.mp4 (60 frames, 10 fps), 3 PNG frames, and
    bad.mp4 (not a video)."""
    root = tmp_path_factory.mktemp("media")
    write_video(root / "clip.mp4", 9, 25, 64, 48)
    write_video(root / "long.mp4", 60, 10, 64, 64)
    write_frames(root / "frames", 3, 32, 32)
    (root / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x17" * 200)
    from tests.helpers.images import save_png
    save_png(root / "img.png", 32, 32)
    return root


def _chat(content, answer: str = "It moves.", **media) -> dict:
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": answer}], **media}


def _parse(record, media, processor, max_seq_len=4096, truncate=False):
    return parse_record(record, "data.jsonl:1", media, processor, max_seq_len, truncate)


def test_messages_sharegpt_and_typed_video_records_give_the_same_sample(media, tiny_processor):
    samples = [
        _parse(_chat(f"<video>{QUESTION}", videos=["clip.mp4"]), media, tiny_processor),
        _parse(_chat(f"<video>{QUESTION}", video="clip.mp4"), media, tiny_processor),
        _parse({"conversations": [{"from": "human", "value": f"<video>{QUESTION}"},
                                  {"from": "gpt", "value": "It moves."}], "videos": ["clip.mp4"]},
               media, tiny_processor),
        _parse(_chat([{"type": "video"}, {"type": "text", "text": QUESTION}],
                     videos=["clip.mp4"]), media, tiny_processor),
    ]
    first = samples[0]
    assert first.video_grid_thw.tolist() == [[2, 4, 4]] and first.pixel_values is None
    for sample in samples[1:]:
        assert sample.input_ids == first.input_ids and sample.labels == first.labels
        assert torch.equal(sample.pixel_values_videos, first.pixel_values_videos)


def test_a_video_renders_one_timestamped_block_per_temporal_group_as_inference_does(
        media, tiny_processor):
    sample = _parse(_chat(f"<video>{QUESTION}", videos=["clip.mp4"]), media, tiny_processor)
    (plan,) = sample.videos
    assert plan.indices == (0, 3, 5, 8) and plan.timestamps == (0.06, 0.26)  # (0+3)/2/25, ...
    tokenizer = tiny_processor.tokenizer
    text = tokenizer.decode(sample.input_ids)
    group = "<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"
    assert f"user\n<0.1 seconds>{group}<0.3 seconds>{group}{QUESTION}<|im_end|>" in text
    assert text.count("<|vision_start|>") == 2  # no extra outer pair (transformers 5.x has one)
    # vLLM's form: the rendering's tokens, its three block tokens replaced by each group's
    # separately tokenized timestamp, start, pads, end
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]},
         {"role": "assistant", "content": "It moves."}], tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    at = ids.index(tiny_processor.video_token_id)
    groups = [tok for t in ("<0.1 seconds>", "<0.3 seconds>")
              for tok in tokenizer(t, add_special_tokens=False)["input_ids"]
              + [tiny_processor.vision_start_id] + [tiny_processor.video_token_id] * 4
              + [tiny_processor.vision_end_id]]
    assert ids[at - 1 : at + 2] == [tiny_processor.vision_start_id, tiny_processor.video_token_id,
                                    tiny_processor.vision_end_id]
    assert ids[: at - 1] + groups + ids[at + 2 :] == sample.input_ids
    pads = [t == tiny_processor.video_token_id for t in sample.input_ids]
    assert sample.mm_token_type_ids.tolist() == [2 * p for p in pads]
    assert all(label == IGNORE_INDEX for label, pad in zip(sample.labels, pads) if pad)


def test_images_and_videos_mix_in_one_sample_in_marker_order(media, tiny_processor):
    frames = [f"frames/frame{k:04d}.png" for k in range(3)]
    record = _chat(f"<image>then<video>and<video>{QUESTION}", images=["img.png"],
                   videos=["clip.mp4", frames], fps=[None, 2])
    sample = _parse(record, media, tiny_processor)
    assert sample.image_grid_thw.tolist() == [[1, 2, 2]]
    assert sample.video_grid_thw.tolist() == [[2, 4, 4], [2, 2, 2]]
    assert sample.pixel_values_videos.shape == (2 * 16 + 2 * 4, 1536)
    runs = torch.unique_consecutive(sample.mm_token_type_ids, return_counts=True)
    assert [(int(k), int(n)) for k, n in zip(*runs) if k] == [(1, 1), (2, 4), (2, 4), (2, 1), (2, 1)]
    assert sample.videos[1].timestamps == (0.25, 1.0)  # frames 0, 1 | 2, 2 at 2 fps


def test_video_positions_equal_the_models_get_rope_index(media, tiny_checkpoint, tiny_processor):
    model = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_checkpoint)
    record = _chat(f"<video>one<image>two<video>{QUESTION}", images=["img.png"],
                   videos=["long.mp4", "clip.mp4"])
    sample = _parse(record, media, tiny_processor)
    ids = torch.tensor(sample.input_ids)
    theirs, _ = model.model.get_rope_index(ids[None], sample.mm_token_type_ids[None],
                                           image_grid_thw=sample.image_grid_thw,
                                           video_grid_thw=sample.video_grid_thw)
    assert sample.position_ids.equal(theirs[:, 0])
    assert mrope_positions(ids, sample.mm_token_type_ids, sample.image_grid_thw, 2,
                           sample.video_grid_thw).equal(theirs[:, 0])


def test_a_frame_list_takes_its_fps_from_the_record_else_the_job(media, tiny_checkpoint,
                                                                 tiny_processor):
    frames = [f"frames/frame{k:04d}.png" for k in range(3)]
    record = _chat(f"<video>{QUESTION}", video=frames)
    with pytest.raises(DataError, match='data.jsonl:1: video 0 is a frame list and has no frame '
                                        'rate: set "fps" in the record or '
                                        "data.video.frame_list_fps in the job"):
        _parse(record, media, tiny_processor)
    sample = _parse({**record, "fps": 1}, media, tiny_processor)
    assert sample.videos[0].timestamps == (0.5, 2.0)
    job_default = load_processor(tiny_checkpoint, video={"frame_list_fps": 4})
    sample = _parse(record, media, job_default)
    assert sample.videos[0].timestamps == (0.125, 0.5)
    assert sample.videos[0].meta.fps_source == "data.video.frame_list_fps"


def test_job_keys_override_the_checkpoints_video_settings(media, tiny_checkpoint, tmp_path):
    copy = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    config = json.loads((copy / "video_preprocessor_config.json").read_text())
    (copy / "video_preprocessor_config.json").write_text(json.dumps({**config, "fps": 1}))
    record = _chat(f"<video>{QUESTION}", videos=["long.mp4"])  # 60 frames at 10 fps: 6 s
    from_file = _parse(record, media, load_processor(copy))
    assert len(from_file.videos[0].indices) == 6  # 1 fps from the checkpoint's file
    overridden = _parse(record, media, load_processor(copy, video={"fps": 4, "max_frames": 10,
                                                                   "max_pixels": 5 * 1024}))
    (plan,) = overridden.videos
    assert len(plan.indices) == 10 and (plan.height, plan.width) == (32, 32)


def test_truncation_keeps_whole_temporal_groups_and_the_index_agrees(media, tiny_processor,
                                                                     tmp_path):
    # a first turn keeps a target before the video; 12 frames, 6 groups of 4 tokens
    record = {"messages": [{"role": "user", "content": "Ready?"},
                           {"role": "assistant", "content": "Yes."},
                           {"role": "user", "content": f"<video>{QUESTION}"},
                           {"role": "assistant", "content": "It moves."}],
              "videos": ["long.mp4"]}
    whole = _parse(record, media, tiny_processor)
    assert whole.video_grid_thw.tolist() == [[6, 4, 4]]
    kept = set()
    video_start = whole.input_ids.index(tiny_processor.vision_start_id)
    for max_len in range(video_start - 3, len(whole) - 10, 3):
        cut = _parse(record, media, tiny_processor, max_len, truncate=True)
        assert len(cut) <= max_len
        ids = cut.input_ids
        pads = [i for i, t in enumerate(ids) if t == tiny_processor.video_token_id]
        groups = int(cut.video_grid_thw[0, 0]) if cut.video_grid_thw is not None else 0
        assert len(pads) == 4 * groups and (not pads or ids[pads[-1] + 1] == tiny_processor.vision_end_id)
        kept.add(groups)
        if groups:
            assert cut.video_grid_thw.tolist() == [[groups, 4, 4]]
            assert torch.equal(cut.pixel_values_videos, whole.pixel_values_videos[:16 * groups])
    assert {0, 1, 5} <= kept
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(record) + "\n")
    index, problems = build_index([data], tiny_processor, len(whole) - 20, truncate=True,
                                  image_root=media)
    assert problems == []
    assert SampleReader(index, tiny_processor, len(whole) - 20, True).sample(0).input_ids == \
        _parse(record, media, tiny_processor, len(whole) - 20, truncate=True).input_ids


def test_the_tokens_format_takes_pre_expanded_video_placeholders(media, tiny_processor):
    chat = _parse(_chat(f"<video>{QUESTION}", videos=["clip.mp4"]), media, tiny_processor)
    record = {"input_ids": chat.input_ids, "labels": chat.labels, "videos": ["clip.mp4"]}
    tokens = _parse(record, media, tiny_processor)
    assert tokens.input_ids == chat.input_ids and tokens.labels == chat.labels
    assert torch.equal(tokens.pixel_values_videos, chat.pixel_values_videos)
    assert tokens.position_ids.equal(chat.position_ids)
    first = chat.input_ids.index(tiny_processor.video_token_id)
    short = {**record, "input_ids": chat.input_ids[:first] + chat.input_ids[first + 1:],
             "labels": chat.labels[:first] + chat.labels[first + 1:]}
    with pytest.raises(DataError, match=r"data.jsonl:1: temporal group 0 of video .*clip.mp4 has 3 "
                                        "placeholders at token"):
        _parse(short, media, tiny_processor)


def _respelled(sample, tokenizer, old: str, new: str) -> dict:
    """The tokens record of `sample` with the timestamp text `old` spelled `new`."""
    ids, labels = list(sample.input_ids), list(sample.labels)
    old_ids = tokenizer(old, add_special_tokens=False)["input_ids"]
    at = next(i for i in range(len(ids)) if ids[i:i + len(old_ids)] == old_ids)
    new_ids = tokenizer(new, add_special_tokens=False)["input_ids"]
    return {"input_ids": ids[:at] + new_ids + ids[at + len(old_ids):],
            "labels": labels[:at] + [IGNORE_INDEX] * len(new_ids) + labels[at + len(old_ids):],
            "videos": ["clip.mp4"]}


def test_tokens_format_timestamps_other_than_vlmcps_frame_plan_are_an_error_or_a_warning(
        media, tiny_checkpoint, tiny_processor, caplog):
    chat = _parse(_chat(f"<video>{QUESTION}", videos=["clip.mp4"]), media, tiny_processor)
    assert [round(t, 2) for t in chat.videos[0].timestamps] == [0.06, 0.26]  # <0.1>, <0.3>
    tokenizer = tiny_processor.tokenizer
    same = _respelled(chat, tokenizer, "<0.3 seconds>", "<0.26 seconds>")  # more digits
    assert _parse(same, media, tiny_processor).videos == chat.videos
    other = _respelled(chat, tokenizer, "<0.3 seconds>", "<0.7 seconds>")
    with pytest.raises(DataError, match=r"^data.jsonl:1: temporal group 1 of video .*clip.mp4 "
                                        r"shows <0.7 seconds>, vlmcp's plan samples frames "
                                        r"\[5, 8\] of it at 25 fps: <0.3 seconds>"):
        _parse(other, media, tiny_processor)
    missing = _respelled(chat, tokenizer, "<0.1 seconds>", "")
    with pytest.raises(DataError, match=r"temporal group 0 of video .*clip.mp4 has no <t seconds>"):
        _parse(missing, media, tiny_processor)
    warned = load_processor(tiny_checkpoint, video={"on_timestamp_mismatch": "warn"})
    with caplog.at_level(logging.WARNING, logger="vlmcp.data.formats"):
        assert _parse(other, media, warned).videos == chat.videos
    assert "data.jsonl:1: temporal group 1" in caplog.text and "trained anyway" in caplog.text


def test_a_video_the_processor_rejects_is_one_data_error_naming_the_sample(
        media, tiny_checkpoint, tmp_path):
    copy = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    config = json.loads((copy / "video_preprocessor_config.json").read_text())
    config["image_mean"] = [0.5, 0.5]  # two channels' means for RGB frames
    (copy / "video_preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match=r"^data.jsonl:1: video processor rejected .*clip.mp4: "):
        _parse(_chat(f"<video>{QUESTION}", videos=["clip.mp4"]), media, load_processor(copy))


def test_a_generation_prompt_keeps_its_video_and_plain_generate_runs_on_it(
        media, tiny_checkpoint, tiny_processor):
    sample = _parse(_chat(f"<video>{QUESTION}", videos=["clip.mp4"], images=["img.png"])
                    | {"messages": [{"role": "user", "content": f"<image><video>{QUESTION}"},
                                    {"role": "assistant", "content": "It moves."}]},
                    media, tiny_processor)
    prompt = generation_prompt(sample, max_new_tokens=4)
    assert prompt.video_grid_thw.tolist() == [[2, 4, 4]]
    assert torch.equal(prompt.pixel_values_videos, sample.pixel_values_videos)
    assert prompt.image_grid_thw.tolist() == [[1, 2, 2]]
    model = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_checkpoint).eval()
    output = model.generate(input_ids=prompt.input_ids, mm_token_type_ids=prompt.mm_token_type_ids,
                            attention_mask=torch.ones_like(prompt.input_ids), do_sample=False,
                            max_new_tokens=len(prompt.reference),
                            **prompt.vision_inputs(torch.device("cpu")))
    assert output.shape[1] == prompt.input_ids.shape[1] + len(prompt.reference)


def test_bad_video_inputs_are_one_error_each_naming_file_and_line(media, tiny_checkpoint,
                                                                  tmp_path, capsys):
    lines = [
        _chat(f"<video>{QUESTION}", videos=["bad.mp4"]),               # corrupt mp4
        _chat(f"<video>{QUESTION}", videos=[[]]),                       # empty frame list
        _chat(f"<video>{QUESTION}"),                                    # marker, no path
        _chat(f"<video><video>{QUESTION}", videos=["clip.mp4"]),        # more markers
        _chat(f"<video>{QUESTION}", videos=["missing.mp4"]),
        _chat(f"<video>{QUESTION}", videos=["clip.mp4"]),               # fine
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    job = write_job(tmp_path / "job.json",
                    tiny_job(tiny_checkpoint, data, tmp_path / "out", data={
                        "train": str(data), "max_seq_len": 512, "image_root": str(media)}))
    assert main(["validate", str(job)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 5
    assert errors[0].startswith(f"error: {data}:1: video {media}/bad.mp4: cannot open (")
    assert errors[1] == f'error: {data}:2: "videos"[0] is an empty frame list'
    assert errors[2] == (f"error: {data}:3: 1 video markers (<video> or typed video entries) but "
                         'the record has no "videos" (or "video")')
    assert errors[3] == (f"error: {data}:4: 2 video markers (<video> or typed video entries) for 1 "
                         'videos in "videos" (or "video")')
    assert errors[4] == f"error: {data}:5: video not found: {media}/missing.mp4"


def test_a_video_longer_than_max_seq_len_is_an_error_without_truncate(media, tiny_processor):
    with pytest.raises(DataError, match=r"data.jsonl:1: \d+ tokens, more than max_seq_len 64 "
                                        r"\(set data.truncate"):
        _parse(_chat(f"<video>{QUESTION}", videos=["long.mp4"]), media, tiny_processor, 64)
