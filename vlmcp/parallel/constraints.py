"""What a model's shapes require of `parallel.sp_size` and `parallel.deltanet_cp`."""

from __future__ import annotations

from typing import Any

from vlmcp.parallel.modes import DELTANET_MODES


def check_sp_constraints(text_config: Any, sp_size: int, world_size: int, deltanet_cp: str = "state") -> list[str]:
    """One clear line per violated constraint (empty when the layout is valid).

    text_config: the model's text config (`config.text_config` of a Qwen3.5 VLM).
    """
    problems = []
    p = sp_size
    if p < 1:
        return [f"parallel.sp_size must be >= 1, got {p}"]
    if world_size % p:
        problems.append(f"parallel.sp_size={p} must divide the world size ({world_size} processes)")
    heads = text_config.num_attention_heads
    kv_heads = text_config.num_key_value_heads
    if heads % p:
        problems.append(f"parallel.sp_size={p} must divide the attention heads (num_attention_heads={heads})")
    if kv_heads % p and p % kv_heads:
        problems.append(
            f"parallel.sp_size={p} and num_key_value_heads={kv_heads}: one must divide the other "
            "(kv heads are replicated when sp_size is the larger)"
        )
    if deltanet_cp not in DELTANET_MODES:
        problems.append(f"parallel.deltanet_cp must be one of {list(DELTANET_MODES)}, got {deltanet_cp!r}")
    elif deltanet_cp == "heads":
        for key in ("linear_num_key_heads", "linear_num_value_heads"):
            n = getattr(text_config, key)
            if n % p:
                problems.append(f"parallel.deltanet_cp='heads' needs parallel.sp_size={p} to divide {key}={n}")
    return problems


def check_ep_constraints(text_config: Any, ep_size: int, world_size: int) -> list[str]:
    """One clear line per way `parallel.ep_size` cannot split the model's routed experts over
    `world_size` ranks (empty when it can, or when ep_size is 1).

    text_config: the model's text config (`config.text_config` of a Qwen3.5 VLM).
    """
    if ep_size == 1:
        return []
    experts = getattr(text_config, "num_experts", None)
    if not experts:
        return [f"parallel.ep_size={ep_size}: the model ({text_config.model_type}) has no routed "
                "experts to split (a dense model); set parallel.ep_size to 1"]
    problems = []
    if world_size % ep_size:
        problems.append(f"parallel.ep_size={ep_size} must divide the world size ({world_size} "
                        "processes)")
    if experts % ep_size:
        problems.append(f"parallel.ep_size={ep_size} must divide the routed experts of each MoE "
                        f"layer (num_experts={experts})")
    return problems
