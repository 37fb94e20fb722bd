#!/usr/bin/env bash
# Train a job on NPROC ranks of this machine with the `deepspeed` launcher.
#   launch/deepspeed.sh JOB.json [NPROC] [--set key.path=value ...]
# On a CPU-only machine `--num_gpus N` still starts N ranks (DeepSpeed's CPU accelerator).
set -euo pipefail
job=${1:?usage: launch/deepspeed.sh JOB.json [NPROC] [--set key=value ...]}; shift
nproc=2
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then nproc=$1; shift; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec deepspeed --num_gpus "$nproc" --module vlmcp train "$job" "$@"
