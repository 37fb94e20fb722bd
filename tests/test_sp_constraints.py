"""Invalid SP layouts get one clear error line each, naming the config key."""

from vlmcp.model.tiny import tiny_qwen3_5_config
from vlmcp.parallel.constraints import check_sp_constraints


def _text(**overrides):
    return tiny_qwen3_5_config(**overrides).text_config


def test_valid_layouts_have_no_problems():
    assert check_sp_constraints(_text(), sp_size=2, world_size=4) == []
    assert check_sp_constraints(_text(num_key_value_heads=1), sp_size=4, world_size=4) == []
    assert check_sp_constraints(_text(linear_num_key_heads=4, linear_num_value_heads=4), 4, 4, "heads") == []


def test_world_size_not_divisible_by_sp_size_names_the_key():
    (line,) = check_sp_constraints(_text(), sp_size=2, world_size=3)
    assert "parallel.sp_size=2" in line and "world size (3" in line


def test_attention_heads_not_divisible_by_sp_size():
    problems = check_sp_constraints(_text(num_attention_heads=6, num_key_value_heads=2), sp_size=4, world_size=4)
    assert any("num_attention_heads=6" in p for p in problems)


def test_kv_heads_neither_dividing_nor_divisible():
    problems = check_sp_constraints(_text(num_attention_heads=12, num_key_value_heads=4), sp_size=6, world_size=6)
    assert problems == ["parallel.sp_size=6 and num_key_value_heads=4: one must divide the other "
                        "(kv heads are replicated when sp_size is the larger)"]


def test_heads_mode_needs_sp_size_dividing_deltanet_heads():
    problems = check_sp_constraints(_text(linear_num_key_heads=2, linear_num_value_heads=4), 4, 4, "heads")
    assert problems == ["parallel.deltanet_cp='heads' needs parallel.sp_size=4 to divide linear_num_key_heads=2"]


def test_unknown_deltanet_mode_is_named():
    (line,) = check_sp_constraints(_text(), 2, 2, "ring")
    assert "parallel.deltanet_cp" in line and "'ring'" in line
