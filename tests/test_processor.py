"""Processor loading from a published-style checkpoint directory, without torchvision."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from vlmcp.data.processor import image_processor_kwargs, load_processor
from vlmcp.errors import ProcessorError


def test_processor_loads_without_torchvision(tiny_checkpoint):
    assert importlib.util.find_spec("torchvision") is None
    preprocessor = json.loads((tiny_checkpoint / "preprocessor_config.json").read_text())
    assert preprocessor["image_processor_type"] == "Qwen2VLImageProcessorFast"
    processor = load_processor(tiny_checkpoint)
    assert isinstance(processor.image_processor, Qwen2VLImageProcessorPil)
    assert (processor.image_token_id, processor.vision_start_id, processor.vision_end_id) == \
        (5, 3, 4)


def test_image_geometry_comes_from_preprocessor_config_not_pil_defaults(tiny_processor):
    image_processor = tiny_processor.image_processor
    assert Qwen2VLImageProcessorPil.patch_size == 14  # the class default is Qwen2-VL's
    assert image_processor.patch_size == 16
    assert image_processor.temporal_patch_size == 2
    assert image_processor.merge_size == tiny_processor.merge_size == 2
    assert list(image_processor.image_mean) == list(image_processor.image_std) == [0.5] * 3
    assert (image_processor.size.shortest_edge, image_processor.size.longest_edge) == \
        (32 * 32, 256 * 256)


def test_process_images_gives_patches_grids_and_placeholder_counts(tiny_processor):
    images = [Image.new("L", (32, 32), 255), Image.new("RGB", (64, 96), (0, 0, 0))]
    pixel_values, grid = tiny_processor.process_images(images)
    assert grid.tolist() == [[1, 2, 2], [1, 6, 4]]
    assert pixel_values.shape == (4 + 24, 3 * 2 * 16 * 16)
    assert pixel_values[:4].eq(1.0).all() and pixel_values[4:].eq(-1.0).all()  # mean/std 0.5
    assert [tiny_processor.num_placeholders(g) for g in grid] == [1, 6]


def test_min_and_max_pixels_fields_set_the_size_bounds():
    config = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
              "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
              "min_pixels": 1024, "max_pixels": 4096}
    assert image_processor_kwargs(config)["size"] == {"shortest_edge": 1024, "longest_edge": 4096}


def test_preprocessor_config_without_geometry_is_rejected():
    with pytest.raises(ProcessorError, match="lacks"):
        image_processor_kwargs({"image_mean": [0.5] * 3})


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))


def test_missing_preprocessor_config_is_a_clear_error(tiny_checkpoint, tmp_path):
    copy = _copy(tiny_checkpoint, tmp_path)
    (copy / "preprocessor_config.json").unlink()
    with pytest.raises(ProcessorError, match="preprocessor_config.json: missing"):
        load_processor(copy)


def _set_json_key(path: Path, key: str, value) -> None:
    data = json.loads(path.read_text())
    data[key] = value
    path.write_text(json.dumps(data))


def test_config_ids_that_disagree_with_the_tokenizer_are_rejected(tiny_checkpoint, tmp_path):
    copy = _copy(tiny_checkpoint, tmp_path)
    _set_json_key(copy / "config.json", "image_token_id", 7)
    with pytest.raises(ProcessorError, match="image_token_id=7"):
        load_processor(copy)


def test_merge_size_that_disagrees_with_the_vision_config_is_rejected(tiny_checkpoint, tmp_path):
    copy = _copy(tiny_checkpoint, tmp_path)
    _set_json_key(copy / "preprocessor_config.json", "merge_size", 1)
    with pytest.raises(ProcessorError, match="spatial_merge_size=2"):
        load_processor(copy)


def test_video_settings_come_from_video_preprocessor_config(tiny_checkpoint, tmp_path):
    copy = _copy(tiny_checkpoint, tmp_path)
    config = json.loads((copy / "video_preprocessor_config.json").read_text())
    assert config["video_processor_type"] == "Qwen3VLVideoProcessor"
    config.update(fps=3, max_frames=32, size={"shortest_edge": 2048, "longest_edge": 8192},
                  image_mean=[0.25] * 3)
    (copy / "video_preprocessor_config.json").write_text(json.dumps(config))
    processor = load_processor(copy)
    video = processor.video
    assert (video.fps, video.min_frames, video.max_frames) == (3.0, 4, 32)
    assert (video.min_pixels, video.max_pixels) == (2048, 8192)
    assert list(processor.frame_processor.image_mean) == [0.25] * 3
    assert list(processor.image_processor.image_mean) == [0.5] * 3  # images keep their own
    assert processor.video_token_id == 6
    overridden = load_processor(copy, video={"fps": 1.5, "max_pixels": 4096, "min_frames": None})
    assert (overridden.video.fps, overridden.video.max_pixels, overridden.video.min_frames) == \
        (1.5, 4096, 4)


def test_video_config_min_and_max_pixels_fields_are_ignored_with_a_warning_as_qwen3_vl_does(
        tiny_checkpoint, tmp_path, caplog):
    # transformers' Qwen3VLVideoProcessor takes no min_pixels/max_pixels setting: its bounds are
    # size's (only the Qwen2-VL video processor lets those fields override size).
    settings = set(Qwen3VLVideoProcessor.valid_kwargs.__annotations__)
    assert not {"min_pixels", "max_pixels"} & settings
    copy = _copy(tiny_checkpoint, tmp_path)
    path = copy / "video_preprocessor_config.json"
    config = json.loads(path.read_text())
    config.update(size={"shortest_edge": 2048, "longest_edge": 8192}, min_pixels=1,
                  max_pixels=10**9)
    path.write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="vlmcp.data.video_plan"):
        video = load_processor(copy).video
    assert (video.min_pixels, video.max_pixels) == (2048, 8192)
    assert "field 'min_pixels' (1) is ignored" in caplog.text
    assert "field 'max_pixels' (1000000000) is ignored" in caplog.text
    del config["size"]
    path.write_text(json.dumps(config))
    assert (load_processor(copy).video.min_pixels, load_processor(copy).video.max_pixels) == \
        tuple(Qwen3VLVideoProcessor.size.values())  # the class default, as transformers
    config["size"] = {"longest_edge": 8192}
    path.write_text(json.dumps(config))
    with pytest.raises(ProcessorError, match=r"video_preprocessor_config.json: size .* lacks "
                                             r"size\['shortest_edge'\]"):
        load_processor(copy)
    assert load_processor(copy, video={"min_pixels": 1024}).video.min_pixels == 1024


def test_a_checkpoint_without_video_config_trains_images_and_names_the_file_for_videos(
        tiny_checkpoint, tmp_path):
    copy = _copy(tiny_checkpoint, tmp_path)
    (copy / "video_preprocessor_config.json").unlink()
    processor = load_processor(copy)
    assert processor.video is None and "video_preprocessor_config.json" in processor.no_video


def test_a_fixed_num_frames_is_rejected_naming_the_file(tiny_checkpoint, tmp_path):
    copy = _copy(tiny_checkpoint, tmp_path)
    _set_json_key(copy / "video_preprocessor_config.json", "num_frames", 16)
    with pytest.raises(ProcessorError, match="video_preprocessor_config.json: .*num_frames"):
        load_processor(copy)
