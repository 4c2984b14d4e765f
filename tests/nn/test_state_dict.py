"""lstrain.nn modules' checkpoints: torch's keys, and load_state_dict reporting as torch's."""

import re

import pytest
import torch

import lstrain


class _HFStyleMLP(torch.nn.Module):
    def __init__(self, d, f, device=None):
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, f, bias=False, device=device)
        self.up_proj = torch.nn.Linear(d, f, bias=False, device=device)
        self.down_proj = torch.nn.Linear(f, d, bias=False, device=device)


class _TorchEmbedding(torch.nn.Module):
    """TransformerEmbedding's parameters as plain torch would hold them."""

    def __init__(self, vocab, dim, positions, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, dim, device=device))
        self.position_weight = torch.nn.Parameter(torch.randn(positions, dim, device=device))


class _TorchBias(torch.nn.Module):
    def __init__(self, features, device=None):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(features, device=device))


PAIRS = {
    "LayerNorm": (lambda d: lstrain.nn.LayerNorm(6, device=d), lambda d: torch.nn.LayerNorm(6, device=d)),
    "Linear": (lambda d: lstrain.nn.Linear(4, 6, device=d), lambda d: torch.nn.Linear(4, 6, device=d)),
    "Linear activation": (
        lambda d: lstrain.nn.Linear(4, 6, activation="gelu", device=d),
        lambda d: torch.nn.Linear(4, 6, device=d),
    ),
    "SwiGLUMLP": (lambda d: lstrain.nn.SwiGLUMLP(4, 6, device=d), lambda d: _HFStyleMLP(4, 6, device=d)),
    "SwiGLUMLP whole pair blocks": (
        lambda d: lstrain.nn.SwiGLUMLP(4, 300, device=d),
        lambda d: _HFStyleMLP(4, 300, device=d),
    ),
    "TransformerEmbedding": (
        lambda d: lstrain.nn.TransformerEmbedding(5, 4, 3, device=d),
        lambda d: _TorchEmbedding(5, 4, 3, device=d),
    ),
    "BiasDropoutResidual": (lambda d: lstrain.nn.BiasDropoutResidual(6, device=d), lambda d: _TorchBias(6, d)),
    "BiasActDropout": (lambda d: lstrain.nn.BiasActDropout(6, device=d), lambda d: _TorchBias(6, d)),
}


def _messages(error: RuntimeError) -> str:
    """The error's lines after its first (which names the module's class)."""
    return str(error).split("\n", 1)[1]


@pytest.mark.parametrize("pair", list(PAIRS))
def test_keys_round_trip_with_the_torch_counterpart(device, pair):
    make_ours, make_theirs = PAIRS[pair]
    ours, theirs = make_ours(device), make_theirs(device)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(value, theirs.state_dict()[key], rtol=0, atol=0)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_missing_and_unexpected_keys_reported_as_torch_does(device, pair):
    make_ours, make_theirs = PAIRS[pair]
    source = make_theirs(device).state_dict()
    for dropped in list(source):
        checkpoint = {key: value for key, value in source.items() if key != dropped}
        checkpoint["not_a_parameter"] = torch.zeros(1, device=device)
        ours, theirs = make_ours(device), make_theirs(device)
        with pytest.raises(RuntimeError) as our_error:
            ours.load_state_dict(checkpoint)
        with pytest.raises(RuntimeError) as their_error:
            theirs.load_state_dict(checkpoint)
        assert _messages(our_error.value) == _messages(their_error.value)
        assert re.search(rf'Missing key\(s\) in state_dict: "{re.escape(dropped)}"', str(our_error.value))
        ours, theirs = make_ours(device), make_theirs(device)
        before = {key: value.clone() for key, value in ours.state_dict().items()}
        assert ours.load_state_dict(checkpoint, strict=False) == theirs.load_state_dict(checkpoint, strict=False)
        # what was there loaded, what was missing kept its values: as torch does
        for key, value in ours.state_dict().items():
            expected = before[key] if key == dropped else checkpoint[key]
            torch.testing.assert_close(value, expected, rtol=0, atol=0)


@pytest.mark.parametrize("pair", ["SwiGLUMLP", "Linear", "LayerNorm"])
def test_size_mismatch_reported_as_torch_does(device, pair):
    make_ours, make_theirs = PAIRS[pair]
    checkpoint = make_theirs(device).state_dict()
    key = next(iter(checkpoint))
    checkpoint[key] = torch.zeros(7, 3, device=device)
    with pytest.raises(RuntimeError) as our_error:
        make_ours(device).load_state_dict(checkpoint)
    with pytest.raises(RuntimeError) as their_error:
        make_theirs(device).load_state_dict(checkpoint)
    assert _messages(our_error.value) == _messages(their_error.value)


def test_swiglu_assign_load_keeps_the_down_weight_contiguous(device):
    module = lstrain.nn.SwiGLUMLP(4, 6, device=device)
    source = _HFStyleMLP(4, 6, device=device)
    module.load_state_dict(source.state_dict(), assign=True)
    assert module.down_weight.is_contiguous()
    torch.testing.assert_close(module.down_weight, source.down_proj.weight.t(), rtol=0, atol=0)


def test_swiglu_partial_load_keeps_the_other_half_exactly(device):
    torch.manual_seed(0)
    module = lstrain.nn.SwiGLUMLP(4, 6, device=device)
    gate_before = module.state_dict()["gate_proj.weight"].clone()
    up = torch.randn(6, 4, device=device, dtype=torch.bfloat16)
    module.load_state_dict({"up_proj.weight": up}, strict=False)
    state = module.state_dict()
    torch.testing.assert_close(state["gate_proj.weight"], gate_before, rtol=0, atol=0)
    torch.testing.assert_close(state["up_proj.weight"], up.float(), rtol=0, atol=0)
