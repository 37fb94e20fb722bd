"""The Gated DeltaNet's depthwise causal conv over packed segments, in one conv1d call."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_segments(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lengths: list[int],
    left_context: torch.Tensor | None,
) -> torch.Tensor:
    """Depthwise causal conv restarted at every segment: [L, c] -> [L, c] (before activation).

    weight: [c, 1, w+1]; bias: [c] or None; lengths: N segment lengths summing to L. Each segment
    sees w zero tokens before it, except the first when `left_context` [w, c] is given (the
    previous rank's tokens, zeros where another sample).

    One conv1d over the whole shard: the tokens are spread into a [L + N*w, c] buffer with w
    rows before every segment (zeros, or `left_context` before the first), so no window reaches
    across a boundary; the outputs are read back at the tokens' rows. Same device code everywhere.
    """
    width = weight.shape[-1] - 1
    total, channels = x.shape
    gaps = width * torch.arange(1, len(lengths) + 1, device=x.device)
    sizes = torch.tensor(lengths, device=x.device)
    rows = torch.arange(total, device=x.device) + gaps.repeat_interleave(sizes, output_size=total)
    spread = x.new_zeros(total + width * len(lengths), channels, dtype=weight.dtype)
    spread = spread.index_copy(0, rows, x.to(weight.dtype))
    if left_context is not None:
        spread = torch.cat([left_context.to(weight.dtype), spread[width:]], dim=0)
    out = F.conv1d(spread.transpose(0, 1).unsqueeze(0), weight, bias, groups=channels)[0]
    return out.transpose(0, 1).index_select(0, rows - width).to(x.dtype)
