"""The push into engines, without an engine: its buckets, their bytes, its job keys."""

from __future__ import annotations

import pytest
import torch

from vlmcp.cli import main
from vlmcp.config import job_from_dict
from vlmcp.engine import push_patch
from vlmcp.engine.push_wire import WireBucket
from vlmcp.errors import ConfigError
from vlmcp.training.weights.engine_push import (PushSettings, buckets_of, interleaved,
                                                 store_address)
from vlmcp.training.weights.push_delta import PushBase

MINIMAL = {"model": {"path": "ckpt"}, "data": {"train": "train.jsonl"}}


def _share() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b": torch.arange(3, dtype=torch.bfloat16),
            "c": torch.ones(40, dtype=torch.float32),
            "d": torch.full((2,), 7, dtype=torch.float32)}


def test_buckets_hold_whole_tensors_in_share_order_and_never_exceed_the_size_but_for_one_tensor():
    buckets = buckets_of(_share(), src=1, bucket_bytes=32)
    assert [b.names for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [b.tag for b in buckets] == [0, 1, 2] and {b.src for b in buckets} == {1}
    assert [b.size for b in buckets] == [30, 160, 8]
    assert buckets[0].dtype_names == ["float32", "bfloat16"]
    assert buckets[0].shapes == [[2, 3], [3]]


def test_a_packed_bucket_slices_back_into_the_exact_tensors():
    share = _share()
    for bucket in buckets_of(share, src=0, bucket_bytes=1 << 20):
        buffer, offset = bucket.pack(share), 0
        assert buffer.dtype == torch.uint8 and buffer.numel() == bucket.size
        for name, dtype, shape in zip(bucket.names, bucket.dtype_names, bucket.shapes):
            dtype = getattr(torch, dtype)
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            back = buffer[offset:offset + size].clone().view(dtype).reshape(shape)
            assert torch.equal(back, share[name])
            offset += size


def test_a_push_dtype_casts_floating_tensors_but_those_the_engine_holds_in_another_dtype():
    (bucket,) = buckets_of(_share(), src=0, bucket_bytes=1 << 20, dtype=torch.bfloat16,
                           held={"c": "float32", "a": "float16"})
    assert bucket.dtype_names == ["float16", "bfloat16", "float32", "bfloat16"]
    assert bucket.size == 6 * 2 + 3 * 2 + 40 * 4 + 2 * 2


def _settings(*urls: str, host: str | None = None) -> PushSettings:
    return PushSettings(urls, 1 << 20, 60.0, "wait", "error", host)


def test_the_push_store_listens_where_every_peer_reaches_it():
    # engines on this host, one process on this host: loopback only
    assert store_address(_settings("http://127.0.0.1:8000", "http://localhost:8001")) == (
        "127.0.0.1", "127.0.0.1")
    # publish.push_host names it outright
    assert store_address(_settings("http://127.0.0.1:8000", host="10.1.2.3")) == (
        "10.1.2.3", "10.1.2.3")


def test_the_ranks_buckets_interleave_round_robin_keeping_each_ranks_order():
    share = _share()
    per_rank = [buckets_of(share, 0, 32), buckets_of({"x": share["a"]}, 1, 32), []]
    order = [(b.src, b.tag) for b in interleaved(per_rank)]
    assert order == [(0, 0), (1, 0), (0, 1), (0, 2)]


def _problems(publish: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        job_from_dict({**MINIMAL, "publish": publish})
    return info.value.problems


def test_push_keys_without_engines_and_dir_keys_without_dir_are_named():
    assert _problems({"dir": "w", "bucket_mb": 64}) == [
        "config key 'publish.bucket_mb' is set but 'publish.engines' is empty"]
    assert _problems({"engines": ["http://h:1"], "keep": 2}) == [
        "config key 'publish.keep' is set but 'publish.dir' is not"]
    assert _problems({"every": 2}) == [
        "config key 'publish.every' is set but neither 'publish.dir' nor 'publish.engines' is"]


def test_a_dir_every_that_is_not_a_multiple_of_every_is_refused_naming_a_multiple():
    problems = _problems({"dir": "w", "engines": ["http://127.0.0.1:8000"], "every": 2,
                          "dir_every": 3})
    assert problems == ["config key 'publish.dir_every' is 3, not a multiple of 'publish.every' "
                        "(2): publish.dir records pushed steps; use 4 or another multiple"]
    job_from_dict({**MINIMAL, "publish": {"dir": "w", "engines": ["http://127.0.0.1:8000"],
                                          "every": 2, "dir_every": 6}})


def test_an_engine_that_is_not_a_base_url_or_named_twice_is_refused():
    problems = _problems({"engines": ["localhost:8000", "http://h:1", "http://h:1/"]})
    assert problems == ["config key 'publish.engines': 'localhost:8000' is not an engine's base "
                        "URL (http://HOST:PORT)",
                        "config key 'publish.engines' names 'http://h:1/' twice"]


def test_lora_pushes_into_engines_but_not_under_expert_parallelism_naming_the_way_that_works():
    job = job_from_dict({**MINIMAL, "lora": {"r": 4}, "publish": {"engines": ["http://h:1"]}})
    assert job.publish.engines == ["http://h:1"]
    with pytest.raises(ConfigError) as info:
        job_from_dict({**MINIMAL, "lora": {"r": 4, "target_parameters": ["mlp.experts.down_proj"]},
                       "parallel": {"ep_size": 2}, "publish": {"engines": ["http://h:1"]}})
    assert [p for p in info.value.problems if "publish.engines" in p] == [
        "config key 'publish.engines' with lora.r=4 and 'parallel.ep_size' 2: a LoRA run pushes "
        "its merged weights, which vlmcp does not compute under expert parallelism; train at "
        "ep_size 1, or publish the adapter to publish.dir and export it merged (vlmcp export "
        "--merge)"]


def test_engines_alone_publish_with_the_documented_defaults():
    job = job_from_dict({**MINIMAL, "publish": {"engines": ["http://h:1"]}})
    assert job.publish.dir is None and job.publish.dir_every is None
    assert (job.publish.bucket_mb, job.publish.engine_pause, job.publish.on_engine_error) == \
        (512.0, "wait", "error")


def test_the_engine_push_bench_refuses_flags_it_does_not_use(tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", "--engine-push", "--moe", "--hidden-size", "64", "--out", str(out)]) == 1
    assert "--engine-push does not use --moe, --hidden-size" in capsys.readouterr().err
    assert not out.exists()


def test_each_encoding_of_a_change_decodes_to_the_same_patch_and_the_cheapest_is_picked():
    new = (torch.arange(1000) % 100).to(torch.bfloat16).reshape(10, 100)
    base = new.clone()
    base.view(-1)[::7] += 1
    changed = push_patch.changed_indices(new, base)
    assert changed.tolist() == list(range(0, 1000, 7))
    for kind in (push_patch.DENSE, push_patch.INDEX, push_patch.BITMAP):
        values = new.view(-1) if kind == push_patch.DENSE else new.view(-1)[changed]
        parts = push_patch.encode(kind, values, changed, 1000)
        data = torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])
        assert data.numel() == push_patch.encoded_bytes(kind, 1000, changed.numel(),
                                                       torch.bfloat16)
        patch = push_patch.decode("w", kind, changed.numel(), (10, 100), torch.bfloat16, data)
        rebuilt = base.clone().view(-1)
        assert (patch.mask is not None) == (kind == push_patch.BITMAP)
        assert patch.flat_indices().tolist() == (list(range(1000)) if patch.dense
                                                 else changed.tolist())
        rebuilt[patch.flat_indices()] = patch.values
        assert torch.equal(rebuilt.view(10, 100), new)
    # 143 of 1000 bf16 elements: the bitmap (125 + 286 bytes) beats indices (858) and dense
    assert push_patch.cheapest(1000, 143, torch.bfloat16) == push_patch.BITMAP
    assert push_patch.cheapest(1000, 10, torch.bfloat16) == push_patch.INDEX
    assert push_patch.cheapest(1000, 960, torch.bfloat16) == push_patch.DENSE


def test_a_region_locates_checkpoint_indices_in_a_narrowed_or_transposed_view():
    tensor = torch.arange(24).reshape(4, 6)
    for view in (tensor.narrow(0, 2, 2), tensor.narrow(1, 1, 3), tensor.t(),
                 tensor.narrow(1, 2, 2).t()):
        region = push_patch.Region.of(view)
        indices = torch.arange(24)
        inside, multi = region.locate(indices)
        assert sorted(indices[inside].tolist()) == sorted(view.reshape(-1).tolist())
        # the element at each multi-index of the view is the checkpoint element located there
        assert [view[tuple(m)].item() for m in multi.tolist()] == indices[inside].tolist()
        assert torch.equal(region.read(tensor.reshape(-1)), view)


def test_a_sparse_bucket_packs_its_encoded_tensors_and_reads_back_as_patches():
    base = PushBase()
    share = {"a": torch.zeros(64, dtype=torch.float32), "b": torch.ones(8, 8),
             "c": torch.zeros(4)}
    base.advance(1, share, {"a": torch.bfloat16, "c": torch.bfloat16})
    assert base.nbytes == 64 * 2 + 64 * 4 + 4 * 2
    later = {name: tensor.clone() for name, tensor in share.items()}
    later["a"][[3, 40]] = 2.0
    later["c"] += 1.0  # every element: sent dense
    delta = base.delta(later)
    assert (delta.changed, delta.total) == (6, 132) and list(delta.parts) == ["a", "c"]
    (bucket,) = delta.buckets(src=1, bucket_bytes=1 << 20)
    assert bucket.encodings == [["index", 2], ["dense"]] and bucket.size == 2 * (4 + 2) + 4 * 2
    bucket = WireBucket(**bucket.to_json())
    patch, dense = bucket.patches(bucket.pack(delta.parts))
    assert patch.indices.tolist() == [3, 40] and patch.values.tolist() == [2.0, 2.0]
    assert patch.values.dtype == torch.bfloat16
    assert dense.dense and dense.values.tolist() == [1.0] * 4
