"""The engine client's interface: serve a published step, report the policy version served.

An orchestrator holds one `EngineClient` per engine and calls `serve(N)` when it wants the
engine to generate with WEIGHTS/step_N; `version` is then N (0 stands for the checkpoint the
engine was started on). Every client does the same around the engine-specific reload:

1. `published.step_path`: the step exists and holds STABLE (else EngineError, "not completely
   published" or "does not exist ... publish.keep").
2. `published.check_same_architecture`: its config.json is the served model's (else EngineError
   naming the differing keys).
3. The engine loads the directory in place (`_reload`), then the client re-applies what a reload
   drops: the prefix cache (KV computed with the old weights; a reset the engine refuses is an
   EngineError, since its old KV would stay reusable) and the encoder cache (image features of
   the old vision tower) are reset, the engine's weight-version label is set to N.
   For an MoE policy the experts' CPU prepack is redone after the reload
   (`vllm_worker.repack_cpu_moe_experts`: vLLM 0.32's in-place reload skips it, which left CPU
   MoE logprobs up to 5.3 nats off; with it the reload equals a fresh engine), logged. An MoE
   whose CPU experts vLLM padded at load cannot be reloaded in place at all (vLLM's reload
   fails on them): the client refuses such an engine when it is built
   (`refuse_padded_moe_experts`), before any step.
4. A failure of the engine is one EngineError naming the step; when the step's directory is gone
   afterwards, the error says it vanished while loading.

Subclasses: `vllm_http.VllmHttpClient` (vLLM's OpenAI server) and `vllm_local.VllmLocalClient`
(vLLM's in-process `LLM`). Standard library only, so that it runs in the engine's environment.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from vlmcp.engine.published import ModelConfig, check_same_architecture, read_model_config, \
    step_path
from vlmcp.errors import EngineError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Served:
    """One `serve` call: the step now served, how many MoE layers' CPU experts were repacked
    after the reload (0: a dense model, or experts that need none), its time."""

    step: int
    repacked_layers: int
    seconds: float


class EngineClient(ABC):
    """Loads WEIGHTS/step_N into one running engine and knows which step it serves.

    weights_dir: the trainer's publish.dir. model_dir: the checkpoint the engine was started on
    (policy version `version`, 0 for the base model).
    """

    def __init__(self, weights_dir: str | Path, model_dir: str | Path, version: int = 0):
        self.weights_dir = Path(weights_dir)
        self.served_config: ModelConfig = read_model_config(model_dir)
        self._version = version

    @property
    def version(self) -> int:
        """The policy version the engine serves (the step of WEIGHTS/step_N, 0 for the base)."""
        return self._version

    def serve(self, step: int) -> Served:
        """Make the engine generate with WEIGHTS/step_`step` from now on (see the module
        docstring); raises EngineError on any failure."""
        path = step_path(self.weights_dir, step)
        config = read_model_config(path)
        check_same_architecture(self.served_config, config)
        started = time.perf_counter()
        try:
            repacked = self._reload(path, step, config.moe)
        except EngineError as exc:
            if not path.is_dir():
                raise EngineError(f"{path} vanished while the engine loaded it (publish.keep "
                                  f"removed it): {exc}") from exc
            raise
        self._version = step
        seconds = time.perf_counter() - started
        logger.info("engine reloaded %s in place%s: policy version %d (%.2f s)", path,
                    f" and repacked the CPU experts of {repacked} MoE layers" if repacked else "",
                    step, seconds)
        return Served(step, repacked, seconds)

    def refuse_padded_moe_experts(self, padded: list[str]) -> None:
        """Raise EngineError when the engine reports MoE layers whose CPU experts it padded at
        load (`vllm_worker.padded_cpu_moe_experts`, one line per layer): vLLM 0.32's in-place
        reload fails on them, so this engine can serve only the step it was started on."""
        if padded:
            raise EngineError(
                f"{self.served_config.path}: vLLM's CPU experts padded this MoE's expert "
                f"intermediate size ({padded[0]}; {len(padded)} layer(s)), and vLLM 0.32 cannot "
                "reload padded experts in place (its reload fails with a size mismatch): start "
                "a fresh engine on each published step, or use a moe_intermediate_size that is "
                "a multiple of the CPU kernel's alignment (32 on x86 and Arm)")

    @abstractmethod
    def _reload(self, path: Path, step: int, moe: bool) -> int:
        """Load `path` into the running engine (`moe`: then repack its CPU experts), reset its
        prefix and encoder caches and label its weights `step`; returns how many MoE layers were
        repacked; raise EngineError naming `path` when the engine fails."""

    @abstractmethod
    def close(self) -> None:
        """Stop what the client started (nothing when it only connects to an engine)."""
