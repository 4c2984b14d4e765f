import importlib
import math

import pytest
import torch
from hypothesis import example, given

import lstrain
from lstrain.ops import dropout_mask, embedding, embedding_ref
from lstrain.ops.embedding import gather_plan
from lstrain.testing import assert_all_passed
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import embedding_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["embedding"]


def _case(tokens=(2, 5), vocab=11, dim=16, positions="learned", dropout=0.0, padding=False, deterministic=False):
    return {
        "tokens": tokens,
        "vocab": vocab,
        "dim": dim,
        "max_positions": tokens[-1] + 2,
        "dtype": torch.float32,
        "positions": positions,
        "scale": 2.0,
        "dropout": dropout,
        "padding": padding,
        "deterministic": deterministic,
        "seed": 0,
    }


@given(case=embedding_cases(DEVICE))
@example(case=_case(tokens=(1, 1), vocab=1, dim=1))
@example(case=_case(dim=1025, dropout=0.1, padding=True))  # two column blocks
@example(case=_case(positions="explicit", deterministic=True, dropout=0.5))
@example(case=_case(tokens=(4, 20), vocab=3, positions=None, deterministic=True))  # long runs of equal ids
@example(case=_case(tokens=(2, 150), vocab=2, deterministic=True))  # runs of several chunks
@example(case=_case(tokens=(3, 40), vocab=70000, dim=8, deterministic=True))  # int32 sort keys
# 408 atomic adds into one fp32 row (an H200 draw: 7.7e-6 from fp32 sums, allowed 3.4e-6)
@example(case=_case(tokens=(1, 408), vocab=1, dim=1, positions=None))
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


def test_deterministic_backward_is_bitwise_reproducible(device):
    torch.manual_seed(0)
    batch, seq, vocab, dim = (8, 512, 50, 256) if device == "cuda" else (4, 16, 6, 24)
    tokens = torch.randint(0, vocab, (batch, seq), device=device)  # many repeated ids
    weight = torch.randn(vocab, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    pos_weight = torch.randn(seq, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    seed = torch.tensor([9], dtype=torch.int64, device=device)
    dy = torch.randn(batch, seq, dim, device=device, dtype=torch.bfloat16)
    runs = []
    for _ in range(10):
        y = embedding(tokens, weight, pos_weight=pos_weight, scale=3.0, dropout=0.1, deterministic=True, seed=seed)
        runs.append(torch.autograd.grad(y, (weight, pos_weight), dy))
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], grads, strict=True))
    atomic = torch.autograd.grad(
        embedding(tokens, weight, pos_weight=pos_weight, scale=3.0, dropout=0.1, deterministic=False, seed=seed),
        (weight, pos_weight),
        dy,
    )
    for a, b in zip(runs[0], atomic, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_frequent_tokens(deterministic):
    """Seven ids looked up ~2300 times each: long runs of equal sorted ids (read a tile at a
    time) and heavily contended atomics."""
    case = _case(tokens=(16, 1024), vocab=7, dim=1000, dropout=0.1, deterministic=deterministic)
    case["dtype"] = torch.bfloat16
    result = CHECK.run(case, "cuda")
    assert set(result.backends) == {"triton"}
    assert_all_passed(result.comparisons, str(case))


def test_deterministic_mode_follows_torch(device):
    tokens = torch.tensor([[1, 1, 2]], device=device)
    weight = torch.randn(4, 8, device=device, requires_grad=True)
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        (a,) = torch.autograd.grad(embedding(tokens, weight).sum(), weight)
    finally:
        torch.use_deterministic_algorithms(previous)
    expected = torch.zeros(4, 8, device=device)
    expected[1] = 2
    expected[2] = 1
    assert torch.equal(a, expected)


@pytest.mark.parametrize("view", ["padded rows", "strided columns"])
def test_strided_tables(device, view):
    """Tables that are views (rows padded in a wider buffer, or every other column) are
    read by value, and their gradients reach the buffer's elements."""
    ids = torch.tensor([[0, 3, 3, 5], [1, 1, 2, 0]], device=device)
    buffers = [torch.randn(rows, 16, device=device, requires_grad=True) for rows in (6, 4)]
    weight, pos_weight = (b[:, :8] if view == "padded rows" else b[:, ::2] for b in buffers)
    y = embedding(ids, weight, pos_weight=pos_weight, scale=2.0)
    expected = embedding_ref(ids, weight.detach(), pos_weight=pos_weight.detach(), scale=2.0)
    torch.testing.assert_close(y, expected)
    grads = torch.autograd.grad(y.sum(), buffers)
    unused = (slice(None), slice(8, None)) if view == "padded rows" else (slice(None), slice(1, None, 2))
    for g in grads:
        assert not g[unused].any()
    assert not grads[0][4].any() and grads[0][3].abs().sum() > 0  # row 4 is never looked up, 3 twice


def test_zero_width_tables(device):
    weight = torch.randn(10, 0, device=device, requires_grad=True)
    pos_weight = torch.randn(5, 0, device=device, requires_grad=True)
    tokens = torch.tensor([[1, 2, 3]], device=device)
    y = embedding(tokens, weight, pos_weight=pos_weight, dropout=0.1)
    y.sum().backward()
    assert y.shape == (1, 3, 0) and weight.grad.shape == (10, 0) and pos_weight.grad.shape == (5, 0)


def test_negative_padding_idx_counts_from_the_end(device):
    """padding_idx=-1 is the last row, as in torch (the kernels' own "no padding" is -1)."""
    tokens = torch.tensor([[0, 4, 2, 4]], device=device)
    weight = torch.randn(5, 3, device=device, requires_grad=True)
    y = embedding(tokens, weight, padding_idx=-1)
    expected = torch.nn.functional.embedding(tokens, weight.detach(), padding_idx=-1)
    expected[tokens == 4] = 0.0  # torch keeps the row's values; its gradient is what padding stops
    torch.testing.assert_close(y, expected)
    (grad,) = torch.autograd.grad(y.sum(), weight)
    assert not grad[4].any() and grad[0].eq(1).all()


def test_padding_rows_are_zero_and_get_no_gradient(device):
    tokens = torch.tensor([[0, 5, 0, 2]], device=device)
    weight = torch.randn(6, 4, device=device, requires_grad=True)
    pos_weight = torch.randn(4, 4, device=device, requires_grad=True)
    y = embedding(tokens, weight, pos_weight=pos_weight, padding_idx=0)
    assert torch.equal(y[0, 0], torch.zeros(4, device=device)) and torch.equal(y[0, 2], torch.zeros(4, device=device))
    y.sum().backward()
    assert torch.equal(weight.grad[0], torch.zeros(4, device=device))
    assert torch.equal(pos_weight.grad[0], torch.zeros(4, device=device))  # position 0 only held padding
    assert torch.equal(pos_weight.grad[1], torch.ones(4, device=device))


def test_frozen_token_table_gets_only_the_position_gradient(device):
    tokens = torch.tensor([[1, 2, 1]], device=device)
    weight = torch.randn(4, 3, device=device)  # frozen
    pos_weight = torch.randn(3, 3, device=device, requires_grad=True)
    embedding(tokens, weight, pos_weight=pos_weight, scale=2.0).sum().backward()
    assert weight.grad is None
    assert torch.equal(pos_weight.grad, torch.ones(3, 3, device=device))


def test_nan_rows_stay_nan_under_dropout(device):
    weight = torch.randn(10, 64, device=device)
    weight[3] = float("nan")
    y = embedding(torch.tensor([[3, 1]], device=device), weight, dropout=0.5)
    assert torch.isnan(y[0, 0]).all() and not torch.isnan(y[0, 1]).any()


def test_unchecked_bad_ids_give_nan_rows(device):
    tokens = torch.tensor([[1, 9, 2]], device=device)
    weight = torch.randn(5, 3, device=device)
    y = embedding(tokens, weight, check_ids=False)
    assert torch.isnan(y[0, 1]).all() and not torch.isnan(y[0, 0]).any()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens=torch.tensor([[0, 7]])), "token id 7 at \\(0, 1\\) is outside \\[0, 5\\)"),
        (dict(tokens=torch.tensor([[0, -1]])), "token id -1"),
        (dict(tokens=torch.tensor([[0.0, 1.0]])), "tokens must be int64 or int32"),
        (dict(tokens=torch.tensor([[0, 1]], dtype=torch.uint8)), "got torch.uint8; convert with tokens.long\\(\\)"),
        (dict(tokens=torch.tensor(1)), "tokens must have at least one dim .*got a 0-d tensor"),
        (dict(weight=torch.randn(5)), "weight must be a \\[V, D\\] float table"),
        (dict(pos_weight=torch.randn(4, 2)), "pos_weight must be"),
        (dict(pos_weight=torch.ones(4, 3, dtype=torch.long)), "pos_weight must be .* float table, got .* torch.int64"),
        (dict(pos_weight=torch.randn(1, 3)), "seq_len 2 exceeds max_positions 1"),
        (dict(pos_weight=torch.randn(4, 3), positions=torch.tensor([[0, 4]])), "position 4 at \\(0, 1\\)"),
        (dict(positions=torch.tensor([[0, 1]])), "positions need pos_weight"),
        (
            dict(pos_weight=torch.randn(4, 3), positions=torch.tensor([[0.0, 1.0]])),
            "positions must be int64 or int32 ids, got torch.float32",
        ),
        (
            dict(pos_weight=torch.randn(4, 3), positions=torch.tensor([[0, 1]], dtype=torch.int16)),
            "positions must be int64 or int32 ids, got torch.int16",
        ),
        (dict(seed=torch.tensor([1, 2, 3]), dropout=0.1), "seed must be a 1-element int64 tensor"),
        (dict(dropout=1.5), "dropout must be in \\[0, 1\\)"),
        (dict(padding_idx=5), "padding_idx must be in \\[-5, 5\\), got 5"),
        (dict(pos_weight=torch.randn(4, 3, device="meta")), "pos_weight is on meta"),
    ],
)
def test_bad_input_names_the_argument(device, kwargs, match):
    tokens = kwargs.pop("tokens", torch.tensor([[0, 1]])).to(device)
    weight = kwargs.pop("weight", torch.randn(5, 3)).to(device)
    kwargs = {
        k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v for k, v in kwargs.items()
    }
    with pytest.raises(ValueError, match=match):
        embedding(tokens, weight, check_ids=True, **kwargs)


def test_too_many_tokens_is_refused_before_any_work():
    tokens = torch.empty(2**31, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="at most 2\\*\\*31 - 1 tokens"):
        embedding(tokens, torch.empty(5, 3, device="meta"))


def test_transformer_embedding_module(device):
    module = lstrain.nn.TransformerEmbedding(30, 16, max_positions=12, padding_idx=0, device=device)
    assert module.scale == pytest.approx(4.0) and torch.equal(module.weight[0], torch.zeros(16, device=device))
    tokens = torch.randint(1, 30, (2, 12), device=device)
    y = module(tokens)
    expected = embedding_ref(tokens, module.weight, pos_weight=module.position_weight, scale=4.0, padding_idx=0)
    torch.testing.assert_close(y, expected)
    fixed = lstrain.nn.TransformerEmbedding(30, 16, 12, scale=1.0, learned_positions=False, device=device)
    assert "position_weight" in dict(fixed.named_buffers()) and len(list(fixed.parameters())) == 1
    table = lstrain.nn.sinusoidal_positions(12, 16)
    assert table[3, 0].item() == pytest.approx(math.sin(3)) and table[3, 1].item() == pytest.approx(math.cos(3))


def test_sinusoidal_positions_of_no_columns_and_bad_sizes():
    assert lstrain.nn.sinusoidal_positions(4, 0).shape == (4, 0)
    assert lstrain.nn.sinusoidal_positions(0, 6).shape == (0, 6)
    odd = lstrain.nn.sinusoidal_positions(5, 3, dtype=torch.float64)
    assert odd.shape == (5, 3) and odd[2, 2].item() == pytest.approx(math.sin(2 * 10000 ** (-2 / 3)))
    for args, match in (((4, -2), "dim must be an int >= 0, got -2"), ((4.0, 2), "max_positions must be an int")):
        with pytest.raises(ValueError, match=match):
            lstrain.nn.sinusoidal_positions(*args)


def test_torch_compile_fullgraph(device):
    weight = torch.randn(20, 8, device=device, requires_grad=True)
    pos_weight = torch.randn(6, 8, device=device, requires_grad=True)

    def f(tokens):
        return embedding(tokens, weight, pos_weight=pos_weight, scale=2.0).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    tokens = torch.randint(0, 20, (3, 6), device=device)
    out = compiled(tokens)
    grads = torch.autograd.grad(out, (weight, pos_weight))
    ref_out = f(tokens)
    ref_grads = torch.autograd.grad(ref_out, (weight, pos_weight))
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_custom_ops_pass_opcheck(device):
    tokens = torch.randint(0, 10, (2, 5), device=device)
    weight = torch.randn(10, 8, device=device)
    pos_weight = torch.randn(5, 8, device=device)
    seed = torch.tensor([3], dtype=torch.int64, device=device)
    for count in (False, True):
        args = (tokens, weight, pos_weight, None, 2.0, 1, seed, 0.1, count)
        torch.library.opcheck(torch.ops.lstrain.embedding_fwd, args)
    _, counts = torch.ops.lstrain.embedding_fwd(tokens, weight, pos_weight, None, 2.0, 1, seed, 0.1, True)
    dy = torch.randn(2, 5, 8, device=device)
    for deterministic in (False, True):
        for token_counts in (counts, None):
            args = (dy, tokens, token_counts, 10, torch.float32, 5, torch.float32, None, 2.0, 1, seed, 0.1)
            torch.library.opcheck(torch.ops.lstrain.embedding_bwd, (*args, deterministic, True, True))
            tied = torch.randn(10, 8, device=device)
            torch.library.opcheck(torch.ops.lstrain.embedding_bwd, (*args, deterministic, True, True, tied))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_head_meets_the_table_gradient_in_backward(device, deterministic, dtype):
    """``return_table``: the head's gradient of the returned table and the looked-up rows'
    are one gradient of the table, as plain PyTorch's sum of the two uses."""
    torch.manual_seed(0)
    vocab, dim = 50, 24
    tokens = torch.randint(0, 12, (3, 7), device=device)  # rows 12.. are never looked up
    tokens[0, :4] = 5  # one row looked up by several tokens
    weight = torch.randn(vocab, dim, device=device, dtype=dtype, requires_grad=True)
    pos_weight = torch.randn(7, dim, device=device, dtype=dtype, requires_grad=True)
    seed = torch.tensor([4], dtype=torch.int64, device=device)
    dy = torch.randn(3, 7, dim, device=device, dtype=dtype)
    head_input = torch.randn(5, dim, device=device, dtype=dtype)
    dhead = torch.randn(5, vocab, device=device, dtype=dtype)
    options = {"pos_weight": pos_weight, "scale": 2.0, "dropout": 0.2, "padding_idx": 3, "seed": seed,
               "deterministic": deterministic}  # fmt: skip

    def gradients(fused):
        if fused:
            y, table = embedding(tokens, weight, return_table=True, **options)
        else:  # plain PyTorch, the same mask: autograd sums the table's two uses
            mask = dropout_mask(seed, (*tokens.shape, dim), 0.2)
            y, table = embedding_ref(tokens, weight, pos_weight=pos_weight, scale=2.0, dropout=0.2, padding_idx=3,
                                     mask=mask), weight  # fmt: skip
        head = head_input @ table.t()
        return torch.autograd.grad((y, head), (weight, pos_weight), (dy, dhead))

    fused, summed = gradients(True), gradients(False)
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (1.6e-2, 2e-2)  # bf16: a rounding fewer
    for got, expected in zip(fused, summed, strict=True):
        torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=atol)


def test_a_returned_table_nobody_differentiates_costs_nothing(device):
    weight = torch.randn(9, 4, device=device, requires_grad=True)
    tokens = torch.randint(0, 9, (2, 3), device=device)
    y, table = embedding(tokens, weight, return_table=True)
    torch.testing.assert_close(table, weight)
    (dweight,) = torch.autograd.grad(y.sum(), weight)  # the table's gradient stays None: no [V, D] zeros
    torch.testing.assert_close(dweight, torch.autograd.grad(embedding_ref(tokens, weight).sum(), weight)[0])
    y, table = embedding(tokens, weight, return_table=True)
    (only_table,) = torch.autograd.grad(table.sum(), weight)  # y's gradient None: the table's passes through
    torch.testing.assert_close(only_table, torch.ones_like(weight))
    with torch.no_grad():
        y, table = embedding(tokens, weight, return_table=True)
    assert table is weight


@pytest.mark.parametrize("dim, rows, cols", [(1, 128, 8), (64, 16, 64), (1000, 1, 1024), (4096, 1, 1024)])
def test_gather_plan_tiles_about_1024_elements_on_two_warps(dim, rows, cols):
    plan = gather_plan(dim)
    assert (plan.block_rows, plan.block_cols, plan.num_warps) == (rows, cols, 2)


def test_no_row_counts_under_no_grad(device, monkeypatch):
    """Under torch.no_grad the forward takes no per-row counts for a table that requires grad."""
    module = importlib.import_module("lstrain.ops.embedding")
    counted = []
    embedding_fwd_op = module.embedding_fwd_op
    monkeypatch.setattr(module, "embedding_fwd_op", lambda *args: counted.append(args[-1]) or embedding_fwd_op(*args))
    weight = torch.randn(30, 8, device=device, requires_grad=True)
    tokens = torch.randint(0, 30, (2, 5), device=device)
    with torch.no_grad():
        y = embedding(tokens, weight)
    assert counted == [False]
    torch.testing.assert_close(y, embedding_ref(tokens, weight.detach()))
