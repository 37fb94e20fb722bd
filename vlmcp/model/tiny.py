"""Tiny Qwen3.5 configurations for tests, the demo and benchmarks.

The sizes keep every constraint of the real architecture (head_dim, MRoPE sections, vision
out_hidden_size == text hidden_size, special ids below vocab_size), so code that works on a tiny
model exercises the same paths as a published checkpoint.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

#: Special token ids used by the tiny models; the demo tokenizer places its specials here.
TINY_SPECIAL_IDS = {
    "image_token_id": 5,
    "video_token_id": 6,
    "vision_start_token_id": 3,
    "vision_end_token_id": 4,
}


def tiny_qwen3_5_config(
    *,
    moe: bool = False,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    full_attention_interval: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_head_dim: int = 16,
    linear_conv_kernel_dim: int = 4,
    vision_depth: int = 1,
    **text_overrides: Any,
) -> PretrainedConfig:
    """A small `Qwen3_5Config` (or `Qwen3_5MoeConfig` when `moe`) valid for every code path.

    Layer types repeat `full_attention_interval - 1` linear (DeltaNet) layers then one full
    attention layer, like the published checkpoints.
    """
    rotary_dims = int(head_dim * 0.25)
    half = rotary_dims // 2
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    layer_types = [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(num_hidden_layers)
    ]
    text: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "linear_conv_kernel_dim": linear_conv_kernel_dim,
        "linear_key_head_dim": linear_head_dim,
        "linear_value_head_dim": linear_head_dim,
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "layer_types": layer_types,
        "max_position_embeddings": 65536,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": mrope_section,
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.25,
        },
        "pad_token_id": 0,
        "bos_token_id": None,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    if moe:
        text.update(
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": hidden_size,
                "shared_expert_intermediate_size": hidden_size,
            }
        )
    text.update(text_overrides)
    vision = {
        "depth": vision_depth,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": hidden_size,
        "num_position_embeddings": 64,
    }
    config_class = Qwen3_5MoeConfig if moe else Qwen3_5Config
    return config_class(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        **TINY_SPECIAL_IDS,
    )


#: `tiny_qwen3_5_config(moe=True, **QWEN3_5_35B_A3B_HEADS)`: Qwen3.5-35B-A3B's published head
#: layout (DeltaNet 16 key / 32 value heads of 128, attention 16 / 2 heads of 256, its vocabulary,
#: top-8 routing over experts of 512) cut to 4 layers, 8 experts and hidden size 256: a model whose
#: activations per token are shaped like the real one's, small enough for a CPU.
QWEN3_5_35B_A3B_HEADS: dict[str, Any] = {
    "vocab_size": 248_320,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_head_dim": 128,
    "num_experts": 8,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
