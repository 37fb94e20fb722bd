"""A generation in flight on a running vLLM server, for the tests whose weight update must land
in the middle of an answer (a keep-mode reload or push): `in_flight` starts a streamed
`/inference/v1/generate` of an exact number of tokens in a thread and returns at its first
tokens; the answer dict then gets the output's token ids and the engine's `weight_versions`
spans."""

from __future__ import annotations

import json
import threading
import urllib.request


def stream_generate(url: str, request: dict, started: threading.Event, out: dict) -> None:
    """POST a streamed `/inference/v1/generate` request; set `started` at its first tokens and
    leave in `out` the output's token ids and the final chunk's `weight_versions`."""
    body = json.dumps({**request, "stream": True}).encode()
    tokens: list[int] = []
    try:
        with urllib.request.urlopen(urllib.request.Request(
                url + "/inference/v1/generate", data=body,
                headers={"Content-Type": "application/json"}), timeout=300) as answer:
            for raw in answer:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[len("data: "):]).get("choices", []):
                    tokens += choice.get("token_ids") or []
                    if choice.get("weight_versions"):
                        out["weight_versions"] = choice["weight_versions"]
                if tokens:
                    started.set()
        out["token_ids"] = tokens
    finally:  # a failed request wakes the test at once instead of after its timeout
        started.set()


def in_flight(url: str, prompt: list[int], tokens: int) -> tuple[threading.Thread, dict]:
    """A streamed request of exactly `tokens` new tokens after `prompt`, in a thread; returns
    (the thread, its `stream_generate` answer) at its first tokens, so that an update started
    then finds it in flight, however fast the CPU is."""
    request = {"token_ids": prompt, "sampling_params": {
        "max_tokens": tokens, "min_tokens": tokens, "temperature": 1.0, "logprobs": 0}}
    answer: dict = {}
    started = threading.Event()
    thread = threading.Thread(target=stream_generate, args=(url, request, started, answer),
                              daemon=True)
    thread.start()
    assert started.wait(timeout=300)
    return thread, answer
