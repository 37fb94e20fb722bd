"""Writing the trained model in Hugging Face format (config.json, safetensors, tokenizer and
processor files, chat template), from a live engine at the end of training or from a saved
DeepSpeed checkpoint (`vlmcp export`).

The training module (`PackedVLM`) registers only the trainable parts of the HF model (the text
model and lm_head, plus the vision tower when it trains); its state-dict keys are mapped back to
the HF model's names by module identity (`vlmcp.training.weights.hf_format`). A frozen vision tower
is not in DeepSpeed's state: the live export takes it from the model, `vlmcp export` from the base
checkpoint at `model.path`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from vlmcp.config import JobConfig
from vlmcp.model.load import load_model
from vlmcp.parallel import comm
from vlmcp.training.checkpoint import checkpoint_dir, newest_complete
from vlmcp.training.weights.expert_checkpoint import expert_parallel_state
from vlmcp.training.weights.hf_format import (hf_key_prefixes, save_hf, to_hf_keys,
                                              write_model_config)
from vlmcp.training.weights.lora_export import export_lora
from vlmcp.training.weights.sharded_write import ShardedWrite
from vlmcp.training.weights.shards import SharePlan, gather_share

logger = logging.getLogger(__name__)

#: DeepSpeed's model-states file of rank 0: ZeRO 0-2, then ZeRO-3.
_MODEL_STATES_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def engine_hf_state_dict(engine, module: nn.Module, hf_model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full HF state dict of the live model on rank 0 (None elsewhere). Call on every rank.

    Under ZeRO-3 the partitioned parameters are gathered one layer at a time. The single-writer
    publish (`publish.sharded: false`) writes this with save_pretrained.
    """
    if engine.zero_optimization_partition_weights():
        trained = engine._zero3_consolidated_16bit_state_dict()
    else:
        trained = module.state_dict() if comm.rank() == 0 else None
    if comm.rank() != 0:
        return None
    state = {k: v for k, v in hf_model.state_dict().items() if v.numel() > 0}
    state.update(to_hf_keys(trained, hf_key_prefixes(module, hf_model)))
    return state


def save_final(engine, hf_model: PreTrainedModel, source_dir: str | Path,
               out_dir: str | Path) -> Path:
    """Write the trained model to `out_dir` in HF format, every rank its share of whole tensors
    into its own shard (training/weights/sharded_write.py, training/weights/shards.py; one
    model.safetensors at world 1); call on every rank.

    Every rank raises CheckpointError when any rank could not write (nothing half-written stays,
    and the run's checkpoints are untouched).
    """
    plan = SharePlan.of(hf_model, comm.world_size())
    write = ShardedWrite.begin(out_dir, plan, what="model",
                               replaceable=lambda path: (path / "config.json").is_file())
    share = gather_share(engine, hf_model, plan, comm.rank())
    write.start(share, background=False,
                extra=lambda tmp: write_model_config(hf_model, source_dir, tmp))
    del share
    write.settle(wait=True)
    if comm.rank() == 0:
        logger.info("saved the trained model (Hugging Face format, %d shards) to %s",
                    len(plan.files), out_dir)
    return Path(out_dir)


def read_checkpoint_state(checkpoint_dir: str | Path, tag: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(module state dict in fp32, client state) of a DeepSpeed checkpoint, read on CPU.

    ZeRO 1-3 checkpoints are consolidated from their fp32 optimizer partitions; a ZeRO-0
    checkpoint holds the whole module state; one saved under expert parallelism is read from its
    model states and expert files, or at ZeRO-3 by DeepSpeed's universal
    conversion (training/weights/expert_checkpoint.py).
    """
    tag_dir = Path(checkpoint_dir) / tag
    candidates = [tag_dir / name for name in _MODEL_STATES_FILES]
    model_states = next((path for path in candidates if path.is_file()), None)
    if model_states is None:
        raise FileNotFoundError(f"{tag_dir} holds no {' or '.join(_MODEL_STATES_FILES)} "
                                "(not a DeepSpeed checkpoint tag?)")
    saved = torch.load(model_states, map_location="cpu", weights_only=False)
    client = {k: v for k, v in saved.items() if k in ("step", "hf_key_prefixes")}
    if saved.get("ds_config", {}).get("expert_parallel", {}).get("enabled"):
        return expert_parallel_state(tag_dir, saved), client
    if saved.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0) > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    else:
        state = {k: v.float() for k, v in saved["module"].items()}
    return dict(state), client


def export_checkpoint(job: JobConfig, tag: str | None = None,
                      out_dir: str | Path | None = None, merge: bool = False) -> Path:
    """Convert a DeepSpeed checkpoint of `job` (default: the newest complete) to a HF model dir.

    Parameters the checkpoint does not hold (a frozen vision tower) come from `model.path`.
    Writes to `out_dir`, default OUTPUT_DIR/export-<tag>. A LoRA job (`lora.r` > 0) writes its
    PEFT adapter directory, or with `merge` the HF model with the adapters merged in
    (training.weights.lora_export).
    """
    if merge and not job.lora.r:
        raise ValueError("--merge applies to LoRA jobs (lora.r > 0); this job trains full weights")
    directory = checkpoint_dir(job)
    if tag is None:
        tag, skipped = newest_complete(directory)
        for reason in skipped:
            logger.warning("skipping an incomplete checkpoint: %s", reason)
        if tag is None:
            raise FileNotFoundError(f"no complete checkpoint in {directory}")
    state, client = read_checkpoint_state(directory, tag)
    if "hf_key_prefixes" not in client:
        raise ValueError(f"{directory / tag} was not written by vlmcp (no hf_key_prefixes)")
    out = Path(out_dir) if out_dir else Path(job.output_dir) / f"export-{tag}"
    hf_state = to_hf_keys(state, client["hf_key_prefixes"])
    if job.lora.r:
        export_lora(job, hf_state, out, merge)
        logger.info("exported %s (step %s) to %s (%s)", directory / tag, client.get("step"), out,
                    "merged model" if merge else "LoRA adapter")
        return out
    model_dir = job.resolve_input(job.model.path)
    model = load_model(model_dir, job.model.dtype, freeze_vision=job.model.freeze_vision)
    unknown = sorted(set(hf_state) - set(model.state_dict()))
    if unknown:
        raise ValueError(f"checkpoint keys unknown to {model_dir}: {unknown[:5]}")
    model.load_state_dict(hf_state, strict=False)
    save_hf(model, model.state_dict(), model_dir, out)
    logger.info("exported %s (step %s) to %s", directory / tag, client.get("step"), out)
    return out
