"""The DeepSpeed training run: config, distributed start, loop, checkpoints, metrics, export."""
