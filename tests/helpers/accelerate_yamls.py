"""accelerate YAMLs in the shapes users have (accelerate's `accelerate config` output, TRL's
examples/accelerate_configs), and the environment `accelerate launch --config_file` gives the
processes for one, computed by accelerate's own launch code.
"""

from __future__ import annotations

import os
from pathlib import Path

BASE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_process_port: 0
main_training_function: main
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

#: TRL's examples/accelerate_configs/deepspeed_zero3.yaml shape, with SP 2.
TRL_ZERO3_SP2 = BASE_YAML + """\
deepspeed_config:
  deepspeed_multinode_launcher: standard
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
mixed_precision: bf16
parallelism_config:
  parallelism_config_dp_replicate_size: 1
  parallelism_config_dp_shard_size: 1
  parallelism_config_tp_size: 1
  parallelism_config_cp_size: 1
  parallelism_config_sp_size: 2
  parallelism_config_sp_backend: deepspeed
"""

#: `accelerate config`'s DeepSpeed answers written out (plugin keys, no JSON file).
ACCELERATE_PLUGIN_KEYS = BASE_YAML + """\
deepspeed_config:
  gradient_accumulation_steps: 4
  gradient_clipping: 0.5
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
mixed_precision: 'no'
"""


def accelerate_env(yaml_text: str, tmp_path: Path) -> dict[str, str]:
    """The ACCELERATE_* / PARALLELISM_CONFIG_* variables `accelerate launch --config_file` would
    export for this YAML, computed by accelerate's own launch code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml_text)
    args = launch_command_parser().parse_args(["--config_file", str(path), "-m", "vlmcp"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    # As accelerate's launch_command does before it calls the DeepSpeed launcher.
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config
                                                else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    return {k: v for k, v in env.items()
            if k.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_")) and k not in os.environ}
