import pytest
import torch
from hypothesis import example, given, settings

from lstrain import _backend
from lstrain.ops import rope, rope_qkv, rope_qkv_ref, rope_ref
from lstrain.ops.rope import RopePlan, dim_order, rope_plan
from lstrain.testing import assert_all_passed
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import rope_cases, rope_qkv_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

# The @example cases carry the edges; few drawn ones keep the interpreter run short.
FEW = settings(max_examples=8) if DEVICE == "cpu" else settings()


def _tables(seq, head_dim, *, interleaved=False, batch=(), device=DEVICE, dtype=torch.float32):
    """LlamaRotaryEmbedding's cos/sin (base 10000), or GPT-J's per-pair layout."""
    inv_freq = 10000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    positions = torch.arange(seq, dtype=torch.float64).expand(*batch, seq)
    freqs = positions[..., None] * inv_freq
    angles = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def _rope_case(shape=(1, 2, 5), head_dim=8, **kwargs):
    case = {"shape": shape, "head_dim": head_dim, "interleaved": False, "table_batch": "shared"}
    case |= {"tables": "random", "layout": "hf", "dtype": torch.float32, "seed": 0}
    return case | kwargs


def _qkv_case(shape=(1, 5), num_heads=2, num_kv_heads=1, head_dim=8, **kwargs):
    case = {"shape": shape, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    case |= {"interleaved": False, "table_batch": "shared", "tables": "random", "dtype": torch.float32, "seed": 0}
    return case | kwargs


@FEW
@given(case=rope_cases(DEVICE))
@example(case=_rope_case(head_dim=2, interleaved=True))
@example(case=_rope_case(shape=(2, 3, 7), head_dim=80, table_batch="per_batch", tables="hf", dtype=torch.float16))
@example(case=_rope_case(head_dim=6, table_batch="one", layout="contiguous", interleaved=True, dtype=torch.bfloat16))
def test_rope_matches_hf_formula(case):
    result = OP_CHECKS["rope"].run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


@FEW
@given(case=rope_qkv_cases(DEVICE))
@example(case=_qkv_case(num_heads=4, num_kv_heads=1, interleaved=True, dtype=torch.float16))  # GQA
@example(case=_qkv_case(shape=(2, 3), num_heads=3, num_kv_heads=3, head_dim=34, table_batch="per_batch"))
def test_rope_qkv_matches_hf_formula(case):
    result = OP_CHECKS["rope_qkv"].run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


def test_reference_is_transformers_apply_rotary_pos_emb(device):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    q, k = torch.randn(2, 3, 6, 16, device=device), torch.randn(2, 1, 6, 16, device=device)
    cos, sin = _tables(6, 16, batch=(2,), device=device)
    q_hf, k_hf = llama.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(rope_ref(q, cos, sin), q_hf)
    torch.testing.assert_close(rope(k, cos, sin), k_hf)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_is_the_complex_product(device, interleaved):
    """RoPE's definition: a pair as a complex number times e^(i * position * freq)."""
    x = torch.randn(1, 2, 5, 12, device=device, dtype=torch.float64)
    cos, sin = _tables(5, 12, interleaved=interleaved, device=device, dtype=torch.float64)
    pairs = x.unflatten(-1, (6, 2)) if interleaved else x.unflatten(-1, (2, 6)).transpose(-1, -2)
    angles = torch.atan2(sin, cos)[..., ::2] if interleaved else torch.atan2(sin, cos)[..., :6]
    turned = torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(angles), angles)
    expected = torch.view_as_real(turned)
    expected = expected.flatten(-2) if interleaved else expected.transpose(-1, -2).flatten(-2)
    out = rope(x.float(), cos.float(), sin.float(), interleaved=interleaved)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=0)


def test_layouts_of_outputs_and_strided_inputs(device):
    x_hf = torch.randn(2, 7, 3, 16, device=device).transpose(1, 2)  # HF's view of a projection
    cos, sin = _tables(7, 16, device=device)
    x_hf.requires_grad_()
    out = rope(x_hf, cos, sin)
    (grad,) = torch.autograd.grad(out, x_hf, torch.randn(2, 3, 7, 16, device=device))  # contiguous dy
    # laid out as x, so that the gradient reaches the projection without a copy
    assert out.stride() == grad.stride() == x_hf.stride() and dim_order(x_hf) == [0, 2, 1, 3]
    padded = torch.randn(2, 3, 7, 20, device=device)[..., 2:18]  # rows padded: not dense
    assert rope(padded, cos, sin).is_contiguous() and dim_order(padded) == [0, 1, 2, 3]
    torch.testing.assert_close(rope(padded, cos, sin), rope_ref(padded, cos, sin))
    strided_cos = torch.randn(7, 32, device=device)[:, ::2]  # last dim strided: copied
    torch.testing.assert_close(rope(x_hf, strided_cos, sin), rope_ref(x_hf, strided_cos, sin))
    qkv = torch.randn(2, 7, (4 + 2 * 2) * 16 + 5, device=device)[..., 5:]
    q, k, v = rope_qkv(qkv, cos, sin, 4, 2)
    assert q.shape == (2, 4, 7, 16) and k.shape == v.shape == (2, 2, 7, 16)
    # laid out as [batch, seq, heads, head_dim]: SDPA's output then reshapes without a copy
    assert dim_order(q) == dim_order(k) == [0, 2, 1, 3]
    assert dim_order(v) == [0, 2, 1, 3] and v.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr()
    for got, expected in zip((q, k, v), rope_qkv_ref(qkv, cos, sin, 4, 2), strict=True):
        torch.testing.assert_close(got, expected)


def test_rope_qkv_gradient_of_partly_used_outputs(device):
    qkv = torch.randn(2, 5, (2 + 2) * 8, device=device, requires_grad=True)
    cos, sin = _tables(5, 8, device=device)
    _, k, _ = rope_qkv(qkv, cos, sin, 2, 1)
    dk = torch.randn_like(k)
    (grad,) = torch.autograd.grad(k, qkv, dk)
    _, k_ref, _ = rope_qkv_ref(qkv, cos, sin, 2, 1)
    (expected,) = torch.autograd.grad(k_ref, qkv, dk)
    torch.testing.assert_close(grad, expected)
    assert not grad[..., :16].any() and not grad[..., 24:].any()
    (grad,) = torch.autograd.grad(rope_qkv(qkv, cos, sin, 2, 1)[2].sum(), qkv)  # v alone
    assert torch.equal(grad[..., 24:], torch.ones_like(grad[..., 24:])) and not grad[..., :24].any()


def test_nan_in_gives_nan_out_in_its_pair_only(device):
    x = torch.randn(1, 2, 3, 8, device=device)
    x[0, 1, 2, 1] = float("nan")
    cos, sin = _tables(3, 8, device=device)
    for interleaved, partner in ((False, 5), (True, 0)):
        out = rope(x, cos, sin, interleaved=interleaved)
        assert torch.isnan(out[0, 1, 2, [1, partner]]).all() and torch.isnan(out).sum() == 2


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: rope(torch.randn(2, 3, 4, 7, device=d), *_tables(4, 8, device=d)), "head_dim must be even"),
        (lambda d: rope(torch.randn(3, 4, 8, device=d), *_tables(4, 8, device=d)), "x must be a 4-d tensor"),
        (lambda d: rope(torch.randn(1, 1, 4, 8, device=d).int(), *_tables(4, 8, device=d)), "x has dtype"),
        (lambda d: rope(torch.randn(1, 1, 4, 8, device=d), *_tables(5, 8, device=d)), r"cos has shape \(5, 8\)"),
        (lambda d: rope(torch.randn(2, 1, 4, 8, device=d), *_tables(4, 8, batch=(3,), device=d)), "cos has shape"),
        (
            lambda d: rope(torch.randn(1, 1, 4, 8, device=d), _tables(4, 8, device=d)[0], torch.ones(4, 8).int()),
            "sin has dtype",
        ),
        (lambda d: rope(torch.randn(1, 1, 4, 8, device=d), *_tables(4, 8, device="meta")), "cos is on meta"),
        (
            lambda d: rope(torch.randn(1, 1, 4, 8, device=d), *(t.requires_grad_() for t in _tables(4, 8, device=d))),
            "cos requires grad",
        ),
        (lambda d: rope_qkv(torch.randn(1, 4, 31, device=d), *_tables(4, 8, device=d), 2, 1), "not a multiple"),
        (lambda d: rope_qkv(torch.randn(1, 4, 28, device=d), *_tables(4, 7, device=d), 2, 1), "head_dim must be even"),
        (lambda d: rope_qkv(torch.randn(1, 4, 32, device=d), *_tables(4, 8, device=d), 0, 2), "num_heads must be"),
        (lambda d: rope_qkv(torch.randn(1, 4, 32, device=d), *_tables(4, 8, device=d), 2, 1.0), "num_kv_heads must"),
        (lambda d: rope_qkv(torch.randn(4, 32, device=d), *_tables(4, 8, device=d), 2, 1), "qkv must be a 3-d"),
    ],
)
def test_bad_input_names_the_argument(device, make, match):
    with pytest.raises(ValueError, match=match):
        make(device)


def test_launch_plan():
    llama = rope_plan(32, 4096, 128)
    assert llama == rope_plan(32, 4096, 128) and (llama.block_heads, llama.block_seq, llama.block_half) == (8, 4, 64)
    assert rope_plan(3, 4096, 80).block_half == 64 and rope_plan(3, 4096, 80).block_heads == 4
    assert rope_plan(1, 1, 2) == RopePlan(1, 1, 1, 4)
    for heads, head_dim in ((1, 2), (5, 6), (32, 64), (8, 128), (64, 256)):
        plan = rope_plan(heads, 3, head_dim)
        assert plan.block_seq <= 4 and 2 * plan.block_half >= head_dim and plan.block_heads <= 8
        assert plan.block_heads * plan.block_seq * plan.block_half <= 4096


def test_torch_compile_fullgraph(device):
    cos, sin = _tables(6, 16, device=device)
    backend = "inductor" if device == "cuda" else "aot_eager"

    def f(qkv):
        q, k, v = rope_qkv(qkv * 2, cos, sin, 2, 1)
        return (q.sum(1, keepdim=True) * k * v).sum() + rope(q, cos, sin, interleaved=True).square().sum()

    qkv = torch.randn(2, 6, 4 * 16, device=device, requires_grad=True)
    out = torch.compile(f, fullgraph=True, backend=backend)(qkv)
    (grad,) = torch.autograd.grad(out, qkv)
    ref_out = f(qkv)
    (ref_grad,) = torch.autograd.grad(ref_out, qkv)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)


def test_torch_compile_dynamic_shapes(device):
    """One graph over several sequence lengths (symbolic strides), each call equal to eager."""
    backend = "inductor" if device == "cuda" else "aot_eager"

    def f(qkv, x, cos, sin):
        q, k, _ = rope_qkv(qkv, cos, sin, 2, 1)
        return q.square().sum() + k.sum() + rope(x.transpose(1, 2), cos, sin).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=backend)
    for batch, seq in ((1, 3), (1, 5), (2, 7)):  # a batch of 1 traced with symbolic strides
        cos, sin = _tables(seq, 16, device=device)
        qkv = torch.randn(batch, seq, 4 * 16, device=device, requires_grad=True)
        x = torch.randn(batch, seq, 2, 16, device=device, requires_grad=True)  # HF's [b, s, h, d] -> [b, h, s, d]
        out = compiled(qkv, x, cos, sin)
        grads = torch.autograd.grad(out, (qkv, x))
        ref_out = f(qkv, x, cos, sin)
        ref_grads = torch.autograd.grad(ref_out, (qkv, x))
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(grads, ref_grads)
        assert grads[1].stride() == x.stride()


def test_custom_ops_pass_opcheck(device):
    cos, sin = _tables(5, 8, device=device)
    x = torch.randn(2, 3, 5, 8, device=device)
    torch.library.opcheck(torch.ops.lstrain.rope_fwd, (x, cos, sin, False))
    torch.library.opcheck(torch.ops.lstrain.rope_bwd, (x, cos, sin, True, [0, 2, 1, 3]))
    qkv = torch.randn(2, 5, 4 * 8, device=device)
    torch.library.opcheck(torch.ops.lstrain.rope_qkv_fwd, (qkv, cos, sin, 2, 1, False))
    dq, dk = torch.randn(2, 2, 5, 8, device=device), torch.randn(2, 1, 5, 8, device=device)
    torch.library.opcheck(torch.ops.lstrain.rope_qkv_bwd, (dq, dk, dk.clone(), cos, sin, 2, 1, False))
    torch.library.opcheck(torch.ops.lstrain.rope_qkv_bwd, (None, dk, None, cos, sin, 2, 1, True))


def test_second_derivative_is_refused(device):
    x = torch.randn(1, 1, 3, 4, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(rope(x, *_tables(3, 4, device=device)).sum(), x, create_graph=True)


def test_backend_is_recorded(device):
    with _backend.record_backends() as ran:
        rope(torch.randn(1, 1, 3, 4, device=device), *_tables(3, 4, device=device))
        rope_qkv(torch.randn(1, 3, 12, device=device), *_tables(3, 4, device=device), 1, 1)
    assert ran == [("rope", EXPECTED_BACKEND), ("rope_qkv", EXPECTED_BACKEND)]


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_llama_sized_bf16(interleaved):
    batch, seq, heads, kv_heads, head_dim = 4, 4096, 32, 8, 128
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
    qkv.requires_grad_()
    cos, sin = _tables(seq, head_dim, interleaved=interleaved, device="cuda", dtype=torch.bfloat16)
    outputs = rope_qkv(qkv, cos, sin, heads, kv_heads, interleaved=interleaved)
    grads = [torch.randn_like(o) for o in outputs]
    (dqkv,) = torch.autograd.grad(outputs, qkv, grads)
    exact = qkv.detach().double().requires_grad_()
    expected = rope_qkv_ref(exact, cos.double(), sin.double(), heads, kv_heads, interleaved=interleaved)
    (dexact,) = torch.autograd.grad(expected, exact, [g.double() for g in grads])
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(dqkv.double(), dexact, atol=2e-2, rtol=1e-2)
    q_hf = qkv.detach()[..., : heads * head_dim].unflatten(-1, (heads, head_dim)).transpose(1, 2)
    torch.testing.assert_close(rope(q_hf, cos, sin, interleaved=interleaved), outputs[0], atol=0, rtol=0)


def test_rope_qkv_lets_attention_free_the_projection(device):
    """Attention saves v for its backward; a view of qkv would keep the whole projection alive."""
    qkv = torch.randn(2, 7, 3 * 2 * 16, device=device, requires_grad=True) * 1.0  # a non-leaf, as a GEMM's output
    cos, sin = torch.randn(7, 16, device=device), torch.randn(7, 16, device=device)
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        q, k, v = rope_qkv(qkv, cos, sin, 2, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert qkv.untyped_storage().data_ptr() not in saved
    out.sum().backward()
