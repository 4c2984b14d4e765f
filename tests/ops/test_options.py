"""Scalar options across the ops: numbers in any host form, clear errors otherwise."""

import numpy as np
import pytest
import torch

from lstrain.ops import (
    attention_softmax,
    bias_act_dropout,
    bias_dropout_residual,
    cross_entropy,
    embedding,
    gemm,
    layer_norm,
    linear_cross_entropy,
    qkv_attention,
    rope,
    rope_qkv,
)
from lstrain.ops._lib.options import bool_option, float_option, int_option


def _calls(device):
    """name -> (a call taking the option's value, a good value, the bounds' text)."""
    x = torch.randn(4, 8, device=device)
    scores = torch.randn(1, 2, 3, 8, device=device)
    tokens = torch.tensor([[0, 2, 1]], device=device)
    table = torch.randn(3, 8, device=device)
    target = torch.tensor([1, 0, 7, 3], device=device)
    return {
        "attention_softmax scale": (lambda v: attention_softmax(scores, scale=v), 0.125, "a finite number"),
        "bias_dropout_residual dropout": (
            lambda v: bias_dropout_residual(x, None, x, dropout=v, seed=torch.tensor([1], device=device)),
            0.25,
            r"in \[0, 1\)",
        ),
        "bias_act_dropout dropout": (
            lambda v: bias_act_dropout(x, None, dropout=v, seed=torch.tensor([1], device=device)),
            0.25,
            r"in \[0, 1\)",
        ),
        "embedding dropout": (
            lambda v: embedding(tokens, table, dropout=v, seed=torch.tensor([1], device=device)),
            0.25,
            r"in \[0, 1\)",
        ),
        "embedding scale": (lambda v: embedding(tokens, table, scale=v), 2.0, "a finite number"),
        "layer_norm eps": (lambda v: layer_norm(x, 8, eps=v), 1e-3, "a finite number >= 0"),
        "cross_entropy label_smoothing": (
            lambda v: cross_entropy(x, target, label_smoothing=v),
            0.125,
            r"in \[0, 1\]",
        ),
        "cross_entropy z_loss": (lambda v: cross_entropy(x, target, z_loss=v), 1e-3, "a finite number >= 0"),
        "linear_cross_entropy label_smoothing": (
            lambda v: linear_cross_entropy(x, table, target % 3, label_smoothing=v),
            0.125,
            r"in \[0, 1\]",
        ),
        "linear_cross_entropy z_loss": (
            lambda v: linear_cross_entropy(x, table, target % 3, z_loss=v),
            1e-3,
            "a finite number >= 0",
        ),
        "gemm alpha": (lambda v: gemm(x, x.t(), alpha=v), 0.5, "a finite number"),
        "gemm beta": (lambda v: gemm(x, x.t(), c=x @ x.t(), beta=v), 0.5, "a finite number"),
    }


OPTIONS = list(_calls("cpu"))


@pytest.mark.parametrize("option", OPTIONS)
def test_numpy_scalars_and_0d_cpu_tensors_are_numbers(device, option):
    call, good, _ = _calls(device)[option]
    expected = call(good)
    for value in (np.float32(good), np.float64(good), torch.tensor(good), torch.tensor(good, dtype=torch.float64)):
        torch.testing.assert_close(call(value), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("option", OPTIONS)
def test_bad_values_name_the_option(device, option):
    call, _, bounds = _calls(device)[option]
    name = option.split()[1]
    for value in (float("nan"), float("inf"), True, "0.1", torch.ones(2), None):
        with pytest.raises(ValueError, match=rf"{option.split()[0]}: {name} must be {bounds}, got"):
            call(value)


@pytest.mark.gpu
@pytest.mark.parametrize("option", OPTIONS)
def test_a_cuda_tensor_option_asks_for_a_python_number(option):
    call, good, _ = _calls("cuda")[option]
    with pytest.raises(ValueError, match=rf"{option.split()[1]} must be .*0-d tensor on cuda.*pass a Python float"):
        call(torch.tensor(good, device="cuda"))


def test_option_helpers():
    assert float_option("op", "p", np.float32(0.5), 0, 1) == 0.5
    assert int_option("op", "i", np.int32(-3)) == -3 and int_option("op", "i", torch.tensor(7)) == 7
    with pytest.raises(ValueError, match=r"op: p must be in \(0, 1\], got 0"):
        float_option("op", "p", 0, 0, 1, low_open=True)
    with pytest.raises(ValueError, match="op: i must be an integer >= 1, got 0"):
        int_option("op", "i", 0, 1)
    with pytest.raises(ValueError, match="op: i must be an integer, got float 1.5"):
        int_option("op", "i", 1.5)


@pytest.mark.parametrize("value", [1.5, -100.0, True, "x"])
def test_ignore_index_must_be_an_integer(device, value):
    x, target = torch.randn(3, 5, device=device), torch.tensor([1, 2, 3], device=device)
    with pytest.raises(ValueError, match="cross_entropy: ignore_index must be an integer"):
        cross_entropy(x, target, ignore_index=value)
    with pytest.raises(ValueError, match="linear_cross_entropy: ignore_index must be an integer"):
        linear_cross_entropy(x, torch.randn(7, 5, device=device), target, ignore_index=value)


def test_ignore_index_and_padding_idx_take_numpy_and_0d_integers(device):
    x, target = torch.randn(3, 5, device=device), torch.tensor([1, 2, 3], device=device)
    expected = cross_entropy(x, target, ignore_index=2)
    for value in (np.int64(2), torch.tensor(2)):
        torch.testing.assert_close(cross_entropy(x, target, ignore_index=value), expected)
    tokens, table = torch.tensor([0, 1, 2], device=device), torch.randn(3, 4, device=device)
    torch.testing.assert_close(
        embedding(tokens, table, padding_idx=np.int64(1)), embedding(tokens, table, padding_idx=1)
    )
    with pytest.raises(ValueError, match="embedding: padding_idx must be an integer, got float 1.0"):
        embedding(tokens, table, padding_idx=1.0)


def _flag_calls(device):
    """name -> a call taking the flag's value (each a no-grad forward of a tiny input)."""
    scores = torch.randn(1, 2, 3, 3, device=device)
    x, tables = torch.randn(1, 2, 3, 8, device=device), torch.randn(3, 8, device=device)
    qkv = torch.randn(1, 3, 3 * 8, device=device)
    proj_x, weight = torch.randn(1, 3, 16, device=device), torch.randn(3 * 16, 16, device=device)
    return {
        "attention_softmax causal": lambda v: attention_softmax(scores, causal=v),
        "rope interleaved": lambda v: rope(x, tables, tables, interleaved=v),
        "rope_qkv interleaved": lambda v: rope_qkv(qkv, tables, tables, 1, 1, interleaved=v)[0],
        "qkv_attention causal": lambda v: qkv_attention(proj_x, weight, None, 1, causal=v),
    }


@pytest.mark.parametrize("flag", list(_flag_calls("cpu")))
def test_flags_are_bools(device, flag):
    """A flag is a bool in any host form; bool() of "no", 1 or None would read as a flag set or not."""
    call = _flag_calls(device)[flag]
    for value in (True, False):
        expected = call(value)
        for same in (np.bool_(value), torch.tensor(value)):
            torch.testing.assert_close(call(same), expected, rtol=0, atol=0)
    op, name = flag.split()
    for value in ("no", 1, None, torch.ones(2, dtype=torch.bool)):
        with pytest.raises(ValueError, match=rf"{op}: {name} must be a bool"):
            call(value)
    assert bool_option("op", "f", np.bool_(True)) is True


@pytest.mark.parametrize(
    ("check", "advice"),
    [(lambda v: bool_option("op", "f", v), r"pass a Python bool \(bool\(f\)"),
     (lambda v: int_option("op", "f", v), r"pass a Python int \(int\(f\)"),
     (lambda v: float_option("op", "f", v), r"pass a Python float \(float\(f\)")],
)  # fmt: skip
def test_a_device_tensor_option_is_told_the_conversion_its_check_takes(check, advice):
    with pytest.raises(ValueError, match=rf"op: f must be .* 0-d tensor on meta; .*{advice}"):
        check(torch.tensor(1, device="meta"))
