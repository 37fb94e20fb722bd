"""How the model's parts run: the values of `parallel.deltanet_cp`, `parallel.vision` and
`model.deltanet_kernel` (the first of each is the default).

    DELTANET_MODES  "state": each rank runs its shard and the recurrent state passes from rank to
                    rank; "heads": an all-to-all regroups the whole sequence by head groups
    VISION_MODES    "split": each rank encodes a share of the pack's images and feature rows travel
                    to the ranks holding their placeholders; "replicated": every rank encodes all
    DELTANET_KERNELS "auto": vlmcp's pure-torch kernel on CPU, fla's on CUDA where its versions
                    allow; "fla": flash-linear-attention's Triton kernel; "torch": vlmcp's own
"""

DELTANET_MODES = ("state", "heads")
VISION_MODES = ("split", "replicated")
DELTANET_KERNELS = ("auto", "fla", "torch")
