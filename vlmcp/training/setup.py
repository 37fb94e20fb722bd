"""Starting a job on every rank: the process group, the checks, the length index, the engine.

`vlmcp train` (training/loop.py) and `vlmcp score` (training/score.py) start the same way:

    start_checked(job)     process group, every check of the job on every rank, the length
                           index (built by local rank 0 of each node, loaded by the others);
                           every rank fails together when any rank found a problem
    build_engine(...)      the model (partitioned while it loads under ZeRO-3), LoRA adapters,
                           the packed training module, `deepspeed.initialize`
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch

from vlmcp.config import JobConfig
from vlmcp.errors import PreflightError
from vlmcp.model.load import load_model
from vlmcp.model.lora import apply_lora
from vlmcp.model.packed import PackedVLM
from vlmcp.parallel import comm
from vlmcp.parallel.agree import fail_together
from vlmcp.parallel.groups import SequenceParallel
from vlmcp.training.ds.config import zero_stage
from vlmcp.training.ds.engine import describe_engine, engine_optim_args
from vlmcp.training.ds.initialize import initialize_engine
from vlmcp.training.objective_step import objective_of
from vlmcp.training.preflight import Preflight, load_eval_index, load_train_index, run_preflight

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def is_index_builder() -> bool:
    """Whether this rank builds a missing length index: local rank 0 of each node."""
    return int(os.environ.get("LOCAL_RANK", comm.rank())) == 0


def start_checked(job: JobConfig, training: bool = True) -> Preflight:
    """Start the process group and check the job on every rank; returns the checks' findings
    with the length index loaded. Every rank raises PreflightError when any rank found a problem.

    The index builders make a missing index during the checks while the others wait; the others
    load it afterwards, and all agree on the outcome once more. `training` False (`vlmcp score`):
    no check of the per-token arrays `loss.type` needs, and no held-out data.
    """
    # The default group's own timeout is a backstop 60 s behind the watchdog, which fires first
    # and names the step and the collective (training/watchdog.py).
    comm.init_distributed(job.train.collective_timeout_s + 60)
    builder = is_index_builder()
    preflight = run_preflight(job, comm.world_size(), training=training,
                              index_role="build" if builder else "skip")
    fail_together(preflight.problems, PreflightError)
    if not builder:
        load_train_index(job, preflight, may_build=False, training=training)
        if training:
            load_eval_index(job, preflight, may_build=False)
    fail_together(preflight.problems, PreflightError)
    return preflight


def build_engine(job: JobConfig, preflight: Preflight,
                 sp: SequenceParallel) -> tuple[Any, PackedVLM, Any]:
    """(DeepSpeed engine, training module, the PeftModel when lora.r > 0 else None).

    With LoRA the adapters are injected into the loaded model before PackedVLM wraps it, so
    only adapter weights (and modules_to_save copies) enter the optimizer; under ZeRO-3 the new
    adapter weights are partitioned by deepspeed.initialize next to the frozen base weights.
    """
    from transformers.integrations import HfDeepSpeedConfig

    ds_config = preflight.ds_config
    # Kept alive while the model loads, so that from_pretrained partitions under ZeRO-3
    # (unless accelerate's zero3_init_flag says false: DeepSpeed then partitions it afterwards).
    partitioned = zero_stage(ds_config) == 3 and job.zero3_init is not False
    hf_ds_config = HfDeepSpeedConfig(ds_config) if partitioned else None
    model_dir = job.resolve_input(job.model.path)
    hf_model = load_model(model_dir, job.model.dtype,
                          freeze_vision=job.model.freeze_vision,
                          attn_implementation=job.model.attn_implementation)
    adapter = apply_lora(hf_model, job.lora, model_dir) if job.lora.r else None
    module = PackedVLM(hf_model, sp=sp, deltanet_cp=job.parallel.deltanet_cp,
                       gradient_checkpointing=job.train.gradient_checkpointing,
                       vision_mode=job.parallel.vision,
                       loss_chunk_mb=job.train.loss_chunk_mb,
                       router_aux_loss=job.model.router_aux_loss,
                       objective=objective_of(job),
                       deltanet_kernel=job.model.deltanet_kernel,
                       tiled_mlp=job.train.tiled_mlp,
                       offload_activations=job.train.offload_activations)
    trainable = [p for p in module.parameters() if p.requires_grad]
    # Under EP, DeepSpeed lists the module's parameters itself, after AutoEP's replacement (which
    # drops the replaced blocks' parameters, PEFT's expert adapters among them), and the
    # optimizer factory keeps the trainable ones.
    engine = initialize_engine(module, ds_config, sp.mpu,
                               model_parameters=None if job.parallel.ep_size > 1 else trainable,
                               **engine_optim_args(job, ds_config, trainable))
    if job.parallel.ep_size > 1:
        module.adopt_expert_parallel()
    del hf_ds_config
    logger.info("%s", describe_engine(engine, ds_config))
    return engine, module, adapter
