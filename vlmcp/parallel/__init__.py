"""Process groups, collectives and sequence sharding. `comm` is the only module that talks to
torch.distributed / deepspeed.comm."""
