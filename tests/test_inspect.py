"""`vlmcp inspect` and `data.chat_template_kwargs`: a sample printed as training tokenizes it, and
template variables that reach every rendering.

The tiny checkpoint's own template has no reasoning blocks, so these tests give a copy of it a
template written in the shape of Qwen3.5's official one: assistant replies after the last user
query render ``<think>\\n{reasoning}\\n</think>\\n\\n{reply}`` (an empty block when there is no
reasoning), earlier replies render without it (unless ``preserve_thinking``), and
``enable_thinking`` acts on the generation prompt only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.launching import tiny_job, write_job
from tests.helpers.videos import write_video
from vlmcp.cli import main
from vlmcp.config import job_from_dict
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.data.dataset import load_samples
from vlmcp.data.formats import EMPTY_THINK
from vlmcp.data.processor import load_processor
from vlmcp.errors import ConfigError

QWEN35_SHAPED_TEMPLATE = """\
{%- macro render(content) -%}
{%- if content is string -%}{{- content -}}
{%- else -%}{%- for part in content -%}
{%- if part.type == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- else -%}{{- part.text -}}{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- set content = render(message.content) -%}
{%- if message.role == 'assistant' -%}
{%- set reasoning = '' -%}
{%- if '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{%- if (preserve_thinking is defined and preserve_thinking) or loop.index0 > ns.last_query -%}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content -}}
{%- else -%}
{{- '<|im_start|>assistant\\n' + content -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- else -%}{{- '<think>\\n' -}}{%- endif -%}
{%- endif -%}
"""

TWO_TURNS = {"messages": [
    {"role": "user", "content": "<image>What digit is this?"},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "And doubled?"},
    {"role": "assistant", "content": "14"}], "images": ["img/a.png"]}


@pytest.fixture(scope="module")
def thinking_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a Qwen3.5-shaped chat template."""
    out = tmp_path_factory.mktemp("thinking") / "ckpt"
    shutil.copytree(tiny_checkpoint, out)
    (out / "chat_template.jinja").write_text(QWEN35_SHAPED_TEMPLATE)
    return out


def _target_texts(sample, tokenizer) -> list[str]:
    """Decoded text of each maximal run of target tokens."""
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(sample.input_ids, sample.labels):
        is_target = label != IGNORE_INDEX
        if is_target and previous:
            runs[-1].append(token)
        elif is_target:
            runs.append([token])
        previous = is_target
    return [tokenizer.decode(run) for run in runs]


def _collapse_images(ids: list[int], image_token_id: int) -> list[int]:
    """One image token per run of image placeholders, as the template renders an image."""
    return [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != t]


def _template_messages() -> list[dict]:
    """TWO_TURNS in the typed form the template receives."""
    return [{"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": "What digit is this?"}]},
            *TWO_TURNS["messages"][1:]]


def _sample(checkpoint: Path, path: Path, empty_think: str = "target", **kwargs):
    processor = load_processor(checkpoint, kwargs or None, empty_think)
    (sample,) = load_samples(path, processor, max_seq_len=256)
    return sample, processor


def test_empty_think_block_is_a_target_of_the_last_reply_only(thinking_checkpoint, make_jsonl):
    path = make_jsonl([TWO_TURNS], {"img/a.png": (64, 96)})
    sample, processor = _sample(thinking_checkpoint, path)
    tokenizer = processor.tokenizer
    assert _target_texts(sample, tokenizer) == ["7<|im_end|>", f"{EMPTY_THINK}14<|im_end|>"]
    collapsed = _collapse_images(sample.input_ids, processor.image_token_id)
    assert tokenizer.decode(collapsed) == \
        tokenizer.apply_chat_template(_template_messages(), tokenize=False)


def test_chat_template_kwargs_reach_the_template(thinking_checkpoint, make_jsonl):
    path = make_jsonl([TWO_TURNS], {"img/a.png": (64, 96)})
    default, processor = _sample(thinking_checkpoint, path)
    preserved, _ = _sample(thinking_checkpoint, path, preserve_thinking=True)
    no_thinking, _ = _sample(thinking_checkpoint, path, enable_thinking=False)
    assert _target_texts(preserved, processor.tokenizer) == [
        f"{EMPTY_THINK}7<|im_end|>", f"{EMPTY_THINK}14<|im_end|>"]
    # Qwen3.5's enable_thinking switches the generation prompt only; a training rendering (no
    # generation prompt) keeps the empty block on the last reply.
    assert no_thinking.input_ids == default.input_ids and no_thinking.labels == default.labels


def test_empty_think_prompt_keeps_the_block_out_of_the_targets(thinking_checkpoint, make_jsonl):
    path = make_jsonl([TWO_TURNS], {"img/a.png": (64, 96)})
    target, processor = _sample(thinking_checkpoint, path)
    prompt, _ = _sample(thinking_checkpoint, path, empty_think="prompt")
    assert _target_texts(prompt, processor.tokenizer) == ["7<|im_end|>", "14<|im_end|>"]
    assert prompt.input_ids == target.input_ids
    # What precedes the last reply's targets is the enable_thinking=false generation prompt.
    tokenizer = processor.tokenizer
    labels = prompt.labels
    target_starts = [i for i in range(1, len(labels))
                     if labels[i] != IGNORE_INDEX and labels[i - 1] == IGNORE_INDEX]
    last_prompt = prompt.input_ids[:target_starts[-1]]
    generation_prompt = tokenizer.apply_chat_template(
        _template_messages()[:-1], tokenize=False, add_generation_prompt=True,
        enable_thinking=False)
    assert generation_prompt.endswith(f"<|im_start|>assistant\n{EMPTY_THINK}")
    assert tokenizer(generation_prompt, add_special_tokens=False)["input_ids"] == \
        _collapse_images(last_prompt, processor.image_token_id)


def test_chat_template_kwargs_refuse_arguments_vlmcp_sets():
    with pytest.raises(ConfigError) as info:
        job_from_dict({"model": {"path": "m"}, "data": {
            "train": "t.jsonl", "chat_template_kwargs": {"tokenize": True, "enable_thinking": False}}})
    assert info.value.problems == ["config key 'data.chat_template_kwargs': 'tokenize' is set by "
                                   "vlmcp when it renders a sample and cannot be given"]


@pytest.fixture
def inspect_job(thinking_checkpoint, make_jsonl, tmp_path) -> Path:
    plain = {"messages": [{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello"}]}
    data = make_jsonl([plain, TWO_TURNS], {"img/a.png": (64, 96)})
    return write_job(tmp_path / "job.json", tiny_job(thinking_checkpoint, data, tmp_path / "out"))


def test_inspect_marks_targets_and_collapses_image_placeholders(inspect_job, capsys):
    assert main(["inspect", str(inspect_job), "--sample", "1"]) == 0
    out = capsys.readouterr().out
    summary, rendering = out.split("-" * 72 + "\n")
    assert "data.jsonl:2" in summary and "images 1" in summary
    assert "grid 1x6x4 = 24 patches -> 6 tokens" in summary
    assert "empty think block" in summary
    assert rendering.startswith(
        "<|im_start|>user\n<|vision_start|><|image_pad|>x6<|vision_end|>What digit is this?")
    assert "<|im_start|>assistant\n[[7<|im_end|>]]\n" in rendering
    assert f"<|im_start|>assistant\n[[{EMPTY_THINK}14<|im_end|>]]\n" in rendering


def test_inspect_json_accounts_for_every_token_and_honours_set(inspect_job, capsys):
    kwargs = '--set=data.chat_template_kwargs={"preserve_thinking": true}'
    assert main(["inspect", str(inspect_job), "--sample", "1", "--json", kwargs]) == 0
    report = json.loads(capsys.readouterr().out)
    segments = report["segments"]
    assert sum(s["num_tokens"] for s in segments) == report["num_tokens"]
    assert sum(s["num_tokens"] for s in segments if s["is_target"]) == report["num_targets"]
    assert report["images"] == [{"path": report["images"][0]["path"], "grid_thw": [1, 6, 4],
                                 "patches": 24, "tokens": 6}]
    assert [s for s in segments if s["kind"] == "image"] == [
        {"kind": "image", "text": "<|image_pad|>x6", "is_target": False, "num_tokens": 6,
         "image": 0}]
    assert [s["text"] for s in segments if s["is_target"]] == [
        f"{EMPTY_THINK}7<|im_end|>", f"{EMPTY_THINK}14<|im_end|>"]
    assert report["chat_template_kwargs"] == {"preserve_thinking": True}


def test_inspect_names_a_sample_past_the_end(inspect_job, capsys):
    assert main(["inspect", str(inspect_job), "--sample", "5"]) == 1
    assert "no sample 5 (the data holds 2)" in capsys.readouterr().err


def test_inspect_shows_each_videos_sampled_frames_timestamps_groups_and_tokens(
        tiny_checkpoint, tmp_path, capsys):
    write_video(tmp_path / "clip.mp4", 9, 25, 64, 48)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "<video>What moves?"},
                                             {"role": "assistant", "content": "A bar."}],
                                "videos": ["clip.mp4"]}) + "\n")
    job = write_job(tmp_path / "job.json", tiny_job(tiny_checkpoint, data, tmp_path / "out"))
    assert main(["inspect", str(job)]) == 0
    out = capsys.readouterr().out
    assert f"  video 0: {tmp_path}/clip.mp4: 9 frames (stream.frames) at 25 fps (stream average " \
           "rate), 64x48 resized to 64x64\n    frames sampled [0, 3, 5, 8]\n    2 temporal " \
           "groups of grid 4x4 (4 tokens each) at 0.1, 0.3 s -> 8 tokens" in out
    assert "<0.1 seconds><|vision_start|><|video_pad|>x4<|vision_end|><0.3 seconds>" \
           "<|vision_start|><|video_pad|>x4<|vision_end|>What moves?" in out
    assert main(["inspect", str(job), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (video,) = report["videos"]
    assert video["frames_sampled"] == [0, 3, 5, 8] and video["sampled"] == 4
    assert video["timestamps"] == [0.06, 0.26]
    assert (video["groups"], video["group_grid_hw"], video["tokens"]) == (2, [4, 4], 8)
    assert [s["image"] for s in report["segments"] if s["kind"] == "video"] == [0, 1]
