"""The gloo weight push (vLLM backend "vlmcp_gloo", `vlmcp/engine/vllm_gloo.py`) against a real vLLM
CPU server from the engine venv, with vlmcp's plugin installed there (`make engine`). This test
plays the trainer with plain torch and push_wire's `Session`: it hosts the TCPStore, holds two trainer ranks (0 and 1, in
threads) of a gloo group whose rank 2 is the server's worker, drives the weight-transfer routes
over HTTP and sends the buckets as the protocol says (each rank its own buckets, interleaved in
the list).

For a dense and an MoE tiny engine-compatible Qwen3.5 VLM, one server each, started on
checkpoint A: B's weights pushed into it (streamed: received during the update; staged: received
before it, into the worker's memory) give the very weights (`/weight_checker` checksums) and
logprobs that vLLM's filesystem reload of B gives (plus the CPU expert repack, as
`VllmHttpClient` does; for the MoE the push's own repack after finishing makes it exact). A bucket
naming a parameter the model lacks is one error naming it, and the server serves on with the
weights it had. One server per model (about 20-50 s to start on 2 cores).
"""

from __future__ import annotations

import datetime
import json
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tests.helpers.engine_reference import (NEEDS_ENGINE, NEW_TOKENS, TAU, demo_allowed_ids,
                                            text_prompt_ids)
from vlmcp.data.processor import load_processor
from vlmcp.engine.push_wire import PROTOCOL, Session
from vlmcp.engine.venv import engine_python
from vlmcp.engine.vllm_http import CPU_ARGS, PUSH_ARGS, VllmServer
from vlmcp.model.tiny import VLLM_CPU_HEADS, build_tiny_checkpoint
from vlmcp.parallel.comm import free_local_port
from vlmcp.training.weights.push_check import check_share
from vlmcp.training.weights.push_delta import PushBase

ENGINE = engine_python()
pytestmark = [pytest.mark.e2e, NEEDS_ENGINE]

#: Trainer ranks in the push group (the worker is rank TRAINERS), and a bucket's size cap.
TRAINERS = 2
BUCKET_BYTES = 64 * 1024
TIMEOUT_S = 120.0


class HttpError(Exception):
    """A route answered with an HTTP error: its status and body."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body


def _post(url: str, path: str, body: dict[str, Any] | None = None,
          timeout: float = TIMEOUT_S) -> Any:
    request = urllib.request.Request(url + path, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"},
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            text = answer.read().decode()
    except urllib.error.HTTPError as exc:
        raise HttpError(exc.code, exc.read().decode(errors="replace")) from None
    return json.loads(text) if text else None


def _get(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=TIMEOUT_S) as answer:
        return json.loads(answer.read().decode())


def _buckets(weights: dict[str, torch.Tensor]) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """The checkpoint's tensors in name order, cut into buckets of about BUCKET_BYTES, dealt to
    the trainer ranks round-robin: (the bucket as the worker is told, the bytes its src sends)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(weights):
        nbytes = weights[name].numel() * weights[name].element_size()
        if groups[-1] and size + nbytes > BUCKET_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    buckets = []
    for tag, names in enumerate(groups):
        tensors = [weights[name].contiguous() for name in names]
        buffer = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
        buckets.append(({"src": tag % TRAINERS, "tag": tag, "names": names,
                         "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors],
                         "shapes": [list(t.shape) for t in tensors]}, buffer))
    return buckets


def _trainer_groups(url: str, prefix: str, staged: list[dict[str, Any]] | None = None,
                    extra: dict[str, Any] | None = None) -> list[Any]:
    """Trainer ranks 0..TRAINERS-1 of a fresh push group with the server's worker, formed as
    vlmcp/engine/push_wire.py says (init_info sent to the server while the ranks wait for its
    worker's ready mark and join; `staged`: the buckets of a staged update; `extra`: more
    init_info, such as a sparse push's mode, base and token), then the store."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", free_local_port(), is_master=True, timeout=timeout,
                          wait_for_workers=False)
    prefix = f"{prefix}/"
    init_info = {"protocol": PROTOCOL, "master_address": "127.0.0.1",
                 "master_port": store.port, "store_prefix": prefix, "rank_offset": TRAINERS,
                 "world_size": TRAINERS + 1, "timeout_s": TIMEOUT_S, "attempt": 0}
    if staged is not None:
        init_info["buckets"] = staged
    init_info.update(extra or {})
    groups: list[Any] = [None] * TRAINERS
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            # A store client of its own, as a trainer rank (a process of its own) has.
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timeout)
            session = Session(client, prefix, rank, TRAINERS, TIMEOUT_S, workers=1)
            session.wait_key("try0/ready/0", "the worker's ready mark")
            groups[rank] = session.form_group(0)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(TRAINERS)]
    for thread in threads:
        thread.start()
    _post(url, "/init_weight_transfer_engine", {"init_info": init_info})
    for thread in threads:
        thread.join()
    assert not errors, errors
    groups.append(store)  # keep the store alive with the groups
    return groups


def _push(url: str, weights: dict[str, torch.Tensor], version: str, prefix: str,
          staged: bool, extra: dict[str, Any] | None = None,
          buckets: list[tuple[dict[str, Any], torch.Tensor]] | None = None
          ) -> tuple[float, list[dict[str, Any]]]:
    """Push `weights` (or the given `buckets`) into the server as the trainer does, streamed
    (received during the update) or staged (received before it), with more init_info `extra`;
    returns the seconds it took, and the worker's report when the push holds."""
    started = datetime.datetime.now()
    buckets = buckets if buckets is not None else _buckets(weights)
    listed = [b for b, _ in buckets]
    groups = _trainer_groups(url, prefix, listed if staged else None, extra)
    answer: dict[str, Any] = {}

    def update() -> None:
        _post(url, "/start_weight_update")
        try:
            answer["ok"] = _post(url, "/update_weights", {"update_info": (
                {"staged": True} if staged else {"buckets": listed})})
        except BaseException as exc:  # noqa: BLE001 (asserted below)
            answer["error"] = exc

    def send(rank: int) -> None:
        for bucket, buffer in buckets:
            if bucket["src"] == rank:
                groups[rank].send([buffer], TRAINERS, bucket["tag"]).wait()

    senders = [threading.Thread(target=send, args=(rank,)) for rank in range(TRAINERS)]
    threads = senders if staged else [threading.Thread(target=update), *senders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=2 * TIMEOUT_S)
    if staged:  # every byte is in the worker's memory before the update starts
        update()
    assert "error" not in answer, answer["error"]
    _post(url, "/finish_weight_update", {"weight_version": version})
    _post(url, "/shutdown_weight_transfer_engine")
    _fresh_caches(url)
    seconds = (datetime.datetime.now() - started).total_seconds()
    reports = []
    if (extra or {}).get("hold"):
        session = Session(groups[-1], f"{prefix}/", 0, TRAINERS, TIMEOUT_S, workers=1)
        reports.append(json.loads(session.wait_key("report/0", "the worker's report")))
    return seconds, reports


def _fresh_caches(url: str) -> None:
    _post(url, "/reset_prefix_cache")
    _post(url, "/reset_encoder_cache")


def _reload_from_disk(url: str, checkpoint: Path, moe: bool) -> None:
    """vLLM's filesystem reload of `checkpoint`, then the CPU expert repack, as VllmHttpClient."""
    _post(url, "/collective_rpc", {"method": "reload_weights",
                                   "kwargs": {"weights_path": str(checkpoint)}})
    if moe:
        _post(url, "/collective_rpc", {"method": "repack_cpu_moe_experts"})
    _fresh_caches(url)


def _checksums(url: str) -> dict[str, str]:
    return _post(url, "/weight_checker", {"action": "checksum"})["checksums"]


def _logprobs(url: str, model: Path, prompt: list[int], allowed: list[int]
              ) -> tuple[list[int], list[float]]:
    out = _post(url, "/v1/completions", {"model": str(model), "prompt": prompt,
                                         "max_tokens": NEW_TOKENS, "temperature": TAU,
                                         "seed": 7, "logprobs": 0, "return_token_ids": True,
                                         "allowed_token_ids": allowed})
    (choice,) = out["choices"]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module", params=["dense", "moe"])
def served(request, tmp_path_factory):
    """A server started on checkpoint A of the model (dense or MoE), with B beside it."""
    moe = request.param == "moe"
    root = tmp_path_factory.mktemp(f"gloo_push_{request.param}")
    a = build_tiny_checkpoint(root / "A", moe=moe, seed=1, **VLLM_CPU_HEADS)
    b = build_tiny_checkpoint(root / "B", moe=moe, seed=2, **VLLM_CPU_HEADS)
    server = VllmServer(ENGINE, a, root / "server.log",
                        args=(*CPU_ARGS, *PUSH_ARGS, "--max-model-len", "512",
                              "--seed", "0"))
    seconds = server.start()
    processor = load_processor(a)
    yield {"url": server.url, "moe": moe, "A": a, "B": b, "log": root / "server.log",
           "prompt": text_prompt_ids(processor), "allowed": demo_allowed_ids(processor),
           "start_s": seconds}
    server.stop()


@pytest.mark.parametrize("staged", [False, True], ids=["streamed", "staged"])
def test_pushing_b_over_gloo_gives_the_weights_and_logprobs_of_vllms_own_reload_of_b(served,
                                                                                       staged):
    url, moe, a, b = served["url"], served["moe"], served["A"], served["B"]
    sample = lambda: _logprobs(url, a, served["prompt"], served["allowed"])  # noqa: E731
    _reload_from_disk(url, a, moe)  # A, also after the other way's push of B
    on_a = _checksums(url)
    sampled_a = sample()
    _reload_from_disk(url, b, moe)
    on_b = _checksums(url)
    sampled_b = sample()
    assert on_b != on_a and sampled_b != sampled_a
    _reload_from_disk(url, a, moe)
    assert _checksums(url) == on_a and sample() == sampled_a  # back to A exactly

    seconds, _ = _push(url, load_file(b / "model.safetensors"), "B", f"push-{staged}", staged)
    assert _get(url, "/weight_info")["weight_version"] == "B"
    pushed = _checksums(url)
    assert sorted(n for n in pushed if pushed[n] != on_b[n]) == []
    assert sample() == sampled_b
    print(f"{'moe' if moe else 'dense'}: server start {served['start_s']:.1f} s, "
          f"push ({'staged' if staged else 'streamed'}) {seconds:.2f} s")


def test_a_bucket_naming_a_parameter_the_model_lacks_is_one_error_and_the_server_serves_on(
        served):
    url, a = served["url"], served["A"]
    before, sampled = _checksums(url), _logprobs(url, a, served["prompt"], served["allowed"])
    version = _get(url, "/weight_info")["weight_version"]
    groups = _trainer_groups(url, "bad")
    bad = "model.language_model.layers.0.no_such_module.weight"
    weight = torch.ones(4, 4, dtype=torch.bfloat16)
    bucket = {"src": 0, "tag": 0, "names": [bad], "dtype_names": ["bfloat16"],
              "shapes": [[4, 4]]}
    _post(url, "/start_weight_update")
    failed: dict[str, Any] = {}

    def update() -> None:
        try:
            _post(url, "/update_weights", {"update_info": {"buckets": [bucket]}})
        except HttpError as exc:
            failed["error"] = exc

    thread = threading.Thread(target=update)
    thread.start()
    groups[0].send([weight.reshape(-1).view(torch.uint8)], TRAINERS, 0).wait()
    thread.join(timeout=2 * TIMEOUT_S)
    error = failed["error"]
    assert error.status >= 400
    assert "bucket 0 (src 0, tag 0" in error.body and bad in error.body, error.body
    assert "init it again" in error.body
    # The server serves on with the weights it had, and a new update needs a new group.
    assert _get(url, "/weight_info")["weight_version"] == version
    assert _checksums(url) == before
    assert _logprobs(url, a, served["prompt"], served["allowed"]) == sampled
    with pytest.raises(HttpError, match="no push group"):
        _post(url, "/start_weight_update")
        _post(url, "/update_weights", {"update_info": {"buckets": [bucket]}})


def _held(token: str, **more: Any) -> dict[str, Any]:
    return {"hold": True, "verify": True, "token": token, **more}


def _wire(buckets: list[Any], share: dict[str, Any]) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """WireBuckets and what they carry as the (bucket, bytes) pairs `_push` sends."""
    return [(b.to_json(), b.pack(share)) for b in buckets]


def _nudged(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with every 97th element of every third tensor times 1.5 (a change bf16 sees:
    sent as indices), and every third element of the next ones (sent as a bitmap)."""
    out = {}
    for index, (name, tensor) in enumerate(sorted(weights.items())):
        tensor = tensor.clone()
        if index % 3 == 0:
            tensor.view(-1)[::97] *= 1.5
        elif index % 3 == 1:
            tensor.view(-1)[::3] *= 1.5
        out[name] = tensor
    return out


def test_a_sparse_patch_after_a_held_push_gives_vllms_reload_and_every_checksum_matches(
        served, tmp_path):
    url, moe, a, b = served["url"], served["moe"], served["A"], served["B"]
    sample = lambda: _logprobs(url, a, served["prompt"], served["allowed"])  # noqa: E731
    on_b = load_file(b / "model.safetensors")
    _, reports = _push(url, on_b, "1", "held-1", True, _held("run/1"))
    checked = check_share(on_b, reports, "run/1", digests=True)
    assert checked.problems == [] and checked.patchable
    assert checked.dtypes["model.language_model.layers.0.linear_attn.A_log"] == torch.float32
    assert checked.dtypes["model.language_model.layers.1.self_attn.o_proj.weight"] == \
        torch.bfloat16

    on_c = _nudged(on_b)
    base = PushBase()
    base.advance(1, on_b, checked.dtypes)
    delta = base.delta(on_c)
    assert 0 < delta.changed < delta.total / 4
    assert {encoding[0] for encoding in delta.encodings.values()} >= {"index", "bitmap"}
    _, reports = _push(url, on_c, "2", "sparse-2", True,
                       _held("run/2", mode="sparse", base="run/1"),
                       buckets=_wire(delta.buckets(0, BUCKET_BYTES), delta.parts))
    assert check_share(on_c, reports, "run/2", digests=True).problems == []
    patched, sampled = _checksums(url), sample()
    c = tmp_path / "C"
    shutil.copytree(b, c)
    save_file(on_c, str(c / "model.safetensors"), metadata={"format": "pt"})
    _reload_from_disk(url, c, moe)
    assert _checksums(url) == patched and sample() == sampled


def test_zeros_pushed_for_one_o_proj_fail_the_delivery_check_naming_it_where_weight_checker_sees_nothing(
        served):
    url, b = served["url"], served["B"]
    on_b = load_file(b / "model.safetensors")
    _push(url, on_b, "3", "held-3", True, _held("run/3"))
    right = _checksums(url)
    zeroed = "model.language_model.layers.1.self_attn.o_proj.weight"
    sent = {**on_b, zeroed: torch.zeros_like(on_b[zeroed])}
    _, reports = _push(url, sent, "4", "held-4", True, _held("run/4"))
    assert _checksums(url) == right  # vLLM's own check: the CPU linears' weights are not there
    problems = check_share(on_b, reports, "run/4", digests=True).problems
    assert len(problems) == 1 and problems[0].startswith(zeroed), problems
