"""`vlmcp bench`: measurements of the training step and of the data path, as JSON reports.

    run.py         step time, tokens/s and memory per pack length (and --loss-only, --find-max-len)
    inputs.py      synthetic packs: random text samples with images of mixed sizes
    procs.py       memory readings and the fresh rank processes each length runs in
    data_scale.py  --data-scale: does a rank's memory grow with the dataset size?
    rollout_rss.py --rollout-rss: does a rank's memory grow with a rollout step's size?
    engine_mismatch.py  --engine-mismatch: an inference engine's logprobs against the trainer's
    publish.py     --publish: the publish's time on the critical path, its total and rank 0's RSS
"""

from vlmcp.bench.run import run_bench

__all__ = ["run_bench"]
