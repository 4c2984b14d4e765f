import pytest

from lstrain.layers import RotaryAttention


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(heads=4, kv_heads=3), "RotaryAttention: heads=4 must be a positive multiple of kv_heads=3"),
        (dict(heads=0, kv_heads=1), "RotaryAttention: heads must be an integer >= 1, got 0"),
        (dict(kv_heads=2.0), "RotaryAttention: kv_heads must be an integer >= 1, got float 2.0"),
        (dict(head_dim=7), "RotaryAttention: head_dim must be a positive even number, got 7"),
        (dict(attn_dropout=1.0), "RotaryAttention: attn_dropout must be in \\[0, 1\\), got 1.0"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    arguments = {"dim": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        RotaryAttention(**arguments)
