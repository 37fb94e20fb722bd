"""Which kernel runs the Gated DeltaNet core (`model.deltanet_kernel`), and the fla path.

"torch": vlmcp's own pure-torch core (`vlmcp.model.delta_rule`) on any device. "fla":
flash-linear-attention's varlen `chunk_gated_delta_rule` (CUDA only), after vlmcp's causal conv.
"auto": torch on CPU; on CUDA fla, where the installed versions run its backward correctly
(`fla_version_problem`), else one error naming the versions and the ways out. A forced "fla"
on such versions runs with a warning.

Legend as in `vlmcp.model.delta_rule`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import re
from collections.abc import Callable

import torch

from vlmcp.model.causal_conv import causal_conv_segments
from vlmcp.model.delta_rule import HeadLayout, conv_delta_rule
from vlmcp.errors import KernelError
from vlmcp.parallel.modes import DELTANET_KERNELS

logger = logging.getLogger(__name__)

#: Below these, fla's GDN backward raises or is wrong (fla issue #640).
MIN_TORCH = (2, 13)
MIN_FLA = (0, 6, 0)
#: fla 0.6.0's GDN backward raises on Hopper (compute capability 9.x) with an older triton.
MIN_TRITON_HOPPER = (3, 7, 1)


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    """"2.11.0+cu130" -> (2, 11, 0); None stays None."""
    if text is None:
        return None
    match = re.match(r"\d+(\.\d+)*", text)
    return tuple(int(part) for part in match.group(0).split(".")) if match else None


def fla_version_problem(torch_version: tuple[int, ...], fla_version: tuple[int, ...] | None,
                        triton_version: tuple[int, ...] | None,
                        capability: tuple[int, int]) -> str | None:
    """Why fla's GDN kernel cannot train on this machine (None: it can), from version tuples and
    the GPU's compute capability."""
    if fla_version is None:
        return "flash-linear-attention is not installed"
    found = (f"torch {_dotted(torch_version)}, flash-linear-attention {_dotted(fla_version)}, "
             f"triton {_dotted(triton_version) if triton_version else 'absent'}")
    if torch_version < MIN_TORCH or fla_version < MIN_FLA:
        return (f"{found}: fla's GDN backward needs torch >= {_dotted(MIN_TORCH)} and "
                f"flash-linear-attention >= {_dotted(MIN_FLA)} (fla issue #640)")
    if capability[0] == 9 and (triton_version is None or triton_version < MIN_TRITON_HOPPER):
        return (f"{found}: fla's GDN backward raises on Hopper (sm_{capability[0]}{capability[1]}) "
                f"with triton < {_dotted(MIN_TRITON_HOPPER)}")
    return None


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@functools.cache
def _installed(name: str) -> tuple[int, ...] | None:
    try:
        return version_tuple(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_fla_problem(device: torch.device) -> str | None:
    """`fla_version_problem` for the installed packages and `device`'s GPU."""
    capability = torch.cuda.get_device_capability(device)
    return fla_version_problem(version_tuple(torch.__version__), _installed("flash-linear-attention"),
                               _installed("triton"), capability)


def resolve_kernel(choice: str, device: torch.device) -> str:
    """The kernel ("fla" or "torch") that `model.deltanet_kernel` = `choice` runs on `device`
    (`choose_kernel` with the installed versions); raises KernelError when it cannot run."""
    on_cuda = device.type == "cuda"
    problem = _cached_problem(device.index or 0) if on_cuda and choice != "torch" else None
    return choose_kernel(choice, on_cuda, problem)


def choose_kernel(choice: str, on_cuda: bool, fla_problem: str | None) -> str:
    """"fla" or "torch" for `choice` on a CUDA device or not, given why fla cannot train there
    (`fla_version_problem`, None: it can). Raises KernelError for "fla" off CUDA and for "auto"
    where fla is gated; a forced "fla" on gated versions runs with a warning."""
    if choice not in DELTANET_KERNELS:
        raise KernelError(f"must be one of {list(DELTANET_KERNELS)}, got {choice!r}")
    if choice == "torch" or (choice == "auto" and not on_cuda):
        return "torch"
    if not on_cuda:
        raise KernelError("'fla' needs CUDA, and this run is not on CUDA (use 'auto' or 'torch')")
    if fla_problem and choice == "auto":
        raise KernelError(f"'auto' would run fla's GDN kernel on CUDA, but {fla_problem}. Upgrade "
                          f"torch to >= {_dotted(MIN_TORCH)} (with flash-linear-attention >= "
                          f"{_dotted(MIN_FLA)}, and triton >= {_dotted(MIN_TRITON_HOPPER)} on Hopper), "
                          "or set model.deltanet_kernel: torch (vlmcp's pure-torch kernel, exact on "
                          "any device)")
    if fla_problem:
        logger.warning("model.deltanet_kernel 'fla' forced although %s", fla_problem)
    return "fla"


@functools.cache
def _cached_problem(index: int) -> str | None:
    return installed_fla_problem(torch.device("cuda", index))


def deltanet_core(
    mixed: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    left_context: torch.Tensor | None,
    g: torch.Tensor,
    beta: torch.Tensor,
    lengths: list[int],
    initial_states: list[torch.Tensor | None],
    layout: HeadLayout,
    activation: Callable[[torch.Tensor], torch.Tensor] | None,
    kernel: str = "auto",
    value_pad: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """conv -> activation -> gated delta rule over packed segments with the kernel `kernel`
    resolves to on mixed's device. Arguments and shapes as `conv_delta_rule`'s.
    Returns (out [L, H_v, V + value_pad], final states [N, H_v, K, V + value_pad] fp32)."""
    if resolve_kernel(kernel, mixed.device) == "torch":
        return conv_delta_rule(mixed, weight, bias, left_context, g, beta, lengths, initial_states,
                               layout, activation, value_pad)
    act = mixed
    if weight is not None:
        act = activation(causal_conv_segments(mixed, weight, bias, lengths, left_context))
    n = act.shape[0]
    q, k, v = act.split(layout.split, dim=-1)
    v = v.reshape(n, layout.value_heads, layout.value_dim)
    if value_pad:
        v = torch.nn.functional.pad(v, (0, value_pad))
    return _fla_varlen(q.reshape(n, layout.key_heads, layout.key_dim),
                       k.reshape(n, layout.key_heads, layout.key_dim), v, g, beta, lengths,
                       initial_states)


def delta_rule_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lengths: list[int],
    initial_states: list[torch.Tensor | None],
    kernel: str = "auto",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The gated delta rule alone (no conv) per segment: q, k [L, H_k, K]; v [L, H_v, V]; g, beta
    [L, H_v]; initial_states: N entries [H_v, K, V] or None. Returns (out [L, H_v, V], N final
    states [H_v, K, V] fp32)."""
    n = q.shape[0]
    layout = HeadLayout(q.shape[1], q.shape[2], v.shape[1], v.shape[2])
    mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
    out, finals = deltanet_core(mixed, None, None, None, g, beta, lengths, initial_states, layout,
                                None, kernel)
    return out, list(finals.unbind(0))


def _fla_varlen(q, k, v, g, beta, lengths, initial_states):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    heads, kdim, vdim = v.shape[1], q.shape[-1], v.shape[-1]
    zero = q.new_zeros(heads, kdim, vdim, dtype=torch.float32)
    init = torch.stack([zero if s is None else s.float() for s in initial_states])
    cu = torch.tensor([0] + list(lengths), device=q.device).cumsum(0)
    out, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None].float(), beta=beta[None], initial_state=init,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )
    return out[0], final
