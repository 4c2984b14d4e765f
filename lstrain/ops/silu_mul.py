"""silu(gate) * up, the middle of a SwiGLU MLP whose projections are separate GEMMs, in one pass each way.

Hugging Face's LlamaMLP (Mistral's, Qwen2's) runs ``act_fn(gate_proj(x)) * up_proj(x)`` as
two elementwise kernels forward (silu, then the product: five passes over [tokens, F],
each result rounded) and three backward. Here forward reads gate and up once and writes
the product; backward reads the product's gradient, gate and up once and writes both
gradients; fp32 arithmetic, one rounding per output. Nothing but the inputs is saved.

:func:`silu_mul_linear` also runs the down projection, ``F.linear(silu(gate) * up, w, b)``,
and keeps only gate and up for backward, not the product the projection would save: its
backward kernel writes the product again beside the two gradients (one more write of
[tokens, F]) for the weight gradient's GEMM. A third of the MLP's saved activations less
(11 of 37 KiB per token and layer in a LLaMA-style 0.75B).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.autocast import autocast_inputs
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.dropout import elementwise_plan
from lstrain.ops._lib.first_order import differentiated, refuse_create_graph
from lstrain.ops._lib.layout import as_rows, cdiv, matmul_like
from lstrain.ops._lib.linear_checks import check_projection
from lstrain.ops._lib.options import check_tensors

__all__ = [
    "SiluMulFunction",
    "SiluMulLinearFunction",
    "silu_mul",
    "silu_mul_bwd",
    "silu_mul_fwd",
    "silu_mul_linear",
    "silu_mul_linear_ref",
    "silu_mul_ref",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _silu_mul_fwd_kernel(
    gate_ptr, up_ptr, out_ptr, rows, cols, gate_row_stride, up_row_stride, BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (row < rows)[:, None] & (col < cols)[None, :]
    g = tl.load(gate_ptr + row[:, None] * gate_row_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row[:, None] * up_row_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
    # torch's silu: x / (1 + exp(-x)) (-inf gives NaN, as torch's)
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row[:, None] * cols + col[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(
    dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, product_ptr, rows, cols, dout_row_stride, gate_row_stride,
    up_row_stride, STORE_PRODUCT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (row < rows)[:, None] & (col < cols)[None, :]
    d = tl.load(dout_ptr + row[:, None] * dout_row_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row[:, None] * gate_row_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row[:, None] * up_row_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
    sigmoid = 1.0 / (1.0 + tl.exp(-g))
    offsets = row[:, None] * cols + col[None, :]
    # d silu / dg = s * (1 + g * (1 - s))
    tl.store(dgate_ptr + offsets, (d * u * sigmoid * (1.0 + g * (1.0 - sigmoid))).to(dgate_ptr.dtype.element_ty), mask)
    tl.store(dup_ptr + offsets, (d * g * sigmoid).to(dup_ptr.dtype.element_ty), mask=mask)
    if STORE_PRODUCT:  # the forward's output again, rounded as forward rounded it
        tl.store(product_ptr + offsets, (g / (1.0 + tl.exp(-g)) * u).to(product_ptr.dtype.element_ty), mask=mask)


def silu_mul_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Launch the forward on validated inputs; returns ``silu(gate) * up`` (contiguous)."""
    cols = gate.shape[-1]
    gate2d, up2d = as_rows(gate, cols), as_rows(up, cols)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = gate2d.shape[0]
    if rows and cols:
        plan = elementwise_plan(cols)
        _silu_mul_fwd_kernel[(cdiv(rows, plan.block_rows), cdiv(cols, plan.block_cols))](
            gate2d, up2d, out, rows, cols, gate2d.stride(0), up2d.stride(0),
            BLOCK_ROWS=plan.block_rows, BLOCK_COLS=plan.block_cols, num_warps=plan.num_warps,
            **_backend.dependent_launch(gate2d),
        )  # fmt: skip
    return out


@kernel_op("silu_mul_fwd", silu_mul_fwd)
def silu_mul_fwd_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


def silu_mul_bwd(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, store_product: bool) -> list[torch.Tensor]:
    """Launch the backward; returns ``[dgate, dup]``, and with ``store_product`` the
    forward's ``silu(gate) * up`` as a third (contiguous, the inputs' dtype)."""
    cols = gate.shape[-1]
    dout2d, gate2d, up2d = as_rows(dout, cols), as_rows(gate, cols), as_rows(up, cols)
    outputs = [torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) for _ in range(3 if store_product else 2)]
    rows = gate2d.shape[0]
    if rows and cols:
        plan = elementwise_plan(cols)
        _silu_mul_bwd_kernel[(cdiv(rows, plan.block_rows), cdiv(cols, plan.block_cols))](
            dout2d, gate2d, up2d, outputs[0], outputs[1], outputs[-1], rows, cols, dout2d.stride(0),
            gate2d.stride(0), up2d.stride(0),
            # three inputs and up to three outputs per element: twice the forward's warps,
            # or the 4096-element tile spills (255 registers with the product, 4 warps)
            STORE_PRODUCT=store_product, BLOCK_ROWS=plan.block_rows, BLOCK_COLS=plan.block_cols,
            num_warps=2 * plan.num_warps,
            **_backend.dependent_launch(dout2d),
        )  # fmt: skip
    return outputs


@kernel_op("silu_mul_bwd", silu_mul_bwd)
def silu_mul_bwd_op(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, store_product: bool
) -> list[torch.Tensor]:
    return [torch.empty_like(gate, memory_format=torch.contiguous_format) for _ in range(3 if store_product else 2)]


class SiluMulFunction(torch.autograd.Function):
    """Autograd for :func:`silu_mul`; saves gate and up."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return silu_mul_fwd_op(gate, up)

    @staticmethod
    def backward(ctx, dout):
        refuse_create_graph("silu_mul")
        gate, up = ctx.saved_tensors
        dgate, dup = silu_mul_bwd_op(dout, gate, up, False)
        return (dgate if ctx.needs_input_grad[0] else None), (dup if ctx.needs_input_grad[1] else None)


class SiluMulLinearFunction(torch.autograd.Function):
    """Autograd for :func:`silu_mul_linear`; saves gate, up and the weight (not the product)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        return F.linear(silu_mul_fwd_op(gate, up), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        refuse_create_graph("silu_mul_linear")
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_weight, need_bias = ctx.needs_input_grad
        dy2d = as_rows(dy, dy.shape[-1])
        dweight = dbias = dgate = dup = None
        if need_gate or need_up or need_weight:
            dproduct = (dy2d @ weight).view(gate.shape)
            grads = silu_mul_bwd_op(dproduct, gate, up, need_weight)
            dgate, dup = grads[0], grads[1]
            if need_weight:  # in the weight's layout: a contiguous add into .grad
                dweight = matmul_like(dy2d.t(), as_rows(grads[2], gate.shape[-1]), weight)
        if need_bias and ctx.has_bias:
            dbias = dy2d.sum(0)
        return (dgate if need_gate else None), (dup if need_up else None), dweight, dbias


def _check(op: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.dim() == 0:
        raise ValueError(f"{op}: gate must have at least one dim, got a scalar")
    if up.shape != gate.shape:
        raise ValueError(f"{op}: up has shape {tuple(up.shape)}, gate {tuple(gate.shape)}; they must match")
    if gate.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{op}: gate has dtype {gate.dtype}; expected float32, float16 or bfloat16")
    if up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"{op}: up is {up.dtype} on {up.device}, gate {gate.dtype} on {gate.device}; they must match")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one kernel each way (SwiGLU's activation, for an MLP whose
    gate and up projections are separate GEMMs; :func:`lstrain.ops.swiglu_mlp` fuses it
    into the GEMMs instead).

    Args:
        gate: ``[*, F]``, float32/float16/bfloat16; only the last dim needs to be
            contiguous (a column slice of a packed projection is read in place).
        up: the same shape, dtype and device.

    Returns:
        ``silu(gate) * up`` (contiguous, the inputs' dtype); fp32 arithmetic, one rounding.

    Raises:
        ValueError: gate or up no tensor (named), shapes, dtypes or devices that differ
            (named), a dtype other than float32 / float16 / bfloat16, or a 0-d input.
    """
    check_tensors("silu_mul", {"gate": gate, "up": up})
    _check("silu_mul", gate, up)
    backend = _backend.backend_for(gate)
    _backend.note("silu_mul", backend)
    if backend == "reference":
        return silu_mul_ref(gate, up)
    if not differentiated(gate, up):
        return silu_mul_fwd_op(gate, up)
    return SiluMulFunction.apply(gate, up)


def silu_mul_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight, bias)``, a SwiGLU MLP's down projection, keeping
    gate and up for backward instead of the product (see the module's docstring). Under
    ``torch.autocast`` all inputs are first cast to its dtype, as the projection's would be.

    Args:
        gate, up: ``[*, F]``, as for :func:`silu_mul`.
        weight: ``[out, F]`` (torch's Linear layout), the inputs' dtype and device.
        bias: ``[out]`` or None.

    Returns:
        ``[*, out]`` in the inputs' dtype.

    Raises:
        ValueError: as :func:`silu_mul`, or a weight / bias that is no tensor or whose
            shape, dtype or device does not fit (named).
    """
    check_tensors("silu_mul_linear", {"gate": gate, "up": up, "weight": weight}, {"bias": bias})
    gate, up, weight, bias = autocast_inputs(gate, up, weight, bias)
    _check("silu_mul_linear", gate, up)
    check_projection("silu_mul_linear", "gate", gate, weight, bias)
    backend = _backend.backend_for(gate)
    _backend.note("silu_mul_linear", backend)
    if backend == "reference":
        return silu_mul_linear_ref(gate, up, weight, bias)
    if not differentiated(gate, up, weight, bias):
        return F.linear(silu_mul_fwd_op(gate, up), weight, bias)
    return SiluMulLinearFunction.apply(gate, up, weight, bias)


def silu_mul_linear_ref(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain PyTorch: :func:`silu_mul_ref`, then ``F.linear`` (autograd's backward).

    Args:
        gate, up, weight, bias: as for :func:`silu_mul_linear`.

    Returns:
        ``F.linear(silu(gate) * up, weight, bias)``.
    """
    return F.linear(silu_mul_ref(gate, up), weight, bias)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch in fp32 (fp64 for fp64 inputs), rounded once to the inputs' dtype.

    Args:
        gate, up: as for :func:`silu_mul`.

    Returns:
        ``silu(gate) * up`` in gate's dtype.
    """
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)
