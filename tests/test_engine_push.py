"""The push into a running vLLM (publish.engines) against the real engine in its own process (the
engine venv, `make engine`, with vlmcp's gloo backend): `vlmcp train` under torchrun on 2 CPU ranks
pushes every step into one server (the first dense, the second sparse, each checked against the
engine's checksums), and the server's weights after the last push equal, parameter by parameter
(vLLM's /weight_checker checksums) and in a prompt's logprobs, those of the same step reloaded from
publish.dir: dense and MoE, ZeRO 2 and 3, expert parallelism 1 and 2, publish.push_dtype unset and
bf16. A LoRA run pushes its merged weights (sparse after the first: the adapted tensors alone),
which equal vLLM's reload of `vlmcp export --merge`. Faults: an unreachable URL at the start, an
engine killed in the middle of a push, an engine restarted between steps (brought to the latest
step at the next push: its sparse push refused, the step pushed dense at once), SIGTERM to the
trainer in the middle of a push (the resumed run pushes its checkpoint's step first), and under
publish.on_engine_error "warn" an engine that went down reported in the row while training goes on.
A keep-mode push landing in the middle of an answer: the engine labels each token with the version
that sampled it. One server per model, and one the fault tests share (started again where a test
killed or stopped it)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.engine_reference import NEEDS_ENGINE
from tests.helpers.in_flight import in_flight
from tests.helpers.launching import (assert_ok, launched, run_vlmcp, tiny_job, vlmcp_frames,
                                     write_job)
from vlmcp.data.rollouts import STABLE, step_dir
from vlmcp.engine.venv import engine_python
from vlmcp.engine.vllm_http import CPU_ARGS, PUSH_ARGS, VllmHttpClient, VllmServer
from vlmcp.model.tiny import VLLM_CPU_HEADS, build_tiny_checkpoint
from vlmcp.parallel.comm import free_local_port
from vlmcp.training.checkpoint import newest_complete
from vlmcp.training.metrics import read_metrics
from vlmcp.training.signals import STOP_MARKER

ENGINE = engine_python()
pytestmark = [pytest.mark.e2e]

IDS = [1, 10, 11, 12, 13, 2]
LABELS = [-100, -100, 11, 12, 13, 2]
#: A long generation that holds a wait-mode pause (the push's first step) for many seconds.
HOLD = {"prompt": [1, 10, 11], "max_tokens": 1900, "ignore_eos": True, "temperature": 1.0}
#: New tokens of an answer that a push lands in the middle of (within --max-model-len).
LONG_ANSWER = 2000


def _line() -> str:
    return json.dumps({"input_ids": IDS, "labels": LABELS,
                       "advantages": [None, None, 1.0, 1.0, -0.5, 0.25]})


def _write_step(rollouts: Path, number: int) -> None:
    path = step_dir(rollouts, number)
    path.mkdir(parents=True)
    (path / "rollouts.jsonl").write_text("".join(_line() + "\n" for _ in range(4)))
    (path / "meta.json").write_text('{"policy_step": 0}')
    (path / STABLE).write_text("")


def _rows(out: Path, key: str) -> list[dict]:
    path = out / "metrics.jsonl"
    return [row for row in read_metrics(path) if key in row] if path.exists() else []


def _wait_for(condition, what: str, proc: subprocess.Popen | None = None,
              timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen (exit {proc.poll() if proc else None})")


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


class Engine:
    """A vLLM server with the push backend on `checkpoint`, on a fixed port (a restart keeps its
    URL)."""

    def __init__(self, checkpoint: Path, log: Path, moe: bool = False):
        self.checkpoint, self.log, self.port = checkpoint, log, free_local_port()
        self.moe = moe
        self.server: VllmServer | None = None
        #: The checksums of the weights it started with.
        self.base: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.server = VllmServer(ENGINE, self.checkpoint, self.log, port=self.port,
                                 args=(*CPU_ARGS, *PUSH_ARGS, "--max-model-len", "2048",
                                       "--seed", "0"))
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def running(self) -> bool:
        process = self.server.process if self.server is not None else None
        return process is not None and process.poll() is None

    def client(self, weights: Path, version: int) -> VllmHttpClient:
        return VllmHttpClient(self.url, weights, self.checkpoint, version=version)


def _served_version(engine: Engine) -> str:
    """The weight-version label the engine reports (GET /weight_info), read without a client
    (building one labels the engine)."""
    try:
        with urllib.request.urlopen(engine.url + "/weight_info", timeout=30) as answer:
            return str(json.loads(answer.read())["weight_version"])
    except OSError:  # not answering (restarting)
        return ""


def _serving(engine: Engine, version: int) -> bool:
    """The engine serves `version` after its push: labelled (at /finish_weight_update, while still
    paused) and resumed. Only then is the push past every request that can fail it (the release
    of its transfer group after the resume is ignored when it fails), so the test may stop the
    engine or signal the run without landing on that push's tail."""
    return _served_version(engine) == str(version) and not _paused(engine)


def _paused(engine: Engine) -> bool:
    try:
        with urllib.request.urlopen(engine.url + "/is_paused", timeout=5) as answer:
            return bool(json.loads(answer.read())["is_paused"])
    except OSError:
        return False


def _checksums(client: VllmHttpClient) -> dict[str, str]:
    return client.post("/weight_checker", {"action": "checksum"})["checksums"]


def _logprobs(client: VllmHttpClient) -> list[float]:
    out = client.post("/v1/completions", {"model": str(client.served_config.path),
                                          "prompt": IDS, "max_tokens": 4, "temperature": 0.0,
                                          "logprobs": 0})
    return out["choices"][0]["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module", params=[pytest.param("dense", marks=NEEDS_ENGINE),
                                        pytest.param("moe", marks=NEEDS_ENGINE)])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = build_tiny_checkpoint(root / "checkpoint", moe=request.param == "moe", seed=0,
                                       **VLLM_CPU_HEADS)
    served = Engine(checkpoint, root / "server.log", moe=request.param == "moe")
    served.start()
    served.base = _checksums(served.client(root, version=0))
    yield served
    served.stop()


def _job(engine: Engine, root: Path, zero: int, ep_size: int = 1, **publish) -> Path:
    rollouts = root / "rollouts"
    job = tiny_job(engine.checkpoint, Path("unused"), root / "out",
                   data={"max_seq_len": len(IDS), "num_workers": 0},
                   loss={"type": "policy_gradient"}, optimizer={"type": "adamw", "lr": 5e-2},
                   deepspeed={"zero_optimization": {"stage": zero}},
                   parallel={"ep_size": ep_size},
                   rollouts={"dir": str(rollouts), "timeout_s": 300, "poll_s": 0.05},
                   publish={"dir": str(root / "weights"), "engines": [engine.url], **publish},
                   train={"max_steps": 2, "collective_timeout_s": 120})
    del job["data"]["train"]
    rollouts.mkdir(parents=True, exist_ok=True)
    return write_job(root / "job.json", job)


@pytest.mark.parametrize("zero,staged,dtype", [(2, True, "bfloat16"), (3, False, None)],
                         ids=["zero2-staged-bf16", "zero3-streamed"])
def test_each_pushed_step_is_the_published_steps_weights_in_the_engine(engine, zero, staged,
                                                                       dtype, tmp_path):
    """Bit for bit what vLLM's own reload of the published (fp32) step gives, also when the push
    travels in bf16: each tensor the engine holds in fp32 (the DeltaNet's A_log) goes as fp32.
    Step 1 is pushed dense, step 2 sparse (publish.dense_every 2), each checked against the
    engine's checksums; the MoE's ZeRO-2 case trains under expert parallelism 2 (each rank
    pushes the experts it holds)."""
    ep_size = 2 if engine.moe and zero == 2 else 1
    job = _job(engine, tmp_path, zero, ep_size, push_staged=staged, push_dtype=dtype,
               dense_every=2)
    for number in (1, 2):
        _write_step(tmp_path / "rollouts", number)
    assert_ok(run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2, timeout=600))
    rows = _rows(tmp_path / "out", "pushed")
    assert [(r["step"], r["pushed"], r["push_sparse"]) for r in rows] == [
        (1, [engine.url], []), (2, [engine.url], [engine.url])]
    assert all(r["push_bytes"] > 0 and 0 < r["push_downtime_s"] and r["push_check_s"] > 0
               and r["push_base_bytes"] > 0 for r in rows)
    assert rows[1]["push_bytes"] < rows[0]["push_bytes"]
    assert 0 < rows[1]["push_changed_fraction"] < 1 and "push_changed_fraction" not in rows[0]
    assert all(("stage" in r["push_phases_s"]) == staged for r in rows)
    assert _served_version(engine) == "2"
    client = engine.client(tmp_path / "weights", version=2)
    pushed, pushed_logprobs = _checksums(client), _logprobs(client)
    assert pushed.keys() == engine.base.keys() and pushed != engine.base
    client.serve(2)  # the same step from the disk, vLLM's own reload
    assert _checksums(client) == pushed
    assert _logprobs(client) == pushed_logprobs


#: The LoRA targets of the push test: attention and DeltaNet projections, and in the MoE the
#: routed experts' fused parameters (two PEFT wrappers around each experts module).
LORA = {"dense": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "in_proj_qkv", "down_proj"]},
        "moe": {"r": 4, "alpha": 8, "target_modules": ["o_proj", "out_proj"],
                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}}


def test_a_lora_run_pushes_the_merged_weights_that_vllm_reloads_from_the_merged_export(
        engine, tmp_path):
    """Step 1 goes dense (the whole merged model: the engine's anchor), step 2 sparse: only the
    adapted tensors' changed elements (publish.dense_every 2), each checked against the engine's
    checksums (vlmcp's, of what the engine computes with: vLLM's /weight_checker does not see
    the prepacked Linear weights on a CPU, all that LoRA changes here). After it the engine's
    weights (/weight_checker) and a prompt's logprobs equal vLLM's own reload of `vlmcp export
    --merge` of the step-2 checkpoint (PEFT's merge_and_unload), and the logprobs differ from
    the engine's before the run. Dense under ZeRO-3 (the merged tensors gathered with
    DeepSpeed), MoE under ZeRO-2 with the routed experts adapted."""
    kind = "moe" if engine.moe else "dense"
    before = _logprobs(engine.client(tmp_path, version=0))
    path = _job(engine, tmp_path, 2 if engine.moe else 3, dense_every=2)
    job = json.loads(path.read_text())
    job["lora"] = LORA[kind]
    job["train"]["save_every"] = 2
    write_job(path, job)
    for number in (1, 2):
        _write_step(tmp_path / "rollouts", number)
    assert_ok(run_vlmcp(["train", str(path)], launcher="torchrun", nproc=2, timeout=600))
    rows = _rows(tmp_path / "out", "pushed")
    assert [(r["step"], r["pushed"], r["push_sparse"]) for r in rows] == [
        (1, [engine.url], []), (2, [engine.url], [engine.url])]
    assert rows[1]["push_bytes"] < rows[0]["push_bytes"] / 2
    assert 0 < rows[1]["push_changed_fraction"] <= 1 and rows[1]["push_check_s"] > 0
    client = engine.client(tmp_path / "merged", version=2)
    pushed, pushed_logprobs = _checksums(client), _logprobs(client)
    assert pushed.keys() == engine.base.keys() and pushed_logprobs != before
    merged = tmp_path / "merged" / "step_2"
    assert_ok(run_vlmcp(["export", str(path), "--tag", "step2", "--out", str(merged),
                         "--merge"]))
    (merged / STABLE).write_text("{}")
    client.serve(2)
    assert _checksums(client) == pushed
    assert _logprobs(client) == pushed_logprobs


def test_an_unreachable_engine_at_the_start_is_one_error_naming_it(tmp_path):
    closed = f"http://127.0.0.1:{free_local_port()}"
    checkpoint = build_tiny_checkpoint(tmp_path / "checkpoint", seed=0, tokenizer=True)
    job = tiny_job(checkpoint, Path("unused"), tmp_path / "out",
                   rollouts={"dir": str(tmp_path / "rollouts")}, loss={"type": "policy_gradient"},
                   data={"max_seq_len": len(IDS)}, publish={"engines": [closed]})
    del job["data"]["train"]
    (tmp_path / "rollouts").mkdir()
    result = run_vlmcp(["train", str(write_job(tmp_path / "job.json", job))])
    assert result.returncode == 1
    errors = _errors(result.stderr)
    assert len(errors) == 1 and closed in errors[0] and "publish.engines" in errors[0], errors
    assert vlmcp_frames(result.stderr) == []


def _hold_the_pause(engine: Engine) -> threading.Thread:
    """A long generation in flight: a wait-mode pause waits for it (many seconds)."""
    request = urllib.request.Request(
        engine.url + "/v1/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": str(engine.checkpoint), **HOLD}).encode())

    def generate() -> None:
        try:
            urllib.request.urlopen(request, timeout=600).read()
        except OSError:  # the engine may be killed under it
            pass

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    time.sleep(1.0)
    return thread


@pytest.fixture(scope="module")
def spare_engine(tmp_path_factory):
    """A server of the fault tests' own on a dense checkpoint (not `engine`'s: they kill, stop
    and restart it), started by `fresh_engine`."""
    root = tmp_path_factory.mktemp("spare")
    checkpoint = build_tiny_checkpoint(root / "checkpoint", seed=0, **VLLM_CPU_HEADS)
    spare = Engine(checkpoint, root / "server.log")
    yield spare
    spare.stop()


@pytest.fixture
def fresh_engine(spare_engine):
    """The spare server, running: started again where a test before killed or stopped it. A
    test's run pushes dense first whatever the server holds (a new run knows no version of it)."""
    if not spare_engine.running():
        spare_engine.start()
    return spare_engine


@NEEDS_ENGINE
def test_a_keep_mode_push_landing_mid_answer_labels_each_token_with_the_version_that_sampled_it(
        fresh_engine, tmp_path):
    """publish.engine_pause "keep": step 2's push (sparse, publish.dense_every 2) lands while an
    answer is being generated; the answer goes on after it, its tokens before the push labelled
    version 1 by the engine, those after it version 2."""
    engine = fresh_engine
    job = _job(engine, tmp_path, 2, engine_pause="keep", dense_every=2)
    _write_step(tmp_path / "rollouts", 1)
    log = tmp_path / "train.log"
    with launched(["train", str(job)], log, wait_s=300) as proc:
        _wait_for(lambda: _serving(engine, 1), "step 1's push", proc)
        thread, answer = in_flight(engine.url, IDS[:3], LONG_ANSWER)
        _write_step(tmp_path / "rollouts", 2)
        thread.join(timeout=300)
    assert proc.returncode == 0, log.read_text()[-3000:]
    rows = _rows(tmp_path / "out", "pushed")
    assert [(r["step"], r["push_sparse"]) for r in rows] == [(1, []), (2, [engine.url])]
    assert len(answer["token_ids"]) == LONG_ANSWER
    spans = answer["weight_versions"]
    assert [span["version"] for span in spans] == ["1", "2"], spans
    assert spans[0]["start"] == 0 < spans[0]["end"] == spans[1]["start"] < LONG_ANSWER == \
        spans[1]["end"]


@NEEDS_ENGINE
def test_an_engine_killed_mid_push_stops_the_run_naming_it_and_the_step_after_a_checkpoint(
        fresh_engine, tmp_path):
    engine = fresh_engine
    job = _job(engine, tmp_path, 2)
    _write_step(tmp_path / "rollouts", 1)
    log = tmp_path / "train.log"
    with launched(["train", str(job)], log, wait_s=300) as proc:
        _wait_for(lambda: _serving(engine, 1), "step 1's push", proc)
        _hold_the_pause(engine)
        _write_step(tmp_path / "rollouts", 2)
        _wait_for(lambda: _paused(engine), "the push of step 2 pausing the engine", proc)
        engine.server.kill()
    text = log.read_text()
    assert proc.returncode == 1, text[-3000:]
    errors = _errors(text)
    assert len(errors) == 1 and engine.url in errors[0] and "step 2" in errors[0], errors
    assert newest_complete(tmp_path / "out" / "checkpoints")[0] == "step2"
    assert (tmp_path / "weights" / "step_1" / STABLE).is_file()


@NEEDS_ENGINE
def test_a_restarted_engine_gets_the_latest_step_and_a_sigterm_mid_push_loses_nothing(
        fresh_engine, tmp_path):
    """With publish.dense_every 4, the restarted engine refuses step 2's sparse push (it does
    not hold step 1) and gets step 2 dense at once (re-anchored); the resumed run's first push is
    dense, the next sparse."""
    engine, out, weights = fresh_engine, tmp_path / "out", tmp_path / "weights"
    job = _job(engine, tmp_path, 2, dense_every=4)
    raw = json.loads(job.read_text())
    raw["train"]["max_steps"] = 4
    job.write_text(json.dumps(raw))
    _write_step(tmp_path / "rollouts", 1)
    log = tmp_path / "train.log"
    with launched(["train", str(job)], log, wait_s=300) as proc:
        _wait_for(lambda: _serving(engine, 1), "step 1's push", proc)
        engine.stop()  # restarted between steps: a fresh engine on the base checkpoint
        engine.start()
        _write_step(tmp_path / "rollouts", 2)
        _wait_for(lambda: _serving(engine, 2), "step 2's push", proc)
        client = engine.client(weights, version=2)
        pushed = _checksums(client)
        # SIGTERM while step 3's push waits for the engine's pause
        _hold_the_pause(engine)
        _write_step(tmp_path / "rollouts", 3)
        _wait_for(lambda: _paused(engine), "the push of step 3 pausing the engine", proc)
        proc.send_signal(signal.SIGTERM)
    text = log.read_text()
    assert "stopped on a signal while waiting for rollout step 4" in text, text[-3000:]
    assert json.loads((out / STOP_MARKER).read_text())["step"] == 3
    assert newest_complete(out / "checkpoints")[0] == "step3"
    client.serve(2)
    assert _checksums(client) == pushed
    rows = {r["step"]: r for r in _rows(out, "pushed")}
    assert (rows[2]["pushed"], rows[2]["push_reanchored"], rows[2]["push_sparse"]) == (
        [engine.url], [engine.url], [])
    # the resumed run pushes its checkpoint's step first, then step 4's
    raw["train"]["resume"] = True
    job.write_text(json.dumps(raw))
    _write_step(tmp_path / "rollouts", 4)
    assert_ok(run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2, timeout=600))
    assert _served_version(engine) == "4"
    assert [(r["step"], r["push_sparse"]) for r in _rows(out, "pushed")][-2:] == [
        (3, []), (4, [engine.url])]


@NEEDS_ENGINE
def test_under_warn_an_engine_that_went_down_is_reported_in_the_row_and_training_goes_on(
        fresh_engine, tmp_path):
    engine = fresh_engine
    job = _job(engine, tmp_path, 2, on_engine_error="warn")
    _write_step(tmp_path / "rollouts", 1)
    log = tmp_path / "train.log"
    with launched(["train", str(job)], log, wait_s=300) as proc:
        _wait_for(lambda: _served_version(engine) == "1", "step 1's push", proc)
        engine.stop()
        _write_step(tmp_path / "rollouts", 2)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "training on" in text and engine.url in text
    rows = {r["step"]: r for r in _rows(tmp_path / "out", "push_failed")}
    assert rows[2]["push_failed"] == [engine.url] and rows[2]["pushed"] == []
    # the engine serving step 1 does not mean step 1's push had returned: the stop can land on
    # its last request (the resume), and then step 1's row reports the same engine
    assert rows.get(1, {"push_failed": [engine.url]})["push_failed"] == [engine.url]
    assert (tmp_path / "weights" / "step_2" / STABLE).is_file()
