"""The job schema: the sections of a job file, their keys, defaults, help texts and checks.

A job is a JSON object with the sections below. Every key has a default except `model.path` and
`data.train`. Each key's metadata holds its help text and the checks `vlmcp.config.checks` applies
(`choices`, `min`, `max`, `length`, `required`, `files`). `schema_fields` lists every leaf key for
the docs and `vlmcp train --help`.

Relative input paths (`model.path`, the files of `data.train` and `data.eval`, `data.image_root`, a
`deepspeed` JSON path) are looked up next to the job file first and then in the current directory
(`JobConfig.resolve_input`). `output_dir` is relative to the current directory.
"""

from __future__ import annotations

import json
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from vlmcp.parallel.modes import DELTANET_KERNELS, DELTANET_MODES, VISION_MODES


def _key(help_text: str, **checks: Any) -> dict[str, Any]:
    """Field metadata: a help text plus optional `choices`, `min`, `max` and `required` checks."""
    return {"help": help_text, **checks}


@dataclass
class ModelSection:
    path: str = field(default="", metadata=_key(
        "local Hugging Face checkpoint directory (config.json, safetensors, tokenizer, "
        "preprocessor_config.json, chat template); loaded offline", required=True))
    dtype: str = field(default="float32", metadata=_key(
        "parameter and compute dtype", choices=["float32", "bfloat16", "float16"]))
    freeze_vision: bool = field(default=True, metadata=_key(
        "keep the vision tower frozen: replicated, outside the optimizer and ZeRO-3"))
    attn_implementation: str | None = field(default=None, metadata=_key(
        "attention implementation given to from_pretrained (null: sdpa); in training the "
        "text model's full attention always runs vlmcp's registered Ulysses kernel",
        choices=[None, "sdpa", "eager", "flash_attention_2"]))
    deltanet_kernel: str = field(default="auto", metadata=_key(
        "kernel of the Gated DeltaNet layers: torch (vlmcp's pure-torch chunked kernel, any "
        "device), fla (flash-linear-attention's Triton kernel, CUDA), or auto (torch on CPU; fla "
        "on CUDA where its versions are known to train correctly, else an error naming them)",
        choices=list(DELTANET_KERNELS)))
    router_aux_loss: bool = field(default=False, metadata=_key(
        "MoE checkpoints only: add router_aux_loss_coef (from the checkpoint's config) x the "
        "router load-balancing loss of each micro-batch over its real tokens, as transformers "
        "computes it with output_router_logits; reported as router_aux_loss in metrics"))


@dataclass
class VideoSection:
    fps: float | None = field(default=None, metadata=_key(
        "frames sampled per second of video (null: video_preprocessor_config.json's fps)",
        min=0.0))
    min_frames: int | None = field(default=None, metadata=_key(
        "fewest frames sampled from a video, when it has that many (null: the checkpoint's)",
        min=1))
    max_frames: int | None = field(default=None, metadata=_key(
        "most frames sampled from a video (null: the checkpoint's)", min=1))
    min_pixels: int | None = field(default=None, metadata=_key(
        "lower bound of a video's sampled frames' pixels, all frames together (null: the "
        "checkpoint's size.shortest_edge)", min=1))
    max_pixels: int | None = field(default=None, metadata=_key(
        "upper bound of a video's sampled frames' pixels, all frames together (null: the "
        "checkpoint's size.longest_edge)", min=1))
    frame_list_fps: float | None = field(default=None, metadata=_key(
        "native frame rate of a video given as a list of frame images, when its record has no "
        '"fps" (null: such a record is an error)', min=0.0))
    on_timestamp_mismatch: str = field(default="error", metadata=_key(
        "a tokens-format record whose <t seconds> texts are not the timestamps of vlmcp's own "
        "frame plan (the engine sampled other frames than vlmcp decodes): an error naming the "
        "sample, or a logged warning and trained anyway", choices=["error", "warn"]))


@dataclass
class DataSection:
    train: str | list = field(default="", metadata=_key(
        "training data: a JSONL or JSON-array file, a list of them, or a weighted mixture "
        '[{"path": ..., "weight": w}, ...] (paths and objects may mix); weight w (default 1) is '
        "the per-epoch multiplier of that file's samples: each epoch draws round(w x n) of its "
        "n samples (w < 1 a seeded subset, w > 1 whole copies plus a seeded remainder); "
        "required unless rollouts.dir is set", files="weighted"))
    eval: str | list | None = field(default=None, metadata=_key(
        "held-out data: a JSONL or JSON-array file or a list of them (not weighted; optional)",
        files="plain"))
    image_root: str | None = field(default=None, metadata=_key(
        "directory that relative image and video paths of the data are relative to (null: each "
        "data file's own directory); absolute paths are used as they are"))
    max_seq_len: int = field(default=4096, metadata=_key(
        "tokens per packed micro-batch (one pack of whole samples)", min=2))
    shuffle: bool = field(default=False, metadata=_key(
        "shuffle samples (seeded by train.seed and the epoch) before packing each epoch"))
    truncate: bool = field(default=False, metadata=_key(
        "cut samples longer than max_seq_len instead of failing on them"))
    chat_template_kwargs: dict = field(default_factory=dict, metadata=_key(
        "extra keyword arguments (template variables) of every apply_chat_template call that "
        "renders a sample, e.g. {\"enable_thinking\": false}"))
    empty_think: str = field(default="target", metadata=_key(
        "an empty <think>\\n\\n</think>\\n\\n the chat template renders at the start of a reply "
        "(Qwen3.5: the last one): a target (as rendered; teaches answering without thinking), or "
        "part of the prompt (as the enable_thinking=false generation prompt has it)",
        choices=["target", "prompt"]))
    num_workers: int = field(default=2, metadata=_key(
        "DataLoader worker processes per rank that read, decode and patchify the next packs; "
        "0 loads them in the training process", min=0))
    prefetch_factor: int = field(default=2, metadata=_key(
        "packs each data loader worker keeps ready ahead of training", min=1))
    cache_dir: str | None = field(default=None, metadata=_key(
        "directory of the cached length index of data.train, relative to the current directory "
        "(null: $XDG_CACHE_HOME/vlmcp/index, else ~/.cache/vlmcp/index)"))
    video: VideoSection = field(default_factory=VideoSection, metadata=_key(
        "video sampling and pixel bounds over the checkpoint's video_preprocessor_config.json"))


@dataclass
class ParallelSection:
    sp_size: int = field(default=1, metadata=_key(
        "sequence-parallel group size P; the world size must be a multiple of P", min=1))
    deltanet_cp: str = field(default="state", metadata=_key(
        "how Gated DeltaNet layers run under SP: pass the recurrent state between ranks, or "
        "all-to-all to head groups", choices=list(DELTANET_MODES)))
    vision: str = field(default="split", metadata=_key(
        "where image features are computed under SP: split (each rank embeds only its shard and "
        "encodes a patch-balanced share of the images, features are routed to the ranks holding "
        "their placeholders) or replicated (every rank embeds the whole pack and encodes every "
        "image)", choices=list(VISION_MODES)))
    sp_dynamic: bool = field(default=False, metadata=_key(
        "a degree per micro-batch: packs that fit one rank's share of data.max_seq_len "
        "(ceil(max_seq_len / sp_size) tokens) run whole, one pack per rank of the SP group, the "
        "others spread over the group as without it (data.train and rollout steps)"))
    ep_size: int = field(default=1, metadata=_key(
        "expert-parallel group size E (qwen3_5_moe): each MoE layer's routed experts are split "
        "over E ranks (num_experts / E each) by DeepSpeed's AutoEP, tokens reach them by "
        "all-to-all; E divides the world size and num_experts (docs/expert-parallelism.md)",
        min=1))


@dataclass
class OptimizerSection:
    type: str = field(default="adamw", metadata=_key(
        "torch optimizer (torch.optim.AdamW or torch.optim.SGD)", choices=["adamw", "sgd"]))
    lr: float = field(default=1e-4, metadata=_key("peak learning rate", min=0.0))
    weight_decay: float = field(default=0.0, metadata=_key("decoupled weight decay", min=0.0))
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95], metadata=_key(
        "AdamW betas [beta1, beta2]", length=2))
    eps: float = field(default=1e-8, metadata=_key("AdamW epsilon", min=0.0))
    momentum: float = field(default=0.0, metadata=_key("SGD momentum", min=0.0))


@dataclass
class SchedulerSection:
    type: str = field(default="constant", metadata=_key(
        "learning-rate schedule after warmup", choices=["constant", "cosine"]))
    warmup_steps: int = field(default=0, metadata=_key("linear warmup steps from 0", min=0))
    min_lr_ratio: float = field(default=0.0, metadata=_key(
        "cosine floor as a fraction of optimizer.lr", min=0.0, max=1.0))


@dataclass
class TrainSection:
    max_steps: int = field(default=100, metadata=_key("optimizer steps to train", min=1))
    seed: int = field(default=0, metadata=_key("seed of the python/numpy/torch RNGs and of "
                                               "data shuffling"))
    grad_clip: float = field(default=1.0, metadata=_key(
        "global gradient-norm clip; 0 disables it", min=0.0))
    grad_accum: int = field(default=1, metadata=_key(
        "micro-batches (packs) per optimizer step on each data-parallel rank", min=1))
    save_every: int = field(default=0, metadata=_key(
        "DeepSpeed checkpoint every N steps into output_dir/checkpoints; 0 never", min=0))
    eval_every: int = field(default=0, metadata=_key(
        "evaluate on data.eval every N steps (and after the last step); 0 never", min=0))
    resume: bool = field(default=False, metadata=_key(
        "continue from the latest checkpoint in output_dir/checkpoints, also at another world "
        "size, SP, EP or ZeRO stage (its universal checkpoint, converted once beside it)"))
    log_every: int = field(default=1, metadata=_key("write a metrics row every N steps", min=1))
    gradient_checkpointing: bool = field(default=False, metadata=_key(
        "recompute each decoder layer in backward (its SP collectives too) instead of keeping "
        "its activations"))
    tiled_mlp: bool = field(default=False, metadata=_key(
        "run every decoder layer's MLP (a MoE layer's whole sparse block) through DeepSpeed's "
        "TiledMLP: shards of the sequence, recomputed in backward, so the MLP keeps only its "
        "input for backward (shard count ceil(S_local / hidden), agreed over the ranks)"))
    offload_activations: bool = field(default=False, metadata=_key(
        "move the decoder layers' checkpointed inputs to pinned host memory on a side stream "
        "(DeepSpeed's CheckpointHiddenStatesOffload); needs train.gradient_checkpointing; "
        "nothing moves on CPU"))
    keep_checkpoints: int = field(default=0, metadata=_key(
        "keep only the newest N complete checkpoints in output_dir/checkpoints; 0 keeps all",
        min=0))
    nonfinite: str = field(default="abort", metadata=_key(
        "a step whose loss or gradient norm is not finite: abort the run (keeping a checkpoint "
        "of the last finite state), or skip the step", choices=["abort", "skip"]))
    max_skipped_steps: int = field(default=10, metadata=_key(
        "with nonfinite 'skip': abort after this many non-finite steps in a row", min=1))
    collective_timeout_s: float = field(default=600.0, metadata=_key(
        "a rank whose training step, checkpoint or export does not finish within this many "
        "seconds (a hung collective, a frozen peer) logs where it waits and exits; the default "
        "process group times out 60 s later", min=1.0))
    loss_chunk_mb: float = field(default=256.0, metadata=_key(
        "memory budget (MiB) of one lm_head + cross-entropy chunk; its target rows are "
        "budget / (6 bytes x vocab) (12 bytes for a ZeRO-3-partitioned "
        "lm_head), so the loss transient does not grow with the vocabulary or the shard length", min=1.0))


@dataclass
class EvalSection:
    generate: bool = field(default=False, metadata=_key(
        "also measure accuracy by greedy generation on data.eval (exact match of the "
        "first target span)"))
    max_new_tokens: int = field(default=16, metadata=_key("generation length limit", min=1))
    max_samples: int | None = field(default=None, metadata=_key(
        "generation accuracy uses at most this many held-out samples (eval_loss uses all); "
        "null for all", min=1))


#: Values of `loss.type`: token-level objectives, then the preference (pair) objectives.
TOKEN_OBJECTIVES = ("ce", "weighted_ce", "policy_gradient", "ppo_clip", "dppo", "gspo", "cispo",
                    "opd")
PAIR_OBJECTIVES = ("dpo", "ipo", "simpo")


@dataclass
class LossTerm:
    """One objective and its options: the `loss` section itself, or one of its `loss.terms`.
    Which option applies to which type: `vlmcp.config.loss_checks`; definitions: docs/losses.md.
    A `normalize` of None becomes the type's default on construction."""

    type: str = field(default="ce", metadata=_key(
        "training objective: per target token ce, weighted_ce (per-token loss_weights), "
        "policy_gradient (-A log pi), ppo_clip, dppo, gspo, cispo (against per-token "
        "old_logprobs or inference_logprobs, with advantages), opd (on-policy distillation from "
        "per-token teacher_logprobs); per preference pair dpo, ipo, simpo",
        choices=list(TOKEN_OBJECTIVES + PAIR_OBJECTIVES)))
    normalize: str | None = field(default=None, metadata=_key(
        "token: divide by the step's global target count (of the term's weights, when it has "
        "them); sequence: mean over each sample's targets, then over the step's samples; "
        "constant: divide by loss.normalize_constant (Dr. GRPO); null: sequence for gspo (the "
        "GSPO paper's per-sample mean), token for every other type; preference objectives take "
        "the mean over the step's pairs", choices=[None, "token", "sequence", "constant"]))
    normalize_constant: float | None = field(default=None, metadata=_key(
        "normalize constant: the step's fixed divisor (Dr. GRPO: samples x max length)",
        min=1e-12))
    weights: str | None = field(default=None, metadata=_key(
        "name of a per-token weight array of the data (ending in _weights) that multiplies this "
        "objective's per-token loss; token normalisation then counts the targets whose weight "
        "is not 0 (null: every target, weight 1)"))
    coef: float = field(default=1.0, metadata=_key(
        "scalar factor of this objective (of each term in loss.terms)"))
    clip_low: float = field(default=0.2, metadata=_key(
        "ppo_clip, gspo, cispo: the ratio is clipped below at 1 - clip_low", min=0.0, max=1.0))
    clip_high: float = field(default=0.2, metadata=_key(
        "ppo_clip, gspo, cispo: the ratio is clipped above at 1 + clip_high", min=0.0))
    clip_ratio_c: float | None = field(default=None, metadata=_key(
        "ppo_clip dual clip: for advantages < 0 the token loss is capped at -clip_ratio_c x A "
        "(> 1, e.g. 3); null: off", min=1.0))
    kl_coef: float = field(default=0.0, metadata=_key(
        "ppo_clip: weight of the k3 KL penalty against per-token ref_logprobs; 0 disables it",
        min=0.0))
    delta_low: float = field(default=0.2, metadata=_key(
        "dppo: a token with A < 0 is dropped when pi - mu < -delta_low (probabilities)",
        min=0.0))
    delta_high: float = field(default=0.2, metadata=_key(
        "dppo: a token with A > 0 is dropped when pi - mu > delta_high (probabilities)",
        min=0.0))
    kl_tau: float = field(default=0.0, metadata=_key(
        "dppo: weight of the (log pi - log mu)^2 penalty", min=0.0))
    mismatch: str = field(default="none", metadata=_key(
        "train-inference mismatch correction of a policy objective with w = pi_old / mu "
        "(per-token old_logprobs and inference_logprobs): tis multiplies the token loss by "
        "min(w, mismatch_cap), mis by w where mismatch_low <= w <= mismatch_high and 0 "
        "elsewhere (w not differentiated); not for dppo or opd_form importance, whose ratio is "
        "already against mu", choices=["none", "tis", "mis"]))
    mismatch_level: str = field(default="token", metadata=_key(
        "w per token, or per sequence: exp of the sum or mean (mismatch_reduce) of log w over "
        "the sample's targets", choices=["token", "sequence"]))
    mismatch_reduce: str = field(default="sum", metadata=_key(
        "mismatch_level sequence: the sample's log w is the sum or the mean over its targets",
        choices=["sum", "mean"]))
    mismatch_cap: float = field(default=2.0, metadata=_key(
        "tis: the cap C of min(w, C)", min=1e-12))
    mismatch_low: float = field(default=0.5, metadata=_key(
        "mis: the lowest w that is kept", min=0.0))
    mismatch_high: float = field(default=2.0, metadata=_key(
        "mis: the highest w that is kept", min=1e-12))
    opd_form: str = field(default="on_policy", metadata=_key(
        "opd: on_policy: -sg(teacher_logprobs - logp) logp, for samples of the current policy; "
        "importance: -(pi / mu) (teacher_logprobs - inference_logprobs), Thinking Machines' "
        "importance-weighted form for tokens an engine mu sampled off-policy (needs "
        "inference_logprobs)", choices=["on_policy", "importance"]))
    beta: float = field(default=0.1, metadata=_key(
        "dpo, ipo, simpo: the temperature beta", min=1e-12))
    gamma: float = field(default=0.5, metadata=_key(
        "simpo: the target reward margin gamma", min=0.0))
    reference_logps: str | None = field(default=None, metadata=_key(
        "dpo, ipo: where each pair's reference logprob sums come from: null: the data's "
        "ref_chosen_logp / ref_rejected_logp; \"initial\": vlmcp scores data.train with the "
        "initial policy before the first step (kept in output_dir/reference_logps.jsonl for "
        "resumes); else the path of a `vlmcp score` output of data.train by the reference "
        "model"))

    def __post_init__(self) -> None:
        if self.normalize is None:
            self.normalize = "sequence" if self.type == "gspo" else "token"


@dataclass
class LossSection(LossTerm):
    terms: list[dict] = field(default_factory=list, metadata=_key(
        "several objectives at once, each an object of the keys above (type, weights, coef, "
        "normalize, its options): the loss is the sum over terms of coef x (sum of weight x "
        "token loss) / the term's own global count; when set, no other loss key may be"))


@dataclass
class RolloutsSection:
    dir: str | None = field(default=None, metadata=_key(
        "train online on a rollout directory instead of data.train: optimizer step N trains on "
        "DIR/step_N/ once the producer has written its STABLE marker (docs/rl-loop.md); "
        "relative to the current directory; null: off"))
    timeout_s: float = field(default=600.0, metadata=_key(
        "how long to wait for the next rollout step before stopping with a checkpoint and an "
        "error (a producer that stopped)", min=0.0))
    poll_s: float = field(default=1.0, metadata=_key(
        "seconds between two looks for the next step's STABLE marker while waiting (the ranks "
        "sleep in between)", min=0.01))
    max_staleness: int | None = field(default=None, metadata=_key(
        "the largest policy lag a step may have: (steps trained before it) - meta.json's "
        "policy_step; null: no limit", min=0))
    on_stale: str = field(default="error", metadata=_key(
        "a step older than max_staleness: stop with an error, or skip it (no optimizer step, "
        "counted in the log and its metrics row)", choices=["error", "skip"]))
    on_bad_sample: str = field(default="error", metadata=_key(
        "a sample of a rollout step that cannot train (malformed, too long, lacking an array "
        "or the pair form the loss needs): stop with an error naming step_N/file:line, or train the step "
        "without it (counted)", choices=["error", "skip"]))


@dataclass
class PublishSection:
    dir: str | None = field(default=None, metadata=_key(
        "publish the weights to DIR/step_N/ after optimizer step N (a Hugging Face model "
        "directory, or the PEFT adapter under LoRA; STABLE written last); relative to the "
        "current directory; null: off"))
    every: int = field(default=1, metadata=_key("publish after every N-th step", min=1))
    keep: int = field(default=0, metadata=_key(
        "keep only the newest N published steps (older ones are deleted after each publish, "
        "never the step just published); 0 keeps all; 1 warns: keep enough steps to cover an "
        "engine's reload", min=0))
    sharded: bool = field(default=True, metadata=_key(
        "every rank writes a balanced share of whole tensors into its own safetensors shard "
        "(Hugging Face's sharded layout with model.safetensors.index.json; one "
        "model.safetensors at world 1); false: rank 0 gathers the whole model and writes one "
        "model.safetensors while the other ranks wait; not under LoRA (the adapter is small "
        "and rank 0 writes it)"))
    background: bool = field(default=True, metadata=_key(
        "copy, gather (ZeRO-3) and write a published step on a background thread while the "
        "next steps train; the next optimizer step first waits until this rank's host copy is "
        "complete (STABLE once every shard is on the disk; at most one publish in flight; a "
        "failed copy or write stops the run at the next step); needs publish.sharded; false: "
        "training waits for the write; not under LoRA"))
    buffer_mb: float = field(default=32768.0, metadata=_key(
        "per rank, the most host memory (MiB) kept for background publishes: its share, and "
        "under ZeRO-3 its partitions of the tensors other ranks write (allocated at the first "
        "publish, then reused; pinned on a GPU, each counted as the power of two the host "
        "allocator rounds it up to); past it the publish gathers on the training's thread and a rank "
        "whose share is larger writes it before training on, as with background false (logged "
        "once)", min=0.0))
    stop_wait_s: float = field(default=10.0, metadata=_key(
        "on a stop signal, after the stop checkpoint: how long to wait for a background write "
        "still in flight; past it the write is abandoned as .tmp-step_N, never read and "
        "removed at the next start, after at most as long again for the ranks' publish threads "
        "to leave their gather together (docs/faults.md)", min=0.0))
    engines: list[str] = field(default_factory=list, metadata=_key(
        "base URLs of running vLLM servers (http://HOST:PORT) that every publish.every-th step N "
        "is pushed into, in memory, labelled policy version N: vLLM's weight-transfer protocol "
        "over vlmcp's gloo backend, every rank sending its share (start them with "
        "--weight-transfer-config '{\"backend\": \"vlmcp_gloo\"}', docs/rl-loop.md); with "
        "publish.dir beside it, the directory is the durable record; empty: off"))
    dir_every: int | None = field(default=None, metadata=_key(
        "with publish.engines: write publish.dir only after every N-th step (the durable record "
        "may be written less often than the push), a multiple of publish.every (the record holds "
        "pushed steps); null: publish.every", min=1))
    bucket_mb: float = field(default=512.0, metadata=_key(
        "publish.engines: the most MiB one send of a rank packs (tensors back to back; a larger "
        "tensor is a send of its own); each rank holds one such buffer during a push; at least "
        "1.0", min=1.0))
    engine_timeout_s: float = field(default=600.0, metadata=_key(
        "publish.engines: the longest one request to an engine, one wait for it and one send to "
        "it may take before the push counts as failed", min=1.0))
    engine_pause: str = field(default="wait", metadata=_key(
        "publish.engines: how the engine pauses for a push (vLLM's /pause mode): wait for the "
        "requests in flight, keep them (frozen, recomputed under the new weights on resume: one "
        "sample then spans two versions, per-token), or abort them",
        choices=["wait", "keep", "abort"]))
    on_engine_error: str = field(default="error", metadata=_key(
        "publish.engines: an engine that is down, restarts or hangs during a push: stop the run "
        "after a checkpoint with one error naming the engine and the step, or warn, report it in "
        "the publish's row and train on (the next push brings it to the latest step)",
        choices=["error", "warn"]))
    push_dtype: str | None = field(default=None, metadata=_key(
        "publish.engines: the dtype floating tensors travel in, but for those the engine holds "
        "in another dtype (asked at its first push; vLLM keeps Qwen3.5's DeltaNet A_log in fp32 "
        "in a bf16 model), which travel as held, so the engine ends up holding what a reload of "
        "publish.dir gives; the engine's own (e.g. bfloat16) halves an fp32 trainer's bytes; "
        "null: as trained (the bytes of publish.dir's files)",
        choices=[None, "bfloat16", "float16", "float32"]))
    push_staged: bool = field(default=True, metadata=_key(
        "publish.engines: send step N into the engine's host memory while it still serves, and "
        "pause it only to load that copy (its downtime: the load, not the transfer; it holds one "
        "more copy of the pushed bytes meanwhile, and a failed send leaves it serving, "
        "unpaused); false: pause first and receive during the pause (no extra engine memory)"))
    dense_every: int = field(default=1, metadata=_key(
        "publish.engines: push every tensor (a dense anchor) at every N-th push into an engine, "
        "and in between only the elements whose value in the engine's dtype changed since the "
        "previous push (indices and values, or a bitmap, patched in place in the engine); an "
        "engine that does not hold the previous push (restarted, a failed push) gets a dense "
        "one; each rank keeps its share as last pushed in the engine's dtype for the delta; 1: "
        "every push dense", min=1))
    verify_push: bool = field(default=True, metadata=_key(
        "publish.engines: after every push, check the checksums of every tensor the engine holds "
        "(read from what it computes with) against the trainer's, each rank its share; a "
        "mismatch, or a tensor the engine holds nowhere, fails the push naming the tensor "
        "(under publish.on_engine_error); it runs once the engine serves again, off its "
        "downtime; false: no checksums are computed or compared (with publish.dense_every "
        "> 1 the engine still reports where each tensor lies, for the patches)"))
    push_host: str | None = field(default=None, metadata=_key(
        "publish.engines: the address the engines reach trainer rank 0 at (it hosts the push's "
        "rendezvous store, which then listens there only); null: this host's address on the "
        "interface that reaches each engine (the store listens on that one address when one "
        "serves every engine and trainer rank, else on every interface, logged)"))


#: Values of `rl.advantage`: the group-relative estimators (docs/rl-loop.md#advantages).
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
#: The built-in rewards `rl.rewards` may name instead of `module:function`.
BUILTIN_REWARDS = ("exact_match", "math")


@dataclass
class RlSection:
    """`vlmcp rl`'s section; on when rl.prompts or rl.environment is set (`enabled`)."""

    prompts: str | list | None = field(default=None, metadata=_key(
        "the whole RL loop (`vlmcp rl`): the prompt files, in any data format vlmcp reads "
        "(messages, LLaVA/ShareGPT: a trailing assistant turn is the reference answer) or a "
        "table of prompt and answer columns (JSON Lines; parquet and load_from_disk with the "
        "`datasets` package); the columns beyond the prompt go to the rewards; relative to the "
        "job file; null: off (docs/rl-loop.md)", files="plain"))
    environment: dict | None = field(default=None, metadata=_key(
        "instead of rl.prompts and rl.rewards: a verifiers environment, {\"id\": an installed "
        "environment's id or \"path/to/env.py\" (relative to the job file), \"args\": its "
        "config fields}: its taskset's tasks are the prompts, its rubric the reward, its "
        "protocol (single- or multi-turn) runs every episode (the rl extra)"))
    eval_prompts: str | list | None = field(default=None, metadata=_key(
        "held-out prompts: greedy answers scored by the rewards every rl.eval_every steps",
        files="plain"))
    eval_every: int = field(default=0, metadata=_key(
        "score rl.eval_prompts every N steps (and after the last); 0 never", min=0))
    eval_max_prompts: int | None = field(default=None, metadata=_key(
        "at most this many held-out prompts per evaluation (null: all)", min=1))
    prompts_per_step: int = field(default=32, metadata=_key(
        "groups (prompts) each rollout step trains on", min=1))
    group_size: int = field(default=8, metadata=_key(
        "answers sampled per prompt; the advantages are relative to the group", min=2))
    max_new_tokens: int = field(default=256, metadata=_key(
        "the most tokens one answer may have (longer ones are cut: truncated)", min=1))
    temperature: float = field(default=1.0, metadata=_key(
        "sampling temperature (every token's `temperatures` entry)", min=1e-6))
    top_p: float = field(default=1.0, metadata=_key("nucleus sampling's mass", min=1e-6,
                                                    max=1.0))
    top_k: int | None = field(default=None, metadata=_key(
        "sample among the k likeliest tokens only (null: all)", min=1))
    sampling_mask: str = field(default="text", metadata=_key(
        "text: the vision placeholder tokens and the ids beyond the tokenizer are never sampled "
        "(an answer holding one could not train); none: every id of the model's vocabulary",
        choices=["text", "none"]))
    rewards: list[dict] = field(default_factory=list, metadata=_key(
        "the reward functions, each {\"function\": \"module:function\" (TRL's signature: "
        "f(prompts, completions, completion_ids, **columns) -> list of floats), "
        "\"path/to/file.py:function\", or a built-in: \"exact_match\", \"math\" "
        "(math-verify), \"weight\": w (default 1)}; the reward is their weighted sum"))
    advantage: str = field(default="grpo", metadata=_key(
        "the group-relative advantage: grpo (reward - group mean) / (group std + 1e-6), "
        "dr_grpo (reward - group mean), rloo (reward - mean of the other answers)",
        choices=list(ADVANTAGE_ESTIMATORS)))
    dynamic_sampling: bool = field(default=True, metadata=_key(
        "DAPO's dynamic sampling: a group whose answers all got the same reward is dropped "
        "(counted) and further prompts are sampled until the step has rl.prompts_per_step "
        "groups"))
    max_prompts_per_step: int | None = field(default=None, metadata=_key(
        "with rl.dynamic_sampling: the most prompts one step samples; a step that reaches it "
        "trains on the groups it has (null: 4 x rl.prompts_per_step)", min=1))
    merge_identical_answers: bool = field(default=False, metadata=_key(
        "write identical answers of a group (same tokens, same versions) once, with their "
        "summed advantage scaled by (tokens written / tokens sampled) over the step: the "
        "token-normalised loss of policy_gradient and ppo_clip is then exactly that of every "
        "answer, for less training work (short answers repeat; docs/rl-loop.md)"))
    overlong_filter: bool = field(default=False, metadata=_key(
        "answers cut at rl.max_new_tokens train with zero loss weight (DAPO's overlong "
        "filtering); their reward still counts in their group"))
    max_off_policy: int = field(default=1, metadata=_key(
        "every token of rollout step N comes from policy version N-1-k or newer: the "
        "orchestrator waits for the weights (pacing), k steps of generation overlap training; "
        "0 is synchronous", min=0))
    on_reward_error: str = field(default="error", metadata=_key(
        "a reward function that raises or exceeds rl.reward_timeout_s: stop the run after a "
        "checkpoint with one error naming the prompt's file:line and the function, or skip the "
        "group (counted)", choices=["error", "skip"]))
    reward_timeout_s: float = field(default=60.0, metadata=_key(
        "the longest one reward call (one group's answers) may take", min=0.01))
    reward_workers: int = field(default=2, metadata=_key(
        "processes the rewards run in, beside generation (a call past its timeout ends its "
        "process)", min=1))
    engines: list[str] = field(default_factory=list, metadata=_key(
        "base URLs of running vLLM servers to generate with (started with --logprobs-mode "
        "processed_logprobs --enable-scale-out, and the push backend for rl.weights push); "
        "empty: `vlmcp rl` starts rl.num_engines from the engine venv on model.path"))
    num_engines: int = field(default=1, metadata=_key(
        "vLLM servers `vlmcp rl` starts when rl.engines is empty", min=1))
    engine_args: list[str] = field(default_factory=list, metadata=_key(
        "extra command-line arguments of the vLLM servers `vlmcp rl` starts"))
    engine_start_timeout_s: float = field(default=600.0, metadata=_key(
        "the longest a started vLLM server may take to answer", min=1.0))
    weights: str = field(default="push", metadata=_key(
        "how the engines get each trained step: push (publish.engines, set to the engines by "
        "`vlmcp rl`) or files (publish.dir, reloaded into each engine by the orchestrator)",
        choices=["push", "files"]))
    concurrency: int = field(default=64, metadata=_key(
        "generation requests in flight over all engines (one request: one prompt's group)",
        min=1))
    request_timeout_s: float = field(default=600.0, metadata=_key(
        "the longest one generation request may take", min=1.0))
    on_engine_error: str = field(default="retry", metadata=_key(
        "an engine that dies or fails a request: retry its requests on the other engines "
        "(counted; the run stops when none is left), or stop the run at once",
        choices=["retry", "error"]))

    @property
    def enabled(self) -> bool:
        """Whether the job has an rl section: rl.prompts or rl.environment is set."""
        return self.prompts is not None or self.environment is not None


@dataclass
class LoraSection:
    r: int = field(default=0, metadata=_key(
        "LoRA rank; 0 trains full weights (LoRA off), > 0 trains PEFT LoRA adapters on the "
        "language model only (base weights, vision tower, embeddings and lm_head frozen)", min=0))
    alpha: float = field(default=16.0, metadata=_key(
        "LoRA scaling numerator (PEFT lora_alpha; the update is scaled by alpha / r)", min=0.0))
    dropout: float = field(default=0.0, metadata=_key(
        "dropout on the adapters' input", min=0.0, max=1.0))
    target_modules: list[str] | str = field(default="all-linear", metadata=_key(
        "Linear modules to adapt: names matched as PEFT does (full name, or its last dotted "
        "parts: q_proj, in_proj_qkv, mlp.down_proj, ...), or \"all-linear\" for every Linear "
        "of the decoder layers"))
    modules_to_save: list[str] = field(default_factory=list, metadata=_key(
        "leaf modules of the language model trained in full next to the adapters (norms, "
        "Linear layers; not embed_tokens or lm_head); not with ZeRO-3"))
    target_parameters: list[str] = field(default_factory=list, metadata=_key(
        "fused parameters to adapt (PEFT target_parameters): the routed experts' 3-D weights of "
        "a qwen3_5_moe model, mlp.experts.gate_up_proj and mlp.experts.down_proj, one LoRA pair "
        "per expert; needs lora.dropout 0"))


@dataclass
class JobConfig:
    model: ModelSection = field(default_factory=ModelSection, metadata=_key("the checkpoint"))
    data: DataSection = field(default_factory=DataSection, metadata=_key("data and packing"))
    parallel: ParallelSection = field(default_factory=ParallelSection, metadata=_key(
        "sequence parallelism"))
    optimizer: OptimizerSection = field(default_factory=OptimizerSection, metadata=_key(
        "torch optimizer"))
    scheduler: SchedulerSection = field(default_factory=SchedulerSection, metadata=_key(
        "learning-rate schedule"))
    train: TrainSection = field(default_factory=TrainSection, metadata=_key("training loop"))
    eval: EvalSection = field(default_factory=EvalSection, metadata=_key("evaluation"))
    loss: LossSection = field(default_factory=LossSection, metadata=_key(
        "token-level training objective"))
    lora: LoraSection = field(default_factory=LoraSection, metadata=_key(
        "LoRA adapters (PEFT); off while lora.r is 0"))
    rollouts: RolloutsSection = field(default_factory=RolloutsSection, metadata=_key(
        "online training on the steps a producer writes (docs/rl-loop.md)"))
    publish: PublishSection = field(default_factory=PublishSection, metadata=_key(
        "weights published after steps, for an inference engine (docs/rl-loop.md)"))
    rl: RlSection = field(default_factory=RlSection, metadata=_key(
        "the whole RL loop of `vlmcp rl`: prompts, engines, rewards, advantages, pacing "
        "(docs/rl-loop.md); `vlmcp train` ignores it"))
    deepspeed: str | dict = field(default_factory=lambda: {"zero_optimization": {"stage": 0}},
                                  metadata=_key("DeepSpeed JSON path or inline dict"))
    output_dir: str = field(default="runs/job", metadata=_key(
        "where metrics.jsonl, checkpoints/ and final/ go"))
    #: Directory of the job file; relative input paths are looked up here first. Not a job key.
    job_dir: str = field(default=".", metadata={"internal": True})
    #: `--set deepspeed.*` overrides, applied to the DeepSpeed config once loaded. Not a job key.
    deepspeed_overrides: dict[str, Any] = field(default_factory=dict, metadata={"internal": True})
    #: Leaf key paths the job file or `--set` gave a value (the rest are defaults). Not a job key.
    explicit_keys: frozenset[str] = field(default_factory=frozenset, metadata={"internal": True})
    #: Job key path -> where a launcher-given value came from (vlmcp/config/launch_env.py). Not a job key.
    key_sources: dict[str, str] = field(default_factory=dict, metadata={"internal": True})
    #: DeepSpeed key path -> (value, source) the launcher sets (vlmcp/config/launch_env.py). Not a job key.
    launcher_deepspeed: dict[str, tuple[Any, str]] = field(default_factory=dict,
                                                           metadata={"internal": True})
    #: Build the model under ZeRO-3 partitioned (deepspeed.zero.Init); None: the default (yes).
    #: Set from accelerate's zero3_init_flag. Not a job key.
    zero3_init: bool | None = field(default=None, metadata={"internal": True})

    def shown_key(self, key: str, value: Any) -> str:
        """Job key `key` with its value as a message names it: ``key=value``, plus the launcher
        setting it came from, if any."""
        source = self.key_sources.get(key)
        return f"{key}={json.dumps(value)}" + (f" (from {source})" if source else "")

    def resolve_input(self, path: str) -> Path:
        """An input path as the job means it: absolute, else next to the job file, else cwd."""
        p = Path(path).expanduser()
        if p.is_absolute():
            return p
        beside_job = Path(self.job_dir) / p
        if beside_job.exists() or not p.exists():
            return beside_job
        return p.resolve()

    def to_dict(self) -> dict[str, Any]:
        """The job as plain JSON data (internal fields left out)."""
        return _to_dict(self)


def _to_dict(obj: Any) -> Any:
    if is_dataclass(obj):
        return {f.name: _to_dict(getattr(obj, f.name)) for f in fields(obj)
                if not f.metadata.get("internal")}
    return obj


def schema_fields(cls: type = JobConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key path, default, help) for every leaf key of the schema, for docs and --help."""
    rows: list[tuple[str, Any, str]] = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.metadata.get("internal"):
            continue
        key = f"{prefix}{f.name}"
        if is_dataclass(hints[f.name]):
            rows.extend(schema_fields(hints[f.name], key + "."))
        else:
            default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
            rows.append((key, default, f.metadata.get("help", "")))
    return rows
