"""Command line: `vlmcp {train,validate,inspect,export,score,bench,demo,rl}` (also `python -m vlmcp ...`).

Heavy imports (torch, transformers, deepspeed) happen inside the commands, so `--help` is quick.
Exit codes: 0 success, 1 a problem with the job or data (one line per problem on stderr; also a
non-finite step, an unwritable checkpoint), 2 bad command-line usage, 124 a rank the watchdog
ended (a step past train.collective_timeout_s), 128+N stopped on signal N after a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict

from vlmcp.config import load_job, schema_fields
from vlmcp.config.schema import JobConfig
from vlmcp.errors import ConfigError, JobError, ProcessorError
from vlmcp.parallel.modes import DELTANET_KERNELS, DELTANET_MODES, VISION_MODES

EXIT_PROBLEMS = 1

_TRAIN_EPILOG = """\
launch with any of:
  torchrun --nproc_per_node 2 -m vlmcp train JOB.json
  deepspeed --num_gpus 2 --module vlmcp train JOB.json
  accelerate launch --config_file launch/accelerate/deepspeed_2proc.yaml -m vlmcp train JOB.json
A plain `vlmcp train JOB.json` trains on one rank.
"""


def _schema_epilog() -> str:
    lines = ["job keys (JSON; `--set key.path=value` overrides any of them):"]
    for key, default, help_text in schema_fields():
        shown = "required" if default == "" else f"default {json.dumps(default)}"
        lines.append(f"  {key:<26} {help_text} ({shown})")
    return "\n".join(lines)


def _add_job_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="job JSON file (see `vlmcp train --help` for its keys)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY.PATH=VALUE",
                        help="override a job key; the value is parsed as JSON when it parses "
                             "(e.g. --set train.max_steps=10 --set optimizer.betas=[0.9,0.99]); "
                             "repeatable")


def _grid_hw(text: str) -> tuple[int, int]:
    """`--video-grid` HxW (patches), both even (the 2x2 merge)."""
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW, e.g. 16x16, got {text!r}") from None
    if h < 2 or w < 2 or h % 2 or w % 2:
        raise argparse.ArgumentTypeError(f"{text}: both sides must be even and >= 2 (patches)")
    return h, w


def _add_train(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`vlmcp train`: the job, and every job key in its epilog."""
    train = commands.add_parser(
        "train", help="train a job (run under torchrun, deepspeed or accelerate for >1 rank)",
        description="Train the job on every rank of the launcher's world. Checks the job on "
                    "every rank first and fails on all ranks together, naming each problem.",
        epilog=_TRAIN_EPILOG + "\n" + _schema_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_job_args(train)


def _add_validate(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`vlmcp validate`: the job and the world size it is checked for."""
    validate = commands.add_parser(
        "validate", help="check a job, its model and every data line before launching",
        description="Check the job schema, the checkpoint directory and processor, the "
                    "sequence-parallel constraints for the world size, the DeepSpeed config, and "
                    "every line of the data (files, images, videos: every sampled frame is "
                    "decoded, placeholder counts, lengths, targets). Prints one line per problem "
                    "and exits 1 when there is any.")
    _add_job_args(validate)
    validate.add_argument("--world-size", type=int, default=None,
                          help="number of ranks the job will run on (default: $WORLD_SIZE, "
                               "else parallel.sp_size)")


def _add_inspect(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`vlmcp inspect`: the job, the sample shown and the output form."""
    inspect = commands.add_parser(
        "inspect", help="print one training sample as rendered, with its target tokens marked",
        description="Render one sample of data.train exactly as training tokenizes it (chat "
                    "template with data.chat_template_kwargs and data.empty_think, truncation) and "
                    "print it with its target tokens in [[...]] (green on a terminal), each "
                    "image's placeholders collapsed to <|image_pad|>xN and each video temporal "
                    "group's to <|video_pad|>xN, after a summary: source file:line, tokens, "
                    "targets, each image's grid and token count, and each video's frame count "
                    "and fps (and where they came from), sampled frames, timestamps, group grid "
                    "and tokens (a preference pair: its chosen, then its rejected half; --json: "
                    "an object {\"chosen\": ..., \"rejected\": ...}). One process, no GPU, no "
                    "DeepSpeed; only the sample's own images and sampled frames are decoded.")
    _add_job_args(inspect)
    inspect.add_argument("--sample", type=int, default=0, metavar="N",
                         help="0-based index of the sample in data.train (default 0)")
    inspect.add_argument("--json", action="store_true",
                         help="print a JSON report (segments with text, is_target, num_tokens; "
                              "images with grid and token counts) instead")


def _add_export(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`vlmcp export`: the job, the checkpoint and where its model goes."""
    export = commands.add_parser(
        "export", help="convert a DeepSpeed checkpoint of a job to a Hugging Face model dir",
        description="Write config.json, safetensors, tokenizer and processor files of a saved "
                    "checkpoint (default: the latest in OUTPUT_DIR/checkpoints), loadable with "
                    "from_pretrained. Parameters a checkpoint does not hold (a frozen vision "
                    "tower) come from model.path. A LoRA job writes its PEFT adapter directory, "
                    "or with --merge the model with the adapters merged in.")
    _add_job_args(export)
    export.add_argument("--tag", default=None, help="checkpoint tag, e.g. step100 (default: latest)")
    export.add_argument("--out", default=None, help="output directory (default OUTPUT_DIR/export-TAG)")
    export.add_argument("--merge", action="store_true",
                        help="LoRA jobs: write the HF model with the adapters merged in "
                             "(default: the PEFT adapter directory)")


def _add_score(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`vlmcp score`: the job, the output file and what each line holds."""
    score = commands.add_parser(
        "score", help="write the model's logprob of every target token of data.train (JSONL)",
        description="Run the packed, sequence-parallel forward of the job's model (model.path; "
                    "point it at OUTPUT_DIR/final with --set to score a trained policy) over "
                    "data.train without a backward, and write one JSON line per sample in data "
                    "order: {\"index\": i, \"logprobs\": [...]}, the logprob of each target "
                    "token in order. Run under a launcher for >1 rank, like train.",
        epilog="  torchrun --nproc_per_node 2 -m vlmcp score JOB.json --out scores.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_job_args(score)
    score.add_argument("--out", default=None, help="output JSONL (default OUTPUT_DIR/scores.jsonl)")
    score.add_argument("--entropy", action="store_true",
                       help='also write "entropy": the policy\'s entropy at each target position')
    score.add_argument("--routes", action="store_true",
                       help='MoE: also write "routed_experts", the experts each token went to in '
                            "every MoE layer (compact form), to replay in training (R2)")


def _add_bench(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`vlmcp bench`: every mode's options, group by group."""
    bench = commands.add_parser(
        "bench", help="measure step time, tokens/s and memory of forward+backward",
        description="Time forward+backward of the packed training module at each sequence "
                    "length and write a JSON report with step_time_s, tokens_per_s and memory "
                    "(model_memory_mb after the model is built, peak_memory_mb, and "
                    "activation_memory_mb = their difference; largest rank). On CPU each length "
                    "runs in fresh processes that bench starts itself (--sp-size ranks over "
                    "gloo); under torchrun the launcher's ranks run every length in-process. "
                    "--loss-only measures the lm_head + cross-entropy alone; --find-max-len "
                    "searches the longest sample that fits --memory-budget-gb. With --videos N "
                    "--frames F each length runs under split and replicated vision and the row "
                    "compares each rank's vision_s (wall) and vision_cpu_s.")
    _add_bench_model_options(bench)
    _add_bench_pack_options(bench)
    _add_bench_step_options(bench)
    _add_bench_other_measures(bench)
    _add_bench_max_len_search(bench)
    _add_bench_training_jobs(bench)
    _add_bench_engine_mismatch(bench)
    bench.add_argument("--out", default="runs/bench.json", help="JSON report path")


def _add_bench_model_options(bench: argparse.ArgumentParser) -> None:
    """The model benchmarked: a checkpoint, or the tiny one's shape."""
    bench.add_argument("--model", default=None,
                       help="checkpoint directory (default: a tiny random Qwen3.5 built on the fly)")
    bench.add_argument("--moe", action="store_true", help="tiny MoE model instead of dense")
    bench.add_argument("--vocab-size", type=int, default=None,
                       help="vocabulary of the tiny model (default 512; Qwen3.5's is 248320)")
    bench.add_argument("--hidden-size", type=int, default=None,
                       help="hidden size of the tiny model and of --loss-only (default 64)")
    bench.add_argument("--intermediate-size", type=int, default=None,
                       help="MLP intermediate size of the tiny model (default 2 x hidden; Qwen3.5-9B's "
                            "proportion is 3 x)")


def _add_bench_pack_options(bench: argparse.ArgumentParser) -> None:
    """What each pack holds: lengths, samples, images, pairs, videos."""
    bench.add_argument("--seq-lens", default=None,
                       help="comma-separated pack lengths (default 1024,4096)")
    bench.add_argument("--samples-per-pack", type=int, default=4,
                       help="equal-length samples each pack is split into")
    bench.add_argument("--images", type=int, default=0,
                       help="images of mixed sizes in each pack; reports per-rank vision_s")
    bench.add_argument("--pairs", action="store_true",
                       help="the packs hold preference pairs (--samples-per-pack / 2) whose halves "
                            "show the same prompt --images; each length runs with the images "
                            "encoded once for both halves (pair_images \"shared\", as vlmcp "
                            "trains) and once per half (\"twice\"): compare their vision_s")
    bench.add_argument("--videos", type=int, default=0,
                       help="videos in each pack (after the images), of --frames frames each; "
                            "compares split and replicated vision unless --vision is given")
    bench.add_argument("--frames", type=int, default=64,
                       help="sampled frames of each --videos video (two frames per temporal "
                            "group; default 64)")
    bench.add_argument("--video-grid", type=_grid_hw, default=(16, 16), metavar="HxW",
                       help="patch grid of each video temporal group (default 16x16: 256x256 "
                            "pixels, 64 tokens per group)")


def _add_bench_step_options(bench: argparse.ArgumentParser) -> None:
    """How each step runs: parallelism, kernels, precision, memory savers, timed iterations."""
    bench.add_argument("--sp-size", type=int, default=None,
                       help="sequence-parallel size (default: 1, or the launcher's world size)")
    bench.add_argument("--deltanet-cp", choices=DELTANET_MODES, default=DELTANET_MODES[0])
    bench.add_argument("--deltanet-kernel", choices=DELTANET_KERNELS, default=DELTANET_KERNELS[0],
                       help="model.deltanet_kernel: the Gated DeltaNet kernel (default auto: torch on "
                            "CPU, fla on CUDA where its versions allow)")
    bench.add_argument("--vision", choices=[*VISION_MODES, "both"], default=None,
                       help="parallel.vision: split the image and video encoding over the SP "
                            "group, run it on the whole pack on every rank, or both, compared "
                            "per length (default: split; both with --videos)")
    bench.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    bench.add_argument("--gradient-checkpointing", action="store_true",
                       help="train.gradient_checkpointing: recompute each decoder layer in backward")
    bench.add_argument("--tiled-mlp", action="store_true",
                       help="train.tiled_mlp: the MLPs through DeepSpeed's TiledMLP")
    bench.add_argument("--offload-activations", action="store_true",
                       help="train.offload_activations: DeepSpeed's CheckpointHiddenStatesOffload on the "
                            "checkpointed layer inputs (needs --gradient-checkpointing)")
    bench.add_argument("--routes", nargs="?", const="recorded", choices=("recorded", "random"),
                       help="MoE: run every length without and with routing replay and report "
                            "replay_time_ratio and replay_peak_memory_mb; the routes replayed are "
                            "the model's own from a scoring pass (recorded, the default: the "
                            "replay's own cost) or random experts on every token (random)")
    bench.add_argument("--loss-chunk-mb", type=float, default=None,
                       help="memory budget (MiB) of one lm_head + cross-entropy chunk (default: "
                            "train.loss_chunk_mb's default)")
    bench.add_argument("--steps", type=int, default=3, help="timed iterations per length")
    bench.add_argument("--warmup", type=int, default=1, help="untimed iterations per length")


def _add_bench_other_measures(bench: argparse.ArgumentParser) -> None:
    """Measures besides the step's time: the loss alone, saved bytes, beside ALST, the publish."""
    bench.add_argument("--loss-only", action="store_true",
                       help="measure the lm_head + cross-entropy alone: loss_peak_transient_mb")
    bench.add_argument("--saved-bytes", action="store_true",
                       help="count the bytes autograd saves for backward in one forward, per token "
                            "and per module (deduplicated by storage, parameters excluded)")
    bench.add_argument("--compare-alst", action="store_true",
                       help="run stock DeepSpeed ALST's training step (its tutorial loop) beside "
                            "vlmcp's on an all-attention tiny model and one sample per length, in "
                            "interleaved fresh processes (--sp-size ranks), and report the step-time "
                            "and activation-memory ratios and the losses")
    bench.add_argument("--repeats", type=int, default=3,
                       help="--compare-alst: interleaved vlmcp/ALST pairs per length; --publish: "
                            "interleaved rounds of the three ways; --ep-size: timed steps a way")
    bench.add_argument("--ep-size", type=int, default=None, metavar="E",
                       help="instead of a step benchmark: on 2 ranks (gloo; --ep-world) and a MoE "
                            "of 64 experts top 8 (Qwen3.5-35B-A3B's layout cut to --hidden-size, "
                            "default 512), train AdamW steps four ways, ZeRO 3 and ZeRO 2 without "
                            "EP, ZeRO 2 at parallel.ep_size E, and DeepSpeed's AutoEP alone on "
                            "transformers' model, and report each way's step time, tokens/s, mfu, "
                            "the experts' params/grads/optimizer state a rank holds, its peak RSS "
                            "and the ratios to the targets; one --seq-lens length (tokens a rank, "
                            "default 512)")
    bench.add_argument("--ep-world", type=int, default=None, metavar="W",
                       help="--ep-size: the ranks each way runs on (default 2); above the machine's "
                            "cores the step times are not comparable, the memory figures are")
    bench.add_argument("--publish", action="store_true",
                       help="instead of a step benchmark: publish the weights of a tiny Qwen3.5 "
                            "widened to --hidden-size (default 2048, about 0.8 GB in fp32) on "
                            "--sp-size ranks (default 2) three ways, rank 0 alone "
                            "(publish.sharded false), rank-parallel, and rank-parallel in the "
                            "background, and report the time on the training's critical path, "
                            "the total time and rank 0's peak resident set of each")
    bench.add_argument("--publish-zero", type=int, choices=[0, 1, 2, 3], default=3,
                       help="--publish: the ZeRO stage of the run (default 3)")
    bench.add_argument("--engine-push", action="store_true",
                       help="instead of a step benchmark: start a vLLM server (the engine venv) on "
                            "the demo model, then on one of about 1.1 GB in bf16, and per model on "
                            "2 trainer ranks (ZeRO-3) time each step into the engine two ways: "
                            "published to disk and reloaded, and pushed in memory "
                            "(publish.engines) at bucket sizes of 64, 256 and 1024 MiB; reports "
                            "the engine's downtime per update, the training's critical path, the "
                            "bytes written to disk and where the push's time goes, --repeats "
                            "rounds each; then sparse pushes (publish.dense_every) after one "
                            "AdamW step at the RL demo's rate and at 1e-6")
    bench.add_argument("--push-models", default=None,
                       help="--engine-push: the models to time, comma-separated: demo (seconds "
                            "to minutes), large (about 1.1 GB in bf16; needs about 20 GB of free "
                            "memory); default both")
    bench.add_argument("--rl", action="store_true",
                       help="instead of a step benchmark: the whole loop (`vlmcp rl`, one vLLM "
                            "server from the engine venv, one trainer rank) on the demo model and "
                            "on one of about 1.1 GB in bf16, synchronous (rl.max_off_policy 0) "
                            "and asynchronous (1), --repeats fresh runs of --steps steps each; "
                            "reports each step's time split into generate, score, train, push "
                            "and the two sides' waits, min / median / max "
                            "(vlmcp/bench/rl_loop.py)")
    bench.add_argument("--length-mix", action="store_true",
                       help="instead of a step benchmark: train whole RL steps of mixed lengths "
                            "(seeded log-normal replies, a few at the limit, images) on --sp-size "
                            "ranks (default 2) with a fixed SP degree and with a degree per "
                            "micro-batch (parallel.sp_dynamic), --repeats interleaved fresh runs "
                            "of --warmup + --steps steps each, and report tokens/s and mfu of both")
    bench.add_argument("--mix-samples", type=int, default=None,
                       help="--length-mix: samples per step (default 64)")
    bench.add_argument("--mix-median", type=int, default=None,
                       help="--length-mix: median reply length in tokens (default 256)")
    bench.add_argument("--mix-long", type=int, default=None,
                       help="--length-mix: samples per step at the limit (default 1)")
    bench.add_argument("--mix-max-len", type=int, default=None,
                       help="--length-mix: data.max_seq_len, the limit (default 4096)")
    bench.add_argument("--mix-profile", action="store_true",
                       help="--length-mix: one more run each way under torch.profiler, reporting "
                            "each rank's seconds in each kind of collective")


def _add_bench_max_len_search(bench: argparse.ArgumentParser) -> None:
    """`--find-max-len`: the longest sample within a memory budget."""
    bench.add_argument("--find-max-len", action="store_true",
                       help="find the longest single sample whose step fits --memory-budget-gb")
    bench.add_argument("--memory-budget-gb", type=float, default=None,
                       help="peak memory budget per rank for --find-max-len (GiB)")
    bench.add_argument("--granularity", type=int, default=1024,
                       help="--find-max-len probes multiples of this many tokens")
    bench.add_argument("--max-probes", type=int, default=12, help="--find-max-len probe limit")


def _add_bench_training_jobs(bench: argparse.ArgumentParser) -> None:
    """`--data-scale` and `--rollout-rss`: short training jobs and their scratch folder."""
    bench.add_argument("--data-scale", default=None, metavar="N1,N2,...",
                       help="instead of a step benchmark: train a short SP job (tiny model, "
                            "--sp-size ranks, default 2, --steps steps) twice on synthetic "
                            "datasets of N 512x512-image samples each, and report each rank's "
                            "peak RSS, the length index build time and the second run's cache hit")
    bench.add_argument("--rollout-rss", default=None, metavar="P1,P2,...",
                       help="instead of a step benchmark: train a rollout job (tiny model, DP 1, "
                            "--steps steps) whose steps hold P one-image packs each, one fresh "
                            "process per P, and report the rank's peak RSS: flat in P when a "
                            "step's packs stream (e.g. 8,32,128)")
    bench.add_argument("--rollout-image-size", type=int, default=512,
                       help="side of the --rollout-rss samples' square images (pixels)")
    bench.add_argument("--data-max-seq-len", type=int, default=256,
                       help="data.max_seq_len of the --data-scale job")
    bench.add_argument("--data-workers", type=int, default=2,
                       help="data.num_workers of the --data-scale and --rollout-rss jobs")
    bench.add_argument("--scratch", default=None,
                       help="directory for --data-scale's, --rollout-rss's, --engine-mismatch's and "
                            "--publish's temporary files (default: the system temporary "
                            "directory)")


def _add_bench_engine_mismatch(bench: argparse.ArgumentParser) -> None:
    """`--engine-mismatch`: a vLLM server's logprobs against the trainer's."""
    bench.add_argument("--engine-mismatch", action="store_true",
                       help="instead of a step benchmark: sample image and text prompts from a "
                            "vLLM server (the engine venv, bf16) and compare its logprobs with "
                            "the trainer's on the same weights (lag 0): `vlmcp score` in fp32 "
                            "and bf16 (--sp-size ranks) and plain transformers variants; per "
                            "policy (--model, then every published step of --weights) "
                            "(vlmcp/bench/engine_mismatch.py, docs/rl-loop.md)")
    bench.add_argument("--weights", default=None, metavar="PUBLISH_DIR",
                       help="--engine-mismatch: measure every complete WEIGHTS/step_N there, "
                            "each served in place")
    bench.add_argument("--temperature", type=float, default=1.0,
                       help="--engine-mismatch: the sampling temperature (default 1)")


def _add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`vlmcp demo`: where and how the digits demo runs, and its RL and video variants."""
    demo = commands.add_parser(
        "demo", help="offline digits demo: build assets, train on 2 CPU ranks, evaluate, plot",
        description="Build a digits image-question dataset, a tiny tokenizer and a tiny "
                    "random-init Qwen3.5 checkpoint, train with torchrun on CPU, measure held-out "
                    "accuracy by generation and plot loss and accuracy.")
    demo.add_argument("--out", default=None,
                      help="output directory (default runs/demo, runs/demo_video with --video)")
    demo.add_argument("--nproc", type=int, default=2, help="ranks to train on")
    demo.add_argument("--sp-size", type=int, default=2, help="sequence-parallel size")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the job's)")
    demo.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="KEY.PATH=VALUE", help="override a key of the demo job; repeatable")
    demo.add_argument("--rl", action="store_true",
                      help="online RL instead: a short CE warm start, then the loop as a job of "
                           "`vlmcp rl` (OUT/rl/job.json): a vLLM server from the engine venv "
                           "that `make engine` builds, the trainer (ppo_clip at SP 2, torchrun) "
                           "and the orchestrator, one step off-policy; output in OUT/rl "
                           "(vlmcp/demo/rl.py; --steps sets the RL steps, --set the rl job's keys)")
    demo.add_argument("--weights", choices=("push", "files"), default=None,
                      help="how the RL demo's engine gets each trained step: push (default: "
                           "the trainer pushes it into the running server in memory, "
                           "rl.weights push) or files (published to OUT/rl/weights and reloaded "
                           "by the orchestrator)")
    demo.add_argument("--video", action="store_true",
                      help="video variant: synthetic digit clips (4 to 8 temporal groups, the "
                           "digit in one of them, noise in the others), 'Which digit appears in "
                           "the video?', trained at SP 2; exits 1 below 80 %% held-out accuracy "
                           "(vlmcp/demo/video.py)")


_RL_EPILOG = """\
the parts, each startable on its own (a cluster's launcher starts the trainer's ranks):
  vlmcp rl JOB.json --part engines                      vLLM servers; prints their URLs
  torchrun --nproc_per_node 8 -m vlmcp rl JOB.json --part trainer
  vlmcp rl JOB.json --part orchestrator                 against rl.engines
A signal (SIGTERM, SIGINT) stops every part after a trainer checkpoint; --set train.resume=true
continues the same prompt stream. docs/rl-loop.md: the rl section, rewards, metrics.
"""


def _add_rl(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`vlmcp rl`: the whole online RL loop, or one of its parts."""
    rl = commands.add_parser(
        "rl", help="the whole online RL loop from one job: engines, orchestrator, trainer",
        description="Start the engines (rl.engines, or rl.num_engines vLLM servers from the "
                    "engine venv), the trainer's ranks (torchrun on one host, output in "
                    "OUTPUT_DIR/rl/trainer.log) and the orchestrator (this process): prompts "
                    "from rl.prompts, answers from the engines, rewards, group advantages, "
                    "rollout steps into rollouts.dir, paced by rl.max_off_policy; the weights "
                    "come back through the push (rl.weights push) or publish.dir. One summary "
                    "line per step; every metric in OUTPUT_DIR/rl/metrics.jsonl.",
        epilog=_RL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_job_args(rl)
    rl.add_argument("--part", choices=("all", "engines", "orchestrator", "trainer"),
                    default="all", help="start one part only (default: all three)")
    rl.add_argument("--nproc", type=int, default=None,
                    help="trainer ranks on this host (default: the least common multiple of "
                         "parallel.sp_size and parallel.ep_size)")
    rl.add_argument("--engine-urls", nargs="+", default=None, metavar="URL",
                    help="--part trainer: the engines' base URLs when rl.engines is empty "
                         "(vlmcp rl passes the ones it started)")


def build_parser() -> argparse.ArgumentParser:
    """The `vlmcp` argument parser with one sub-command per action."""
    parser = argparse.ArgumentParser(
        prog="vlmcp",
        description="Train Qwen3.5 vision-language models on long packed multimodal sequences "
                    "with DeepSpeed and exact Ulysses sequence parallelism.")
    # The `deepspeed` launcher passes --local_rank=N before the command; LOCAL_RANK is used.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(commands)
    _add_validate(commands)
    _add_inspect(commands)
    _add_export(commands)
    _add_score(commands)
    _add_bench(commands)
    _add_demo(commands)
    _add_rl(commands)
    return parser


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if rank != 0:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _report(problems: Sequence[str]) -> int:
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return EXIT_PROBLEMS


def _settle_device() -> None:
    """Resolve CPU or CUDA once (`vlmcp.device`, which honours DS_ACCELERATOR=cpu) and tell
    DeepSpeed before it probes.

    On CPU the pure-torch DeltaNet and conv kernels are the intended path (the Triton ones need a
    GPU), so transformers' advice to install the fast kernels is silenced there.
    """
    from vlmcp.device import settle_accelerator

    if not settle_accelerator():
        logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)


def _cmd_train(args: argparse.Namespace) -> int:
    # os.environ: the settings `accelerate launch --config_file X.yaml` exports (config/launch_env.py).
    job = load_job(args.job, args.overrides, environ=os.environ)
    if job.rl.enabled:
        return _report(["the job has an rl section: train it with `vlmcp rl JOB.json` (all "
                        "parts) or, under your launcher, `vlmcp rl JOB.json --part trainer`"])
    return _train(job)


def _train(job: JobConfig) -> int:
    """Train `job` on this rank (`vlmcp train`, and the trainer part of `vlmcp rl`)."""
    from vlmcp.parallel import comm
    from vlmcp.training.loop import train
    from vlmcp.training.signals import StopRequested

    # The process group is torn down before the interpreter exits: gloo work objects still alive
    # during interpreter finalization end the process with SIGABRT ("terminate called without an
    # active exception"). Only where every rank stops together (success, a stop signal, and the
    # errors every rank raises together, `JobError.on_every_rank`): a rank that fails alone may
    # have pending work, on which destroy_process_group would wait.
    try:
        train(job)
    except StopRequested as exc:
        comm.shutdown()
        logging.getLogger("vlmcp").warning("%s (exit %d)", exc, exc.exit_code)
        return exc.exit_code
    except JobError as exc:
        if exc.on_every_rank:
            comm.shutdown()
        raise
    comm.shutdown()
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    job = load_job(args.job, args.overrides, environ=os.environ)
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "0")) or job.parallel.sp_size
    from vlmcp.training.preflight import run_preflight

    report = run_preflight(job, world_size, decode_images=True)
    problems = list(report.problems)
    if job.rl.enabled:
        from vlmcp.rl.preflight import rl_problems_before_start

        problems += rl_problems_before_start(job)
    if problems:
        return _report(problems)
    for note in report.resume.notes if report.resume is not None else []:
        print(f"train.resume: {note}")
    if job.rollouts.dir:
        print(f"ok: {args.job} (rollout steps from {job.rollouts.dir}, each checked when training "
              f"reaches it; {len(report.eval_index or ())} eval samples; world {world_size}, "
              f"sp_size {job.parallel.sp_size})")
        return 0
    from vlmcp.data.mixture import draws_per_epoch

    drawn = sum(draws_per_epoch(report.train_file_sizes, report.train_weights))
    per_epoch = f" ({drawn} per epoch)" if drawn != len(report.train_index) else ""
    print(f"ok: {args.job} ({len(report.train_index)} train{per_epoch}, "
          f"{len(report.eval_index or ())} eval samples; world {world_size}, "
          f"sp_size {job.parallel.sp_size})")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    job = load_job(args.job, args.overrides)
    from vlmcp.data.dataset import nth_samples
    from vlmcp.data.inspection import format_report, inspect_sample
    from vlmcp.data.processor import load_processor
    from vlmcp.data.sources import data_files
    from vlmcp.training.objective_step import token_array_names

    if args.sample < 0:
        return _report([f"--sample {args.sample}: must be >= 0"])
    try:
        processor = load_processor(job.resolve_input(job.model.path),
                                   job.data.chat_template_kwargs, job.data.empty_think,
                                   asdict(job.data.video))
    except (ProcessorError, OSError, ValueError) as exc:
        return _report([f"config key 'model.path': {exc}"])
    paths = [job.resolve_input(f.path) for f in data_files(job.data.train)]
    image_root = job.resolve_input(job.data.image_root) if job.data.image_root is not None else None
    samples = nth_samples(paths, args.sample, processor, job.data.max_seq_len, job.data.truncate,
                          image_root, token_array_names(job))
    reports = [inspect_sample(sample, processor) for sample in samples]
    if args.json:
        shown = reports[0] if len(reports) == 1 else {r["pair"]: r for r in reports}
        print(json.dumps(shown, indent=1))
    else:
        print("\n\n".join(format_report(r, color=sys.stdout.isatty()) for r in reports))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    job = load_job(args.job, args.overrides)
    from vlmcp.training.weights.export import export_checkpoint

    try:
        print(export_checkpoint(job, tag=args.tag, out_dir=args.out, merge=args.merge))
    except (FileNotFoundError, ValueError) as exc:
        return _report([str(exc)])
    return 0


def _cmd_score(args: argparse.Namespace) -> int:
    job = load_job(args.job, args.overrides)
    from vlmcp.parallel import comm
    from vlmcp.training.score import score

    try:
        path = score(job, out=args.out, entropy=args.entropy, routes=args.routes)
    except JobError as exc:
        if exc.on_every_rank:
            comm.shutdown()
        raise
    writer = comm.rank() == 0
    comm.shutdown()
    if writer:
        print(path)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from vlmcp.bench import run_bench

    try:
        run_bench(args)
    except ValueError as exc:
        return _report([str(exc)])
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [name for name, module in (("scikit-learn", "sklearn"), ("matplotlib", "matplotlib"))
               if importlib.util.find_spec(module) is None]
    if missing:
        return _report([f"vlmcp demo needs {' and '.join(missing)} (the demo extra): "
                        "pip install 'vlmcp[demo]'"])
    if args.rl and args.video:
        return _report(["demo: --rl and --video are separate demos; give one of them"])
    if args.weights is not None and not args.rl:
        return _report([f"demo: --weights {args.weights} applies to the RL demo only (--rl)"])
    if args.video:
        from vlmcp.demo.video import run_video_demo

        return run_video_demo(out_dir=args.out or "runs/demo_video", nproc=args.nproc,
                              sp_size=args.sp_size, steps=args.steps, overrides=args.overrides)
    out = args.out or "runs/demo"
    if args.rl:
        from vlmcp.demo.rl import run_rl_demo

        return run_rl_demo(out_dir=out, nproc=args.nproc, sp_size=args.sp_size,
                           steps=args.steps, overrides=args.overrides,
                           weights=args.weights or "push")
    from vlmcp.demo.image import run_demo

    return run_demo(out_dir=out, nproc=args.nproc, sp_size=args.sp_size, steps=args.steps,
                    overrides=args.overrides)


def _cmd_rl(args: argparse.Namespace) -> int:
    job = load_job(args.job, args.overrides, environ=os.environ)
    if not job.rl.enabled:
        return _report([f"{args.job}: no rl section (neither rl.prompts nor rl.environment is "
                        "set): `vlmcp train` trains it"])
    if args.part == "trainer":
        from vlmcp.config.rl_checks import trainer_job

        engines = args.engine_urls or job.rl.engines
        if job.rl.weights == "push" and not engines:
            return _report(["--part trainer pushes into the engines: name them in rl.engines "
                            "(or --engine-urls)"])
        return _train(trainer_job(job, engines))
    from vlmcp.rl import launch

    if args.part == "engines":
        return launch.run_engines(job)
    if args.part == "orchestrator":
        return launch.run_orchestrator(job)
    nproc = args.nproc or math.lcm(job.parallel.sp_size, job.parallel.ep_size)
    return launch.run_all(job, args.job, args.overrides, nproc)


COMMANDS = {"train": _cmd_train, "validate": _cmd_validate, "inspect": _cmd_inspect,
            "export": _cmd_export, "score": _cmd_score, "bench": _cmd_bench, "demo": _cmd_demo,
            "rl": _cmd_rl}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `vlmcp` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    _setup_logging()
    try:
        _settle_device()
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        # Every rank parses the same job file; one copy of the message is enough.
        return _report(exc.problems if os.environ.get("RANK", "0") == "0" else [])
    except JobError as exc:
        # The base of every user-facing error (vlmcp.errors): one line per problem, exit 1.
        return _report(exc.problems)
