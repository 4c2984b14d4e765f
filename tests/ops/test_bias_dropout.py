"""bias_dropout_residual and bias_act_dropout (they share the dropout machinery)."""

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import example, given

import lstrain
from lstrain.ops import (
    bias_act_dropout,
    bias_act_dropout_ref,
    bias_dropout_residual,
    bias_dropout_residual_ref,
    embedding,
)
from lstrain.ops._lib.dropout import dropout_mask, dropout_mask_ref, dropout_seeds, elementwise_plan
from lstrain.testing import assert_all_passed
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import bias_dropout_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND


def _case(shape=(3, 40), dtype=torch.float32, bias=True, dropout=0.1, training=True, activation="gelu", seed=0):
    return {
        "shape": shape,
        "dtype": dtype,
        "bias": bias,
        "dropout": dropout,
        "training": training,
        "activation": activation,
        "seed": seed,
    }


@pytest.mark.parametrize("op", ["bias_dropout_residual", "bias_act_dropout"])
@given(case=bias_dropout_cases(DEVICE))
@example(case=_case(shape=(1, 1)))
@example(case=_case(shape=(2, 3, 1025), dtype=torch.bfloat16, dropout=0.5))  # two column blocks
@example(case=_case(dtype=torch.float16, bias=False, training=False, activation="gelu_tanh"))
@example(case=_case(shape=(70, 33), dropout=0.9, activation="silu"))
@example(case=_case(shape=(11, 1024), dtype=torch.bfloat16))  # 2 whole 4-row tiles + the 3rd walker's partial one
@example(case=_case(dropout=0.0, activation="relu"))
def test_matches_torch_under_the_same_mask(op, case):
    result = OP_CHECKS[op].run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


@pytest.mark.parametrize("p", [0.001, 0.1, 0.5, 0.9])
def test_keep_rate_is_binomially_right(device, p):
    n = 200_000
    seed = torch.tensor([7], dtype=torch.int64, device=device)
    kept = dropout_mask(seed, (n,), p).sum().item()
    mean, std = n * (1 - p), math.sqrt(n * p * (1 - p))
    assert abs(kept - mean) < 5 * std, (kept, mean, std)


def test_the_eight_draws_of_one_philox_call_are_independent(device):
    """Neighbouring columns share a Philox call (eight 16-bit halves of its four outputs):
    each column class mod 8 keeps at the right rate, and neighbours agree as often as
    independent draws would."""
    rows, cols, p = 64, 1000, 0.5
    seed = torch.tensor([11], dtype=torch.int64, device=device)
    keep = dropout_mask(seed, (rows, cols), p).float()
    n = rows * cols // 8
    for phase in range(8):
        kept = keep[:, phase::8].sum().item()
        assert abs(kept - n * (1 - p)) < 5 * math.sqrt(n * p * (1 - p)), (phase, kept)
    agree = (keep[:, 1:] == keep[:, :-1]).float().mean().item()
    pairs = rows * (cols - 1)
    assert abs(agree - 0.5) < 5 * math.sqrt(0.25 / pairs), agree
    assert not torch.equal(keep[0], keep[1]), "rows must draw different masks"


def test_reproducible_under_manual_seed(device):
    x = torch.randn(16, 64, device=device)
    residual = torch.randn_like(x)
    torch.manual_seed(3)
    a = bias_dropout_residual(x, None, residual, dropout=0.3)
    torch.manual_seed(3)
    b = bias_dropout_residual(x, None, residual, dropout=0.3)
    c = bias_dropout_residual(x, None, residual, dropout=0.3)
    assert torch.equal(a, b) and not torch.equal(b, c)


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_rows_of_zero_width(device, p):
    """A [3, 0] input gives empty outputs and gradients (no launch on zero columns)."""
    x = torch.randn(3, 0, device=device, requires_grad=True)
    bias = torch.randn(0, device=device, requires_grad=True)
    residual = torch.randn(3, 0, device=device, requires_grad=True)
    bias_dropout_residual(x, bias, residual, dropout=p).sum().backward()
    assert x.grad.shape == (3, 0) and bias.grad.shape == (0,) and residual.grad.shape == (3, 0)
    x.grad = bias.grad = None
    y = bias_act_dropout(x, bias, dropout=p)
    y.sum().backward()
    assert y.shape == (3, 0) and x.grad.shape == (3, 0) and bias.grad.shape == (0,)


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_nan_in_gives_nan_out_even_where_dropped(device, activation):
    """torch's dropout multiplies by the mask (NaN * 0 = NaN) and relu(NaN) is NaN: a
    NaN input or upstream gradient must not turn into zeros."""
    x = torch.full((4, 64), float("nan"), device=device, requires_grad=True)
    residual = torch.zeros(4, 64, device=device)
    y = bias_dropout_residual(x, None, residual, dropout=0.5)
    assert torch.isnan(y).all()
    y.backward(torch.full_like(y, float("nan")))
    assert torch.isnan(x.grad).all()
    x.grad = None
    y = bias_act_dropout(x, None, activation=activation, dropout=0.5)
    assert torch.isnan(y).all()


# NaN, the infinities and finite values around them; larger finite values overflow
# differently in torch's fp32 and fp64 gelu_tanh backward, so they are left out
SPECIAL_VALUES = [float("nan"), float("inf"), float("-inf"), 0.0, 1.0, -1.0, 30.0, -30.0, 100.0, -100.0]


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
def test_nan_and_infinities_as_torch(device, activation):
    """Forward and backward through NaN and +-inf give what torch's activation gives (as
    computed in fp64, which agrees with its CUDA fp32 kernels): relu's backward passes the
    gradient through a NaN (torch zeroes it only where x <= 0)."""
    x = torch.tensor(SPECIAL_VALUES, device=device).repeat(3, 1).requires_grad_()
    y = bias_act_dropout(x, None, activation=activation)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    x64 = x.detach().double().requires_grad_()
    y64 = bias_act_dropout_ref(x64, None, activation=activation, dropout=0.0)
    (dx64,) = torch.autograd.grad(y64, x64, torch.ones_like(y64))
    torch.testing.assert_close(y.double(), y64, equal_nan=True, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.double(), dx64, equal_nan=True, rtol=1e-5, atol=1e-6)


def test_eval_mode_and_zero_rate_are_plain_adds(device):
    x, residual = torch.randn(4, 10, device=device), torch.randn(4, 10, device=device)
    bias = torch.randn(10, device=device)
    expected = x + bias + residual
    torch.testing.assert_close(bias_dropout_residual(x, bias, residual, dropout=0.5, training=False), expected)
    torch.testing.assert_close(bias_dropout_residual(x, bias, residual, dropout=0.0), expected)
    y = bias_act_dropout(x, bias, activation="relu", dropout=0.5, training=False)
    torch.testing.assert_close(y, torch.relu(x + bias))


def test_backward_regenerates_the_forward_mask(device):
    x = torch.randn(8, 50, device=device, requires_grad=True)
    seed = torch.tensor([11], dtype=torch.int64, device=device)
    y = bias_dropout_residual(x, None, torch.zeros_like(x), dropout=0.4, seed=seed)
    y.backward(torch.ones_like(y))
    dropped = y == 0
    assert torch.equal(x.grad == 0, dropped)
    torch.testing.assert_close(x.grad[~dropped], torch.full_like(x.grad[~dropped], 1 / 0.6))


@pytest.mark.parametrize("op", ["bias_dropout_residual", "bias_act_dropout"])
def test_strided_bias(device, op):
    """A bias that is a strided view (every other element of a buffer) is read by value,
    and its gradient reaches the buffer's elements."""
    x, residual = torch.randn(5, 6, device=device), torch.randn(5, 6, device=device)
    buffer = torch.randn(12, device=device, requires_grad=True)
    if op == "bias_dropout_residual":
        y, expected = bias_dropout_residual(x, buffer[::2], residual), x + buffer.detach()[::2] + residual
    else:
        y, expected = bias_act_dropout(x, buffer[::2], activation="relu"), torch.relu(x + buffer.detach()[::2])
    torch.testing.assert_close(y, expected)
    (grad,) = torch.autograd.grad(y.sum(), buffer)
    assert not grad[1::2].any() and grad[::2].abs().sum() > 0


def test_residual_gradient_is_dy(device):
    x = torch.randn(3, 20, device=device, requires_grad=True)
    residual = torch.randn(3, 20, device=device, requires_grad=True)
    dy = torch.randn(3, 20, device=device)
    bias_dropout_residual(x, None, residual, dropout=0.2).backward(dy)
    assert torch.equal(residual.grad, dy)


def test_bias_gradients_are_deterministic(device):
    x = torch.randn(300, 130, device=device, requires_grad=True)
    bias = torch.randn(130, device=device, requires_grad=True)
    seed = torch.tensor([5], dtype=torch.int64, device=device)
    dy = torch.randn(300, 130, device=device)
    grads = [
        torch.autograd.grad(bias_act_dropout(x, bias, activation="silu", dropout=0.1, seed=seed), bias, dy)[0]
        for _ in range(3)
    ]
    assert all(torch.equal(grads[0], g) for g in grads[1:])


# Each op with a seed, as masks: inputs of ones, so y != 0 exactly where an element is kept.
_SEEDED_MASKS = """
import torch
from lstrain._backend import record_backends
from lstrain.ops import bias_act_dropout, bias_dropout_residual, embedding

def seeded_masks(device):
    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    x = torch.ones(5, 3, 37, device=device)
    tokens = torch.tensor([[0, 1, 2, 1], [2, 2, 0, 1]], device=device)
    with record_backends() as ran:
        masks = [
            bias_dropout_residual(x, None, torch.zeros_like(x), dropout=0.3, seed=seed) != 0,
            bias_act_dropout(x, None, activation="relu", dropout=0.3, seed=seed) != 0,
            embedding(tokens, torch.ones(3, 37, device=device), dropout=0.3, seed=seed) != 0,
        ]
    return [mask.cpu() for mask in masks], sorted({backend for _, backend in ran})
"""


def test_a_seed_gives_the_same_mask_on_the_reference_path(device, tmp_path):
    """The plain-PyTorch path (a CPU tensor without the interpreter, which a backend fixes
    at import, hence the subprocess) draws the kernels' own mask from a seed."""
    script = (
        _SEEDED_MASKS
        + f"\nmasks, backends = seeded_masks('cpu')\ntorch.save((masks, backends), {str(tmp_path / 'ref.pt')!r})\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=os.getcwd())
    reference_masks, reference_backends = torch.load(tmp_path / "ref.pt")
    assert reference_backends == ["reference"]
    namespace = {}
    exec(_SEEDED_MASKS, namespace)
    masks, backends = namespace["seeded_masks"](device)
    assert backends == [EXPECTED_BACKEND]
    for mask, reference in zip(masks, reference_masks, strict=True):
        assert 0 < mask.float().mean() < 1
        assert torch.equal(mask, reference)


@pytest.mark.parametrize("shape", [(1, 1), (3, 8), (2, 3, 17), (4, 1033)])
@pytest.mark.parametrize("seed", [0, 7, -5, 2**40 + 3])
def test_plain_pytorch_philox_is_the_kernels(device, shape, seed):
    seed = torch.tensor([seed], dtype=torch.int64, device=device)
    for p in (0.1, 0.5, 0.9):
        assert torch.equal(dropout_mask_ref(seed, shape, p), dropout_mask(seed, shape, p))


@pytest.mark.parametrize(
    "make_seed, match",
    [
        (lambda device: 3, "seed must be a 1-element int64 tensor, got int 3"),
        (lambda device: torch.tensor([3.0], device=device), "seed must be a 1-element int64 tensor, got torch.float32"),
        (
            lambda device: torch.tensor([1, 2, 3], device=device),
            r"seed must be a 1-element int64 tensor, got torch.int64 of shape \(3,\)",
        ),
        (lambda device: torch.tensor([3], dtype=torch.int32, device=device), "got torch.int32"),
        (lambda device: torch.tensor([3], device="meta"), "seed is on meta"),
    ],
)
def test_bad_seed_names_the_argument(device, make_seed, match):
    seed = make_seed(device)
    x = torch.randn(2, 8, device=device)
    calls = [
        lambda: bias_dropout_residual(x, None, x, dropout=0.1, seed=seed),
        lambda: bias_act_dropout(x, None, dropout=0.1, seed=seed),
        lambda: embedding(torch.zeros(2, 3, dtype=torch.long, device=device), x, dropout=0.1, seed=seed),
        lambda: dropout_mask(seed, (2, 8), 0.1),
    ]
    for call in calls[: 3 if isinstance(seed, int) or seed.is_meta else 4]:
        with pytest.raises(ValueError, match=match):
            call()


def test_dropout_seeds_are_one_draw_of_torch_generator(device):
    torch.manual_seed(3)
    seeds = dropout_seeds(5, device)
    torch.manual_seed(3)
    assert seeds.shape == (5,) and seeds.dtype == torch.int64 and seeds.device.type == torch.device(device).type
    torch.testing.assert_close(seeds, torch.randint(0, 2**31 - 1, (5,), device=device, dtype=torch.int64))
    for count in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="dropout_seeds: count must be an int >= 1"):
            dropout_seeds(count, device)


@pytest.mark.parametrize(
    "shape, p, match",
    [
        ((2, 8), 1.5, r"p must be in \[0, 1\], got 1.5"),
        ((2, 8), -0.1, r"p must be in \[0, 1\], got -0.1"),
        ((2, 8), float("nan"), r"p must be in \[0, 1\], got nan"),
        ((), 0.1, r"shape must have at least one dim"),
        ((2, -1), 0.1, r"shape must be a sequence of non-negative ints, got \(2, -1\)"),
        (5, 0.1, r"shape must be a sequence of non-negative ints, got 5"),
    ],
)
def test_dropout_mask_refuses_a_bad_p_or_shape(device, shape, p, match):
    """Unchecked, p > 1 kept nothing, p < 0 or NaN kept everything and () raised IndexError."""
    with pytest.raises(ValueError, match=match):
        dropout_mask(torch.tensor([3], device=device), shape, p)


def test_dropout_mask_takes_p_as_a_0_d_tensor(device):
    seed = torch.tensor([3], device=device)
    assert torch.equal(dropout_mask(seed, (2, 8), torch.tensor(0.5)), dropout_mask(seed, (2, 8), 0.5))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: bias_dropout_residual(x, torch.zeros(7), x), "bias has shape \\(7,\\), expected \\(8,\\)"),
        (lambda x: bias_dropout_residual(x, None, x[:, :4]), "residual must match x"),
        (lambda x: bias_dropout_residual(x, None, x.long()), "residual has dtype torch.int64; expected a float"),
        (lambda x: bias_dropout_residual(x, None, x, dropout=1.0), "dropout must be in \\[0, 1\\), got 1.0"),
        (lambda x: bias_act_dropout(x.long(), None), "x has dtype torch.int64"),
        (lambda x: bias_act_dropout(x, None, activation="tanh"), "activation must be one of"),
        (lambda x: bias_act_dropout(x, torch.zeros(8, device="meta")), "bias is on meta"),
        (lambda x: lstrain.nn.BiasActDropout(8, dropout=-0.1), "dropout must be in"),
    ],
)
def test_bad_input_names_the_argument(device, call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(2, 8, device=device))


def test_launch_plan():
    assert elementwise_plan(4096).block_cols == 1024 and elementwise_plan(4096).block_rows == 4
    assert elementwise_plan(10).block_cols == 16
    for cols in (1, 3, 1000, 11008):
        plan = elementwise_plan(cols)
        assert plan.block_rows * plan.block_cols <= 4096 and plan.num_warps == 4


def test_modules(device):
    torch.manual_seed(0)
    tail = lstrain.nn.BiasDropoutResidual(12, dropout=0.5, device=device)
    mlp = lstrain.nn.BiasActDropout(12, "gelu_tanh", dropout=0.5, device=device)
    assert set(dict(tail.named_parameters())) == {"bias"}
    x, residual = torch.randn(2, 12, device=device), torch.randn(2, 12, device=device)
    tail.eval()
    mlp.eval()
    torch.testing.assert_close(tail(x, residual), x + residual)
    torch.testing.assert_close(mlp(x), torch.nn.functional.gelu(x, approximate="tanh"))
    assert "activation='gelu_tanh'" in repr(mlp)
    # dtypes as torch's promotion gives them: a bf16 x, an fp32 bias or stream give fp32
    half = x.bfloat16()
    assert tail(half, residual).dtype == (residual + (half + tail.bias)).dtype == torch.float32
    assert mlp(half).dtype == torch.float32
    torch.testing.assert_close(tail(half, residual), residual + half.float())
    for module, args in ((tail, (x[:, :7], residual[:, :7])), (mlp, (x[:, :7],))):
        module.bias = None
        with pytest.raises(ValueError, match=r"x's last dim must be features \(12\), got shape \(2, 7\)"):
            module(*args)


def test_torch_compile_fullgraph(device):
    bias = torch.randn(32, device=device, requires_grad=True)
    seed = torch.tensor([1], dtype=torch.int64, device=device)

    def f(x, residual):
        h = bias_act_dropout(x, bias, activation="gelu", dropout=0.1, seed=seed)
        return bias_dropout_residual(h, bias, residual, dropout=0.1, seed=seed).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x, residual = torch.randn(4, 32, device=device), torch.randn(4, 32, device=device)
    out = compiled(x, residual)
    (grad,) = torch.autograd.grad(out, bias)
    ref_out = f(x, residual)
    (ref_grad,) = torch.autograd.grad(ref_out, bias)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)


def test_custom_ops_pass_opcheck(device):
    x, residual = torch.randn(5, 24, device=device), torch.randn(5, 24, device=device)
    bias = torch.randn(24, device=device)
    seed = torch.tensor([2], dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.lstrain.bias_dropout_residual_fwd, (x, bias, residual, seed, 0.1, True))
    torch.library.opcheck(torch.ops.lstrain.dropout_bwd, (x, seed, 0.1, True, True, torch.float32))
    torch.library.opcheck(torch.ops.lstrain.bias_act_dropout_fwd, (x, bias, seed, 0.1, True, "silu"))
    torch.library.opcheck(torch.ops.lstrain.bias_act_dropout_bwd, (residual, x, bias, seed, 0.1, True, "silu", True))
    # as gemm's backward calls it: no bias (x holds it), a scale, the column sum in fp32
    torch.library.opcheck(
        torch.ops.lstrain.bias_act_dropout_bwd, (residual, x, None, None, 0.0, False, "gelu", True, 0.5)
    )


def test_references_without_a_mask_draw_their_own(device):
    x = torch.randn(1000, device=device)
    y = bias_act_dropout_ref(x, None, activation="relu", dropout=0.5)
    assert 0.3 < (y == 0).float().mean().item() < 0.9
    assert bias_dropout_residual_ref(x, None, x, dropout=0.5).shape == x.shape


@pytest.mark.gpu
def test_cuda_graph_replays_draw_fresh_masks():
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    residual = torch.zeros_like(x)
    for _ in range(2):
        bias_dropout_residual(x, None, residual, dropout=0.5).sum().backward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = bias_dropout_residual(x, None, residual, dropout=0.5)
    graph.replay()
    first = y.clone()
    graph.replay()
    assert not torch.equal(first, y)
    assert abs((y == 0).float().mean().item() - 0.5) < 0.05
