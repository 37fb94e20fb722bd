"""Where each optimizer step's packed micro-batches come from: the data files' packs of step N
(`step_packs`), or an RL producer's rollout step N, waited for, indexed, packed and loaded
(`rollout_steps`)."""
