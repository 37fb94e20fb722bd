#!/usr/bin/env bash
# Train a job on NPROC ranks of this machine with torchrun.
#   launch/torchrun.sh JOB.json [NPROC] [--set key.path=value ...]
set -euo pipefail
job=${1:?usage: launch/torchrun.sh JOB.json [NPROC] [--set key=value ...]}; shift
nproc=2
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then nproc=$1; shift; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun --nproc_per_node "$nproc" -m vlmcp train "$job" "$@"
