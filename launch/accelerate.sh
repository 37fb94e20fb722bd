#!/usr/bin/env bash
# Train a job with `accelerate launch` (DeepSpeed launcher) on NPROC ranks of this machine.
#   launch/accelerate.sh JOB.json [NPROC] [--set key.path=value ...]
# Uses launch/accelerate/deepspeed_<NPROC>proc.yaml.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
job=${1:?usage: launch/accelerate.sh JOB.json [NPROC] [--set key=value ...]}; shift
nproc=2
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then nproc=$1; shift; fi
config="$here/accelerate/deepspeed_${nproc}proc.yaml"
[[ -f $config ]] || { echo "no accelerate config for $nproc ranks: $config" >&2; exit 2; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec accelerate launch --config_file "$config" -m vlmcp train "$job" "$@"
