"""How the model's parts run under sequence parallelism: the values of `parallel.deltanet_cp` and
`parallel.vision` (the first of each is the default).

    DELTANET_MODES  "state": each rank runs its shard and the recurrent state passes from rank to
                    rank; "heads": an all-to-all regroups the whole sequence by head groups
    VISION_MODES    "split": each rank encodes a share of the pack's images and feature rows travel
                    to the ranks holding their placeholders; "replicated": every rank encodes all
"""

DELTANET_MODES = ("state", "heads")
VISION_MODES = ("split", "replicated")
