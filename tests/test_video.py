"""Video in the data path: frames sampled, sized and timestamped as transformers' Qwen3-VL video
processor does (checked against its own functions), pixels built through the image path (bit
for bit where no resize is needed), container metadata read without decoding (including
containers that store no frame count), and the length index's token count equal to the
loader's on every test video."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from tests.helpers.videos import frame_pixels, write_frames, write_video
from vlmcp.data.formats import parse_record
from vlmcp.errors import DataError
from vlmcp.data.index import build_index
from vlmcp.data.stream import SampleReader
from vlmcp.data.video import VideoSource, decode_frames, probe_video
from vlmcp.data.video_plan import (
    group_timestamps,
    plan_video,
    resized_size,
    sample_indices,
    video_settings,
)

#: (name, frames, fps, width, height, codec, container format): 24, 25 and 30 fps, NTSC, odd
#: frame counts and sizes, fewer frames than min_frames, more than max_frames at fps 2, and
#: containers that store no frame count (Matroska, WebM, raw H.264).
VIDEOS = [
    ("fps24_odd.mp4", 13, 24, 64, 48, "libx264rgb", None),
    ("fps25.mp4", 25, 25, 96, 64, "libx264", None),
    ("fps30_no_count.mkv", 31, 30, 64, 64, "ffv1", None),
    ("ntsc_no_count.webm", 9, Fraction(30000, 1001), 48, 80, "libvpx", None),
    ("short.mp4", 3, 25, 32, 32, "libx264rgb", None),
    ("raw_no_count.h264", 10, 25, 64, 48, "libx264", "h264"),
    ("odd_size.avi", 7, 25, 33, 31, "ffv1", None),
    ("long.mp4", 91, 30, 64, 48, "libx264", None),
]


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("videos")
    for name, frames, fps, width, height, codec, container in VIDEOS:
        write_video(root / name, frames, fps, width, height, codec, container)
    return root


def _settings(**config):
    base = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "fps": 2,
            "min_frames": 4, "max_frames": 768, "size": {"shortest_edge": 1024,
                                                         "longest_edge": 65536}}
    return video_settings({**base, **config})


def _their_indices(total: int, fps: float, settings) -> list[int]:
    """transformers' Qwen3VLVideoProcessor.sample_frames on that metadata."""
    spec = SimpleNamespace(fps=settings.fps, min_frames=settings.min_frames,
                           max_frames=settings.max_frames)
    metadata = VideoMetadata(total_num_frames=total, fps=fps)
    return Qwen3VLVideoProcessor.sample_frames(spec, metadata).tolist()


@pytest.mark.parametrize("max_frames", [768, 6])
def test_frame_indices_and_timestamps_follow_transformers(max_frames):
    settings = _settings(max_frames=max_frames)
    for total in (1, 2, 3, 4, 5, 13, 24, 25, 30, 31, 61, 91, 300, 1001):
        for fps in (24.0, 25.0, 30.0, 30000 / 1001, 2.0, 0.5):
            ours = sample_indices(total, fps, settings)
            assert ours == _their_indices(total, fps, settings), (total, fps)
            theirs = Qwen3VLProcessor._calculate_timestamps(None, list(ours), fps, 2)
            assert group_timestamps(ours, fps, 2) == theirs, (total, fps)


def test_more_frames_than_min_frames_are_sampled_at_fps_and_short_videos_keep_every_frame():
    settings = _settings()
    assert sample_indices(25 * 10, 25, settings) == np.linspace(0, 249, 20).round().tolist()
    assert sample_indices(3, 25, settings) == [0, 1, 2]  # fewer than min_frames: all of them
    assert sample_indices(13, 24, settings) == [0, 4, 8, 12]  # min_frames
    assert sample_indices(7, 25, video_settings({"do_sample_frames": False})) == list(range(7))


@pytest.mark.parametrize("cap", [False, True])
def test_video_grid_equals_transformers_patch_count_with_bounds_on_all_frames(cap):
    settings = _settings(cap_pixels_per_frame=cap, max_video_tokens=16,
                         size={"shortest_edge": 4096, "longest_edge": 128 * 128 * 8})
    spec = SimpleNamespace(size={"shortest_edge": 4096, "longest_edge": 128 * 128 * 8},
                           patch_size=16, merge_size=2, temporal_patch_size=2,
                           cap_pixels_per_frame=cap, max_video_tokens=16)
    for frames in (2, 3, 4, 8, 17, 64):
        for height, width in ((48, 64), (480, 640), (720, 1280), (31, 33), (1000, 40)):
            h, w = resized_size(frames, height, width, settings)
            patches = -(-frames // 2) * (h // 16) * (w // 16)
            theirs = Qwen3VLVideoProcessor.get_num_of_video_patches(spec, frames, height, width)
            assert patches == theirs, (frames, height, width)


def test_pixel_bounds_act_on_all_frames_together():
    settings = _settings(size={"shortest_edge": 1024, "longest_edge": 256 * 256})
    assert resized_size(2, 128, 128, settings) == (128, 128)  # 2 x 128^2 = 32768 fits
    h, w = resized_size(16, 128, 128, settings)  # 16 x 128^2 = 262144 is 4x the bound
    assert (h, w) == (64, 64) and 16 * h * w <= 256 * 256
    # the same frames alone, as images, are not scaled
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    assert smart_resize(128, 128, 32, 1024, 256 * 256) == (128, 128)


@pytest.mark.parametrize("name, frames, fps, width, height, codec, container", VIDEOS,
                         ids=[v[0] for v in VIDEOS])
def test_metadata_is_read_without_decoding(videos, name, frames, fps, width, height, codec,
                                           container):
    meta = probe_video(VideoSource(path=videos / name), "s:1")
    assert (meta.total_frames, meta.width, meta.height) == (frames, width, height)
    assert meta.native_fps == pytest.approx(float(fps))
    stored_count = not name.split(".")[0].endswith("no_count")
    assert meta.count_source == ("stream.frames" if stored_count else "packets counted")


def test_decoding_returns_the_sampled_frames_in_order(videos):
    video = VideoSource(path=videos / "fps24_odd.mp4")  # lossless
    meta = probe_video(video, "s:1")
    frames = decode_frames(video, meta, [0, 4, 8, 12, 12], "s:1")
    assert [np.array(f).tolist() for f in frames] == \
        [frame_pixels(k, 64, 48).tolist() for k in (0, 4, 8, 12, 12)]
    mkv = VideoSource(path=videos / "fps30_no_count.mkv")  # lossless, counted packets
    (last,) = decode_frames(mkv, probe_video(mkv, "s:1"), [30], "s:1")
    assert np.array(last).tolist() == frame_pixels(30, 64, 64).tolist()


def test_video_patches_equal_the_image_path_per_frame_pair_bit_for_bit(tmp_path, tiny_processor):
    """Frames of 64x64 need no resize (a multiple of 32, within the bounds): every temporal
    group's rows are the image processor's patches of its two frames, interleaved along T."""
    frames = write_frames(tmp_path / "frames", 7, 64, 64)
    video = VideoSource(frames=tuple(frames), fps=2.0, fps_source='"fps"')
    meta = probe_video(video, "s:1")
    plan = plan_video(video, meta, tiny_processor.video)
    assert plan.indices == (0, 1, 2, 3, 4, 5, 6, 6) and plan.grid == (4, 4, 4)
    pixels = tiny_processor.process_video(decode_frames(video, meta, list(plan.indices), "s:1"),
                                          plan)
    assert pixels.shape == (4 * 16, 3 * 2 * 16 * 16)
    rows = pixels.reshape(4, 16, 3, 2, 16, 16)
    for k, index in enumerate(plan.indices):
        image_rows, grid = tiny_processor.process_images([Image.open(frames[index])])
        assert grid.tolist() == [[1, 4, 4]]
        assert torch.equal(rows[k // 2, :, :, k % 2], image_rows.reshape(16, 3, 2, 16, 16)[:, :, 0])


def test_video_patches_have_transformers_video_patch_layout(tmp_path, tiny_processor):
    frames = write_frames(tmp_path / "frames", 4, 64, 64)
    video = VideoSource(frames=tuple(frames), fps=2.0, fps_source='"fps"')
    meta = probe_video(video, "s:1")
    plan = plan_video(video, meta, tiny_processor.video)
    ours = tiny_processor.process_video(decode_frames(video, meta, list(plan.indices), "s:1"),
                                        plan)
    normalised = torch.stack([torch.from_numpy(np.asarray(Image.open(f), np.float32)).permute(2, 0, 1)
                              for f in frames]) / 255 * 2 - 1
    theirs, t, h, w = Qwen3VLVideoProcessor.patchify(None, normalised[None], patch_size=16,
                                                     merge_size=2, temporal_patch_size=2)
    assert (t, h, w) == plan.grid
    torch.testing.assert_close(ours, theirs[0], rtol=0, atol=1e-6)


def _video_record(video: str | list[str], **extra) -> dict:
    return {"messages": [{"role": "user", "content": "<video>What happens?"},
                         {"role": "assistant", "content": "It moves."}], "video": video, **extra}


def test_the_index_counts_the_loaders_tokens_on_every_test_video(videos, tiny_processor):
    names = [v[0] for v in VIDEOS]
    frames = [f"frames/{p.name}" for p in write_frames(videos / "frames", 5)]
    records = [_video_record(name) for name in names] + [_video_record(frames, fps=3)]
    path = videos / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    index, problems = build_index([path], tiny_processor, 4096)
    decoded, decoded_problems = build_index([path], tiny_processor, 4096, decode=True)
    assert problems == decoded_problems == []
    for name, values in index.arrays().items():
        assert np.array_equal(values, decoded.arrays()[name]), name
    reader = SampleReader(index, tiny_processor, 4096, False)
    for i in range(len(records)):
        sample = reader.sample(i)
        assert len(sample) == index.tokens[i]
        assert int(sample.video_grid_thw.prod(-1).sum()) == index.video_patches[i]
        assert sample.pixel_values_videos.shape[0] == index.video_patches[i]
    assert index.videos.tolist() == [1] * len(records)


def test_a_video_with_fewer_than_two_sampled_frames_is_an_error_naming_it(tmp_path,
                                                                          tiny_processor):
    write_video(tmp_path / "one.mp4", 1, 25)
    with pytest.raises(DataError, match=r"x:1: video .*one.mp4: 1 frame\(s\) sampled, Qwen3.5 "
                                        "needs at least temporal_patch_size 2"):
        parse_record(_video_record("one.mp4"), "x:1", tmp_path, tiny_processor, 4096)


def test_a_stream_shorter_than_its_metadata_fails_by_name_when_decoded(tmp_path, tiny_processor):
    write_video(tmp_path / "clip.mp4", 6, 25)
    video = VideoSource(path=tmp_path / "clip.mp4")
    meta = probe_video(video, "x:1")
    with pytest.raises(DataError, match=r"x:1: video .*clip.mp4: ends after 6 decoded frames, "
                                        r"before frame 8; its metadata \(stream.frames\) says 6"):
        decode_frames(video, meta, [0, 8], "x:1")
