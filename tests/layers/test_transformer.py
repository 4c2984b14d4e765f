"""lstrain.layers: each fused module against its plain-torch twin, same weights."""

import pytest
import torch

import lstrain.nn
from lstrain._backend import record_backends
from lstrain.layers import MLP, SelfAttention, TransformerLayer, sdpa_mask
from lstrain.testing import assert_all_passed, check_module
from tests.conftest import DEVICE, EXPECTED_BACKEND


class _Run(torch.nn.Module):
    """A layer called with fixed masks (check_module passes tensors positionally); an
    optional learned attention bias is a parameter of the wrapper, so it is checked too."""

    def __init__(self, layer, key_padding_mask=None, bias_shape=None):
        super().__init__()
        self.layer = layer
        self.key_padding_mask = key_padding_mask
        self.attn_bias = None if bias_shape is None else torch.nn.Parameter(torch.randn(bias_shape, device=DEVICE))

    def forward(self, x):
        return self.layer(x, self.key_padding_mask, self.attn_bias)


def _twins(attn_implementation="sdpa", **kwargs):
    torch.manual_seed(0)
    fused = TransformerLayer(fused=True, attn_implementation=attn_implementation, device=DEVICE, **kwargs)
    plain = TransformerLayer(fused=False, device=DEVICE, **kwargs)
    return fused, plain


def _padding(batch, seq, left=False):
    mask = torch.zeros(batch, seq, dtype=torch.bool, device=DEVICE)
    mask[-1, :3] = left
    mask[-1, -3:] = not left
    return mask


@pytest.mark.parametrize(
    ("norm_first", "padding", "learned_bias", "heads", "attn_implementation"),
    [
        (True, None, False, 4, "sdpa"),  # GPT-2: causal SDPA
        (True, None, False, 2, "lstrain"),  # the same through qkv_attention (head_dim 16)
        (False, None, False, 2, "lstrain"),  # BERT: post-LN, bidirectional, qkv_attention
        (True, None, False, 4, "lstrain"),  # head_dim 8: SDPA
        (True, "right", False, 2, "lstrain"),  # a padding mask: SDPA
        (True, "left", False, 4, "sdpa"),  # fully masked query rows stay finite
        (False, "right", False, 4, "sdpa"),
        (True, "right", True, 4, "sdpa"),  # a learned bias: attention_softmax
        (False, None, True, 2, "lstrain"),
    ],
)
def test_fused_matches_unfused(norm_first, padding, learned_bias, heads, attn_implementation):
    batch, seq, dim = 2, 8, 32
    fused, plain = _twins(attn_implementation, dim=dim, heads=heads, norm_first=norm_first, causal=norm_first)
    mask = None if padding is None else _padding(batch, seq, left=padding == "left")
    bias_shape = (1, heads, seq, seq) if learned_bias else None
    ours, theirs = _Run(fused, mask, bias_shape), _Run(plain, mask, bias_shape)
    x = torch.randn(batch, seq, dim, device=DEVICE)
    with record_backends() as ran:
        comparisons = check_module(ours, theirs, x, generator=torch.Generator().manual_seed(0))
    ops = {op for op, _ in ran}
    # each residual add and the LayerNorm after it in one kernel; pre-LN's last add has no
    # norm after it unless the caller passes the next one
    pre_ln = {"layer_norm", "dropout_add_layer_norm", "bias_act_dropout", "bias_dropout_residual"}
    assert ops - {"attention_softmax", "linear", "qkv_projection", "qkv_attention"} == (
        pre_ln if norm_first else {"dropout_add_layer_norm", "bias_act_dropout"}
    )
    assert ("attention_softmax" in ops) == learned_bias
    flash = attn_implementation == "lstrain" and heads == 2 and padding is None and not learned_bias
    assert ("qkv_attention" in ops) == flash and ("qkv_projection" in ops) == (not flash)
    assert {backend for _, backend in ran} == {EXPECTED_BACKEND}
    assert_all_passed(comparisons)


class _Stack(torch.nn.Module):
    """Pre-LN layers as GPT-2 chains them: each applies the next layer's ln_1 (the last, the
    final norm) in its last residual add and hands on the normalised copy."""

    def __init__(self, layers, final_norm):
        super().__init__()
        self.layers, self.final_norm = torch.nn.ModuleList(layers), final_norm

    def forward(self, x):
        normed = None
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].ln_1 if i + 1 < len(self.layers) else self.final_norm
            normed, x = layer(x, normed=normed, next_norm=next_norm)
        return torch.cat((normed, x), dim=-1)


def test_chained_pre_ln_layers_match_unfused():
    pairs = [_twins(dim=32, heads=4) for _ in range(2)]
    torch.manual_seed(1)
    final = torch.nn.LayerNorm(32, device=DEVICE)
    with torch.no_grad():
        final.weight.normal_()
        final.bias.normal_()
    fused_final = lstrain.nn.LayerNorm(32, device=DEVICE)
    fused_final.load_state_dict(final.state_dict())
    ours = _Stack([f for f, _ in pairs], fused_final)
    theirs = _Stack([p for _, p in pairs], final)
    x = torch.randn(2, 8, 32, device=DEVICE)
    with record_backends() as ran:
        comparisons = check_module(ours, theirs, x, generator=torch.Generator().manual_seed(0))
    ops = [op for op, _ in ran]
    assert ops.count("dropout_add_layer_norm") == 4 and ops.count("layer_norm") == 1  # only the first ln_1 alone
    assert "bias_dropout_residual" not in ops
    assert_all_passed(comparisons)


def test_a_next_norm_of_another_class_runs_its_own_forward():
    class ScaledNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return 2 * super().forward(x)

    layer, _ = _twins(dim=16, heads=2)
    norm = ScaledNorm(16, device=DEVICE)
    calls = []
    norm.register_forward_hook(lambda *args: calls.append(1))
    x = torch.randn(1, 4, 16, device=DEVICE)
    normed, out = layer(x, next_norm=norm)
    torch.testing.assert_close(normed, 2 * torch.nn.functional.layer_norm(out, (16,), norm.weight, norm.bias))
    assert calls == [1]


def test_post_ln_layers_refuse_a_next_norm():
    layer = TransformerLayer(16, 2, norm_first=False, causal=False, device=DEVICE)
    x = torch.randn(1, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="normed and next_norm apply to pre-LN layers"):
        layer(x, next_norm=layer.ln_1)


def test_state_dicts_move_between_twins():
    fused, plain = _twins(dim=16, heads=2)
    keys = {k: tuple(v.shape) for k, v in fused.state_dict().items()}
    assert keys == {k: tuple(v.shape) for k, v in plain.state_dict().items()}
    assert keys["attn.c_attn.weight"] == (48, 16)  # torch's Linear layout [out, in]
    plain.load_state_dict(fused.state_dict())


def test_sdpa_mask_is_finite_and_causal():
    padding = torch.tensor([[False, False, True]], device=DEVICE)
    mask = sdpa_mask(padding, 3, causal=True, dtype=torch.float16)
    assert mask.shape == (1, 1, 3, 3) and torch.isfinite(mask).all()
    attended = mask[0, 0] == 0
    assert attended.tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    assert sdpa_mask(padding, 3, causal=False, dtype=torch.float32).shape == (1, 1, 1, 3)


def test_dropout_is_finite_and_follows_the_seed():
    layer = TransformerLayer(32, 4, attn_dropout=0.1, resid_dropout=0.1, device=DEVICE)
    x = torch.randn(2, 8, 32, device=DEVICE)
    outs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outs.append(layer(x))
    assert all(torch.isfinite(o).all() for o in outs)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert not torch.equal(outs[0], outs[2])
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x), rtol=0, atol=0)


def test_given_seeds_fix_the_dropouts():
    # the model draws every layer's seeds at once; a layer given its three uses them, not torch's
    # generator (head_dim 16: the attention dropout is qkv_attention's)
    layer = TransformerLayer(32, 2, attn_dropout=0.5, resid_dropout=0.5, attn_implementation="lstrain", device=DEVICE)
    x = torch.randn(2, 8, 32, device=DEVICE)
    seeds = torch.tensor([5, 6, 7], dtype=torch.int64, device=DEVICE)
    torch.manual_seed(0)
    first = layer(x, seeds=seeds)
    torch.manual_seed(1)
    again = layer(x, seeds=seeds)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    for changed in range(3):
        other = seeds.clone()
        other[changed] += 10
        assert not torch.equal(first, layer(x, seeds=other)), f"seed {changed} changes nothing"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SelfAttention(30, 4), "dim=30 must be a multiple of heads=4"),
        (lambda: SelfAttention(32, 4, attn_implementation="flash"), "attn_implementation must be one of"),
        (lambda: SelfAttention(32, 4, attn_dropout=1.0), "attn_dropout must be in"),
        (lambda: MLP(32, 128, activation="tanh"), "activation must be one of"),
        (lambda: MLP(32, 128, dropout=-0.1), "dropout must be in"),
    ],
)
def test_bad_arguments_are_named(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.gpu
@pytest.mark.parametrize("attn_implementation", ["sdpa", "lstrain"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_fused_matches_unfused_bf16_on_the_gpu(norm_first, attn_implementation):
    batch, seq, dim, heads = 4, 256, 512, 8
    fused, plain = _twins(attn_implementation, dim=dim, heads=heads, norm_first=norm_first, causal=norm_first)
    fused, plain = fused.bfloat16(), plain.bfloat16()
    # qkv_attention takes no padding mask: without one it is the attention
    mask = _padding(batch, seq) if attn_implementation == "sdpa" else None
    x = torch.randn(batch, seq, dim, device="cuda", dtype=torch.bfloat16)
    comparisons = check_module(_Run(fused, mask), _Run(plain, mask), x, generator=torch.Generator().manual_seed(0))
    assert_all_passed(comparisons)


def test_the_plain_attention_softmax_keeps_a_nan_and_zeroes_rows_without_keys():
    from lstrain.layers.attention import _masked_softmax

    scores = torch.randn(2, 1, 3, 4, device=DEVICE)
    bias = torch.zeros(1, 1, 3, 4, device=DEVICE)
    bias[0, 0, 1, 2] = float("nan")
    padding = torch.zeros(2, 4, dtype=torch.bool, device=DEVICE)
    padding[1] = True  # the second sequence has no key at all
    probs = _masked_softmax(scores, 0.5, padding, bias, causal=False)
    assert probs[0, 0, 1].isnan().all()  # NaN in gives NaN out, as the fused softmax and SDPA
    assert not probs[0, 0, [0, 2]].isnan().any()
    assert torch.equal(probs[1], torch.zeros_like(probs[1]))
    # a row without keys passes a zero gradient back, not NaN (the fused softmax's too)
    scores.requires_grad_()
    (grad,) = torch.autograd.grad(_masked_softmax(scores, 0.5, padding, torch.zeros_like(bias), False).sum(), scores)
    assert torch.equal(grad[1], torch.zeros_like(grad[1])) and grad.isfinite().all()


@pytest.mark.parametrize(
    "x_shape, mask, match",
    [
        ((6, 32), None, r"x must be \[batch, seq, dim\], got shape \(6, 32\)"),
        ((2, 6, 32), torch.ones(2, 6, dtype=torch.long), "key_padding_mask must be bool .* got torch.int64"),
        ((2, 6, 32), torch.zeros(2, 5, dtype=torch.bool), r"key_padding_mask must be \[batch, seq\] = \(2, 6\)"),
    ],
)
def test_bad_attention_inputs_are_named(x_shape, mask, match):
    from lstrain.layers import RotaryAttention, rotary_cos_sin

    x = torch.randn(x_shape, device=DEVICE)
    mask = None if mask is None else mask.to(DEVICE)
    with pytest.raises(ValueError, match="SelfAttention: " + match):
        SelfAttention(32, 4, device=DEVICE)(x, x, key_padding_mask=mask)
    cos, sin = rotary_cos_sin(torch.arange(6, device=DEVICE), 8, 1e4, torch.float32)
    with pytest.raises(ValueError, match="RotaryAttention: " + match):
        RotaryAttention(32, 4, 2, 8, device=DEVICE)(x, cos, sin, key_padding_mask=mask)
