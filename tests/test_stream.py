"""Streaming data: header-based image token counts equal real processing, the length index is
cached and reused without reading the data again, and DataLoader workers load the same packs as
the training process itself."""

from __future__ import annotations

import builtins
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.helpers.images import save_png
from tests.helpers.launching import run_vlmcp, tiny_job, write_job
from vlmcp.bench.data_scale import write_synthetic_dataset
from vlmcp.data.image_size import grid_for_size, header_grid
from vlmcp.data.index import build_index
from vlmcp.data.index_cache import obtain_index
from vlmcp.data.pack import PackedDataset
from vlmcp.data.processor import image_processor_kwargs
from vlmcp.data.sources import iter_records
from vlmcp.data.stream import SampleReader, load_packs
from vlmcp.errors import DataError

SETTINGS = {"max_seq_len": 160, "truncate": True}

#: (width, height): square, portrait, landscape, tiny (below min_pixels), huge for the bounds
#: (above max_pixels), odd sides, thin strips, a 1x1 pixel.
SIZES = [(32, 32), (64, 96), (96, 64), (7, 5), (1, 1), (1000, 700), (513, 257), (33, 31),
         (400, 3), (3, 400), (2048, 64), (300, 300)]


def _processor(**overrides) -> Qwen2VLImageProcessorPil:
    """A Qwen3.5-style image processor (patch 16, merge 2) with the given settings."""
    config = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
              "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
              "size": {"shortest_edge": 64 * 64, "longest_edge": 320 * 320}, **overrides}
    return Qwen2VLImageProcessorPil(**image_processor_kwargs(config))


@pytest.mark.parametrize("image_processor", [
    _processor(),
    _processor(size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256}),
    _processor(size={"shortest_edge": 65536, "longest_edge": 16777216}),  # Qwen3.5's bounds
], ids=["mid-bounds", "tiny-checkpoint-bounds", "qwen3.5-bounds"])
def test_grid_from_size_equals_the_processors_grid(image_processor):
    for width, height in SIZES:
        image = Image.new("RGB", (width, height), (width % 256, height % 256, 7))
        expected = image_processor([image], return_tensors="pt")["image_grid_thw"][0].tolist()
        assert list(grid_for_size(width, height, image_processor)) == expected, (width, height)


def test_grid_without_resizing_equals_the_processor_and_rejects_what_it_rejects():
    image_processor = _processor(do_resize=False)
    image = Image.new("RGB", (64, 96))
    expected = image_processor([image], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert list(grid_for_size(64, 96, image_processor)) == expected == [1, 6, 4]
    with pytest.raises(ValueError):
        image_processor([Image.new("RGB", (48, 64))], return_tensors="pt")
    with pytest.raises(ValueError, match="not a multiple"):
        grid_for_size(48, 64, image_processor)
    with pytest.raises(ValueError, match="aspect ratio"):
        grid_for_size(1, 300, _processor())


def test_header_grid_reads_png_and_jpeg_headers_like_the_processor(tmp_path, tiny_processor):
    for i, (width, height) in enumerate(SIZES[:6]):
        for suffix in (".png", ".jpg"):
            path = tmp_path / f"img{i}{suffix}"
            Image.new("RGB", (width, height), (i, 2 * i, 3)).save(path)
            with Image.open(path) as image:
                _, grid = tiny_processor.process_images([image.convert("RGB")])
            assert list(header_grid(path, "s:1", tiny_processor.image_processor)) == \
                grid[0].tolist()
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(DataError, match="s:1: cannot decode image"):
        header_grid(tmp_path / "bad.png", "s:1", tiny_processor.image_processor)


def _records(n: int) -> list[dict]:
    """Chat records with 0-2 images of varied sizes; record 3's reply is truncated."""
    records = []
    for i in range(n):
        images = [f"img/{(i + k) % 5}.png" for k in range(i % 3)]
        text = "<image>" * len(images) + f"Question {i}: " + "word " * (i % 7)
        answer = f"Answer {i}" + " long" * (200 if i == 3 else 0)
        records.append({"messages": [{"role": "user", "content": text},
                                     {"role": "assistant", "content": answer}],
                        "images": images})
    return records


@pytest.fixture
def dataset(tmp_path) -> Path:
    """A 50-record JSONL file and its 5 images of different sizes."""
    for k, size in enumerate([(32, 32), (64, 96), (200, 120), (17, 300), (33, 64)]):
        save_png(tmp_path / "img" / f"{k}.png", *size, seed=k)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(50)))
    return path


def test_header_index_equals_the_index_of_decoded_images(dataset, tiny_processor):
    from_headers, problems = build_index([dataset], tiny_processor, 160, truncate=True)
    decoded, decoded_problems = build_index([dataset], tiny_processor, 160, truncate=True,
                                            decode=True)
    assert problems == decoded_problems == []
    assert len(from_headers) == 50
    for name, values in from_headers.arrays().items():
        assert np.array_equal(values, decoded.arrays()[name]), name
    assert from_headers.tokens[3] == 160 and from_headers.images.sum() > 0


def test_a_json_array_index_reads_each_record_back_from_its_span(tmp_path, tiny_processor):
    save_png(tmp_path / "img" / "0.png", 32, 32)
    records = [{"messages": [{"role": "user", "content": f"<image>Ünïcödé {i} ✓"},
                             {"role": "assistant", "content": "ja"}], "image": "img/0.png"}
               for i in range(4)]
    path = tmp_path / "data.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(records, indent=1, ensure_ascii=False).encode())
    index, problems = build_index([path], tiny_processor, 64)
    assert problems == []
    reader = SampleReader(index, tiny_processor, 64, False)
    expected = list(iter_records(path))
    for i, (label, _) in enumerate(expected):
        assert index.source(i) == label
        assert reader.sample(i).source == label


def _opened_files(monkeypatch) -> list[str]:
    """Records the path of every file opened from now on (Python-level opens, PIL's too)."""
    opened: list[str] = []
    real_open = io.open

    def recording_open(file, *args, **kwargs):
        opened.append(os.fspath(file) if isinstance(file, (str, os.PathLike)) else repr(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", recording_open)
    monkeypatch.setattr(io, "open", recording_open)
    return opened


def test_the_cached_index_is_reused_without_reading_the_data_or_images(
        dataset, tiny_processor, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    caplog.set_level("INFO", logger="vlmcp.data.index_cache")
    first = obtain_index([dataset], tiny_processor, SETTINGS, cache, may_build=True)
    assert first.built and first.problems == [] and first.path.is_file()
    assert "length index: built in" in caplog.text

    opened = _opened_files(monkeypatch)
    second = obtain_index([dataset], tiny_processor, SETTINGS, cache, may_build=False)
    monkeypatch.undo()
    assert not second.built and second.path == first.path
    assert f"length index: loaded from cache {first.path}" in caplog.text
    assert opened == [str(first.path)], opened  # the cache file only: no data, no image
    for name, values in first.index.arrays().items():
        assert np.array_equal(values, second.index.arrays()[name]), name

    os.utime(dataset)  # touched, same bytes: still current (the content hash decides)
    assert not obtain_index([dataset], tiny_processor, SETTINGS, cache, may_build=False).built
    other = obtain_index([dataset], tiny_processor, {**SETTINGS, "max_seq_len": 128}, cache,
                         may_build=True)
    assert other.built and other.path != first.path
    dataset.write_text(dataset.read_text().replace("Answer 7", "Answer seven"))
    stale = obtain_index([dataset], tiny_processor, SETTINGS, cache, may_build=False)
    assert stale.index is None and "data changed" in stale.problems[0]
    assert obtain_index([dataset], tiny_processor, SETTINGS, cache, may_build=True).built


def _assert_same_batches(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.sample_ids == y.sample_ids and x.seq_lens == y.seq_lens
        for name in ("input_ids", "targets", "position_ids", "mm_token_type_ids",
                     "pixel_values", "image_grid_thw"):
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None and v is None) or torch.equal(u, v), name


@pytest.mark.e2e
def test_loader_workers_give_the_batches_of_in_process_loading(dataset, tiny_processor):
    index, _ = build_index([dataset], tiny_processor, 160, truncate=True)
    reader = SampleReader(index, tiny_processor, 160, True)
    plan = PackedDataset(index.tokens, 160, dp_rank=1, dp_size=2, shuffle=True, seed=3)
    packs = plan.rank_packs(0)
    in_process = list(load_packs(reader, packs, num_workers=0, prefetch_factor=2))
    with_workers = list(load_packs(reader, packs, num_workers=2, prefetch_factor=1))
    _assert_same_batches(in_process, with_workers)
    assert [b.num_tokens for b in in_process] == \
        [sum(int(index.tokens[i]) for i in pack) for pack in packs]


@pytest.mark.e2e
def test_a_sample_that_changed_since_the_index_fails_by_name_in_a_worker(dataset, tiny_processor):
    index, _ = build_index([dataset], tiny_processor, 160, truncate=True)
    reader = SampleReader(index, tiny_processor, 160, True, cache_path="/cache/index-x.npz")
    save_png(dataset.parent / "img" / "1.png", 300, 200)  # a new size: another token count
    (dataset.parent / "img" / "2.png").write_bytes(  # same header, truncated pixels
        (dataset.parent / "img" / "2.png").read_bytes()[:60])
    users = [i for i in range(len(index)) if i % 3 and i != 3]
    with pytest.raises(DataError, match=r"data.jsonl:\d+: .*(length index /cache/index-x.npz"
                                        r"|cannot decode image)"):
        list(load_packs(reader, [[i] for i in users], num_workers=1, prefetch_factor=1))


def test_synthetic_scale_dataset_has_distinct_512px_images_and_indexes(tmp_path, tiny_processor):
    data = write_synthetic_dataset(tmp_path, 70)
    images = sorted((tmp_path / "images").iterdir())
    assert len(images) == 70 and len({p.read_bytes() for p in images}) == 70
    with Image.open(images[65]) as image:
        assert image.size == (512, 512) and image.getpixel((3, 3)) == (1 * 37, 1 * 91, 1 * 53)
    index, problems = build_index([data], tiny_processor, 256)
    assert problems == [] and len(index) == 70 and set(index.images.tolist()) == {1}


@pytest.mark.e2e
def test_a_pack_that_fails_to_load_stops_both_ranks_with_its_sample(
        tiny_checkpoint, make_jsonl, tmp_path):
    """The image's header is intact (the index passes) but its pixels are cut off, so loading
    its pack fails on the ranks that load it; every rank stops at that step, none hangs."""
    good = {"messages": [{"role": "user", "content": "<image>Which digit?"},
                         {"role": "assistant", "content": "7"}], "images": ["img/a.png"]}
    bad = {**good, "images": ["img/cut.png"]}
    data = make_jsonl([good, good, bad, good], {"img/a.png": (32, 32), "img/cut.png": (64, 64)})
    cut = tmp_path / "img" / "cut.png"
    cut.write_bytes(cut.read_bytes()[:60])
    job = write_job(tmp_path / "job.json", tiny_job(
        tiny_checkpoint, data, tmp_path / "out", data={"max_seq_len": 40, "num_workers": 1},
        parallel={"sp_size": 2}, train={"max_steps": 4}))
    result = run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2, timeout=240)
    assert result.returncode != 0
    errors = result.stderr.split("error: ")[1:]  # (rank 0's progress bar may precede it)
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("loading the packs of step")
    assert f"{data}:3: cannot decode image {cut}" in errors[0]


@pytest.mark.e2e
def test_a_held_out_sample_that_fails_to_load_stops_both_ranks_at_the_evaluation(
        tiny_checkpoint, make_jsonl, tmp_path):
    """data.eval is indexed from image headers, not decoded up front: the run starts with an
    eval image whose pixels are cut off, trains its first step, and then every rank stops at the
    evaluation with one error naming that held-out sample; none hangs."""
    good = {"messages": [{"role": "user", "content": "<image>Which digit?"},
                         {"role": "assistant", "content": "7"}], "images": ["img/a.png"]}
    train = make_jsonl([good] * 4, {"img/a.png": (32, 32), "img/cut.png": (64, 64)})
    held_out = make_jsonl([good, {**good, "images": ["img/cut.png"]}], name="eval.jsonl")
    cut = tmp_path / "img" / "cut.png"
    cut.write_bytes(cut.read_bytes()[:60])
    job = write_job(tmp_path / "job.json", tiny_job(
        tiny_checkpoint, train, tmp_path / "out",
        data={"eval": str(held_out), "max_seq_len": 40, "num_workers": 0},
        parallel={"sp_size": 2}, train={"max_steps": 2, "eval_every": 1}))
    result = run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2, timeout=240)
    assert result.returncode != 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1]
    errors = result.stderr.split("error: ")[1:]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("evaluation: ")
    assert f"{held_out}:2: cannot decode image {cut}" in errors[0]
