"""The control plane of a weight push (`weight_push_http.VllmPushControl`) against a stand-in vLLM
server (`tests.helpers.fake_vllm.FakeVllm`), without vLLM: the calls of one push and their order
(wait and keep mode), the version label and the bodies sent, the per-phase times, and every
failure as one EngineError line naming the server and the step: unreachable, timed out, vLLM's
message with the HTTP status; a failed start resumes the old weights, a failure after the update
started leaves the server paused; releasing the group never raises.
"""

from __future__ import annotations

import logging
import time

import pytest

from tests.helpers.fake_vllm import HANG, FakeVllm
from vlmcp.engine.weight_push_http import PAUSED_NOTE, VllmPushControl
from vlmcp.errors import EngineError
from vlmcp.parallel.comm import free_local_port

#: Per request: short, so that a hung endpoint fails the test fast.
TIMEOUT_S = 0.3
#: What the trainer would send (its shape does not matter to the control plane).
INIT_INFO = {"master_address": "127.0.0.1", "master_port": 29555, "store_prefix": "push/7",
             "rank_offset": 2, "world_size": 3, "timeout_s": 60.0}
UPDATE_INFO = {"buckets": [{"src": 0, "tag": 0, "names": ["lm_head.weight"],
                            "dtype_names": ["bfloat16"], "shapes": [[8, 4]]}]}
#: A /pause, /resume or weight-transfer failure as vLLM's handlers write it.
VLLM_500 = (500, {"error": "Failed to start weight update: engine dead"})


def _push(fake: FakeVllm, step: int = 7, **kwargs: float | str) -> VllmPushControl:
    """One whole push of `step` into `fake` (probe to release); the control, for its times."""
    control = VllmPushControl(fake.url, timeout_s=TIMEOUT_S, **kwargs)
    control.probe()
    control.init_transfer(INIT_INFO)
    control.begin(step)
    control.update(UPDATE_INFO)
    control.end(step)
    control.release()
    return control


def _failure(fake: FakeVllm, step: int = 7) -> str:
    """The one line of the EngineError a push of `step` into `fake` raises."""
    with pytest.raises(EngineError) as info:
        _push(fake, step)
    (message,) = info.value.problems
    assert "\n" not in message
    return message


@pytest.mark.parametrize("mode", ["wait", "keep"])
def test_a_push_pauses_starts_updates_finishes_resets_both_caches_and_resumes_in_that_order(mode):
    with FakeVllm() as fake:
        _push(fake, pause_mode=mode)
    reset = "/reset_prefix_cache" + ("?reset_running_requests=true" if mode == "keep" else "")
    assert fake.paths() == ["/get_world_size?include_dp=true", "/init_weight_transfer_engine",
                            f"/pause?mode={mode}", "/start_weight_update",
                            "/update_weights", "/finish_weight_update", reset,
                            "/reset_encoder_cache", "/resume", "/shutdown_weight_transfer_engine"]
    bodies = dict(fake.calls)
    assert bodies["/init_weight_transfer_engine"] == {"init_info": INIT_INFO}
    assert bodies["/update_weights"] == {"update_info": UPDATE_INFO}


def test_the_finished_update_is_labelled_with_the_step_as_text():
    with FakeVllm() as fake:
        _push(fake, step=12)
    assert dict(fake.calls)["/finish_weight_update"] == {"weight_version": "12"}


def test_every_phase_is_timed_and_the_downtime_spans_pause_to_resume():
    with FakeVllm() as fake:
        control = _push(fake)
    assert set(control.times) == {"pause", "start", "update", "finish", "caches", "resume"}
    assert control.downtime_s is not None
    assert control.downtime_s >= sum(control.times.values()) > 0


def test_probe_returns_the_engines_worker_count_over_every_data_parallel_replica():
    with FakeVllm({"/get_world_size": (200, {"world_size": 4})}) as fake:
        assert VllmPushControl(fake.url, timeout_s=TIMEOUT_S).probe() == 4
    assert fake.paths() == ["/get_world_size?include_dp=true"]


@pytest.mark.parametrize("answer", [{"world_size": 0}, {"world_size": "1"}, {}],
                         ids=["zero", "text", "missing"])
def test_a_probe_answer_that_is_not_a_worker_count_is_an_error(answer):
    with FakeVllm({"/get_world_size": (200, answer)}) as fake:
        with pytest.raises(EngineError, match="not a worker count") as info:
            VllmPushControl(fake.url, timeout_s=TIMEOUT_S).probe()
    assert fake.url in str(info.value)


def test_an_unreachable_engine_is_one_error_naming_its_url_checked_before_the_push():
    url = f"http://127.0.0.1:{free_local_port()}"
    with pytest.raises(EngineError) as info:
        VllmPushControl(url, timeout_s=TIMEOUT_S).probe()
    (message,) = info.value.problems
    assert message.startswith(f"vLLM server {url} is unreachable (")
    assert message.endswith("(checked before the weight push; nothing was sent)")


@pytest.mark.parametrize("error", [
    "Invalid weight transfer backend: vlmcp_gloo. Available engines: ['nccl', 'ipc']",
    "Weight transfer not configured. Please set weight_transfer_config to enable weight "
    "transfer."], ids=["unknown-backend", "no-backend"])
def test_a_server_without_the_backend_is_told_how_to_start(error):
    with FakeVllm({"/init_weight_transfer_engine": (500, {"error": {"message": error}})}) as fake:
        message = _failure(fake)
    assert message.startswith(f"vLLM server {fake.url}/init_weight_transfer_engine: HTTP 500: "
                              f"{error}; the workers of {fake.url} did not join")
    assert message.endswith("(start the server with --weight-transfer-config "
                            "'{\"backend\": \"vlmcp_gloo\"}' and VLLM_SERVER_DEV_MODE=1)")


def test_another_init_failure_carries_vllms_message_without_the_backend_hint():
    with FakeVllm({"/init_weight_transfer_engine": (500, {"error": "store timed out"})}) as fake:
        message = _failure(fake)
    assert "HTTP 500: store timed out; the workers of" in message
    assert "--weight-transfer-config" not in message


def test_a_hung_pause_is_an_error_saying_it_timed_out_naming_url_and_step():
    with FakeVllm({"/pause": HANG}) as fake:
        started = time.perf_counter()
        message = _failure(fake)
        seconds = time.perf_counter() - started
    assert message.startswith(f"vLLM server {fake.url}: POST /pause?mode=wait "
                              f"timed out after {TIMEOUT_S:g} s")
    assert f"pausing {fake.url} for the push of step 7 failed" in message
    assert seconds < 3.0


def test_a_failing_start_resumes_the_intact_old_weights_and_raises_vllms_message():
    with FakeVllm({"/start_weight_update": VLLM_500}) as fake:
        message = _failure(fake)
    assert fake.paths()[-3:] == ["/pause?mode=wait", "/start_weight_update",
                                 "/resume"]
    assert message.startswith(f"vLLM server {fake.url}/start_weight_update: HTTP 500: Failed to "
                              "start weight update: engine dead; the push of step 7 into "
                              f"{fake.url} did not start: the old weights are intact and the "
                              "server was resumed")


def test_a_failing_start_whose_resume_fails_too_says_the_server_stays_paused():
    with FakeVllm({"/start_weight_update": VLLM_500, "/resume": VLLM_500}) as fake:
        message = _failure(fake)
    assert "the old weights are intact and the server stays paused (its /resume failed too: " \
           f"vLLM server {fake.url}/resume: HTTP 500" in message


@pytest.mark.parametrize("path, answer", [
    ("/update_weights", VLLM_500), ("/update_weights", HANG),
    ("/finish_weight_update", VLLM_500), ("/reset_prefix_cache", (200, {"success": False}))],
    ids=["update-500", "update-timeout", "finish-500", "prefix-reset-refused"])
def test_a_failure_after_the_update_started_never_resumes_and_says_the_server_stays_paused(
        path, answer):
    with FakeVllm({path: answer}) as fake:
        message = _failure(fake)
    assert "/resume" not in fake.paths()
    assert message.startswith(f"vLLM server {fake.url}")
    assert message.endswith(f"; the push of step 7 into {fake.url} failed after its update "
                            f"started: {PAUSED_NOTE}")


def test_release_logs_a_failure_instead_of_raising(caplog):
    with FakeVllm({"/shutdown_weight_transfer_engine": VLLM_500}) as fake:
        with caplog.at_level(logging.WARNING, logger="vlmcp.engine.weight_push_http"):
            _push(fake)
    assert fake.paths()[-1] == "/shutdown_weight_transfer_engine"
    (record,) = caplog.records
    assert f"releasing the weight-transfer group of {fake.url} failed (ignored)" in record.message
    assert f"{fake.url}/shutdown_weight_transfer_engine: HTTP 500" in record.message


def test_release_of_an_unreachable_engine_does_not_raise(caplog):
    url = f"http://127.0.0.1:{free_local_port()}"
    with caplog.at_level(logging.WARNING, logger="vlmcp.engine.weight_push_http"):
        VllmPushControl(url, timeout_s=TIMEOUT_S).release()
    assert f"vLLM server {url} is unreachable" in caplog.text


def test_an_unknown_pause_mode_is_refused_before_any_request():
    with pytest.raises(EngineError, match="pause_mode='drain': vLLM pauses with wait, keep or"):
        VllmPushControl("http://127.0.0.1:1", timeout_s=TIMEOUT_S, pause_mode="drain")
