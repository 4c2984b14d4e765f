"""The tolerance rule, and gradient checks of functions and modules against a reference.

The rule (flash-attention's): the error of the tested computation against a precise
reference (fp64) must be at most twice the error of the *same computation done by
PyTorch in the tested precision*, plus a small ``atol``:

    max|actual - precise| <= 2 * max|torch_lowp - precise| + atol * max|precise|

It adapts to each op, shape and dtype by itself: what PyTorch's own kernels lose to
rounding is what we may lose, twice over; the atol is about one unit in the last place of
the tensor's largest value, so it scales with the tensor (a gradient of 1e-4 gets 1e-4's
slack, not 1's). Where PyTorch's low-precision result overflows (inf or NaN where the
precise one is finite), the tested result may overflow alike.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_ATOL",
    "Comparison",
    "assert_all_passed",
    "check_function",
    "check_module",
    "compare_to_reference",
]

# PyTorch's own error on a tensor this small is one draw of a wide distribution: take it
# over more samples (check_function)
SMALL_TENSOR, SMALL_TENSOR_DRAWS = 64, 12
# Relative to the reference's largest magnitude.
DEFAULT_ATOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float64: 1e-10}


@dataclass(frozen=True)
class Comparison:
    """One tensor checked by the tolerance rule."""

    name: str
    error: float
    allowed: float
    torch_error: float
    worst_index: tuple[int, ...]
    actual_value: float
    reference_value: float
    nan_mismatch: int = 0

    @property
    def passed(self) -> bool:
        return self.nan_mismatch == 0 and self.error <= self.allowed

    def message(self) -> str:
        if self.nan_mismatch:
            return (
                f"{self.name}: NaN pattern differs from the reference at {self.nan_mismatch} element(s), "
                f"first at {self.worst_index}"
            )
        verdict = "ok" if self.passed else "FAILS"
        return (
            f"{self.name}: max error {self.error:.3g} at {self.worst_index} "
            f"(got {self.actual_value:.6g}, reference {self.reference_value:.6g}); "
            f"allowed {self.allowed:.3g} = 2 x torch's own {self.torch_error:.3g} + atol -> {verdict}"
        )


def compare_to_reference(
    name: str,
    actual: torch.Tensor,
    precise: torch.Tensor,
    torch_lowp: torch.Tensor,
    *,
    atol: float | None = None,
    torch_samples: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> Comparison:
    """Apply the tolerance rule to one tensor.

    Args:
        name: what the tensor is, for the report (e.g. ``"grad x"``).
        actual: the tested result.
        precise: the reference computed in fp64 (or fp32 for fp32-only checks).
        torch_lowp: the same computation by PyTorch in ``actual``'s precision.
        atol: slack relative to max|precise|; default by ``actual``'s dtype.
        torch_samples: more ``(precise, torch_lowp)`` pairs of the same computation on
            other data (e.g. other upstream gradients); PyTorch's own error is the worst
            over all samples.

    Returns:
        A :class:`Comparison`; NaNs must sit exactly where the reference has them.

    Raises:
        ValueError: the three tensors do not have the same shape.
    """
    if not (actual.shape == precise.shape == torch_lowp.shape):
        raise ValueError(
            f"{name}: shapes differ: actual {tuple(actual.shape)}, reference {tuple(precise.shape)}, "
            f"torch {tuple(torch_lowp.shape)}"
        )
    atol = DEFAULT_ATOL.get(actual.dtype, 1e-5) if atol is None else atol
    # fp64 on the tensors' own device: copying large GPU tensors to the CPU for the rule's
    # few passes would take far longer than the passes
    a, p = (v.detach().to(device=actual.device, dtype=torch.float64) for v in (actual, precise))
    nan_diff = torch.isnan(a) != torch.isnan(p)
    if nan_diff.any():
        first = tuple(int(i) for i in nan_diff.nonzero()[0])
        return Comparison(name, float("nan"), 0.0, 0.0, first, a[first].item(), p[first].item(), int(nan_diff.sum()))
    if a.numel() == 0:
        return Comparison(name, 0.0, 0.0, 0.0, (), 0.0, 0.0)
    finite = torch.isfinite(p)
    # Infinities must match exactly; matching infinities and NaNs count as zero error.
    err = torch.where(finite, (a - p).abs(), torch.where((a == p) | torch.isnan(p), 0.0, float("inf")))
    # where PyTorch's own low-precision result overflows, overflowing alike is no error
    t = torch_lowp.detach().to(device=actual.device, dtype=torch.float64)
    overflowed = finite & ~torch.isfinite(t) & ((a == t) | (torch.isnan(a) & torch.isnan(t)))
    err = torch.where(overflowed, 0.0, err)
    torch_error = max(_max_error(lowp, exact) for exact, lowp in ((precise, torch_lowp), *torch_samples))
    scale = p[finite].abs().max().item() if finite.any() else 0.0
    flat = int(err.argmax())
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
    allowed = 2.0 * torch_error + atol * scale
    return Comparison(name, err.max().item(), allowed, torch_error, worst, a[worst].item(), p[worst].item())


def _max_error(lowp: torch.Tensor, precise: torch.Tensor) -> float:
    """Largest finite |lowp - precise| (in fp64), ignoring non-finite references."""
    lowp, precise = (v.detach().to(device=lowp.device, dtype=torch.float64) for v in (lowp, precise))
    finite = torch.isfinite(precise)
    err = torch.nan_to_num(torch.where(finite, (lowp - precise).abs(), 0.0), nan=0.0, posinf=0.0)
    return err.max().item() if err.numel() else 0.0


def assert_all_passed(comparisons: Sequence[Comparison], context: str = "") -> None:
    """Raise AssertionError listing every comparison, if any failed.

    Args:
        comparisons: what :func:`check_function`, :func:`check_module` or
            :func:`compare_to_reference` returned.
        context: named in the message (e.g. the hypothesis case).

    Raises:
        AssertionError: at least one comparison failed; the message lists all of them.
    """
    if all(c.passed for c in comparisons):
        return
    lines = "\n  ".join(c.message() for c in comparisons)
    raise AssertionError(f"tolerance rule failed{' for ' + context if context else ''}:\n  {lines}")


def _non_overlapping(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory (each dim, by stride, steps over the
    span of the smaller ones); an expanded view does not qualify."""
    span = 1
    dims = sorted(((stride, size) for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1))
    for stride, size in dims:
        if stride < span:
            return False
        span = stride * size
    return True


def _detached(value, dtype: torch.dtype | None, requires_grad: bool):
    """A leaf copy of ``value`` (in ``dtype`` if floating and given) with its strides: a
    strided view (rows of a wider buffer) stays one, so the op meets the layout it was given."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    dtype = dtype if dtype is not None and value.is_floating_point() else value.dtype
    if value.numel() and not value.is_contiguous() and _non_overlapping(value):
        span = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride(), strict=True))
        out = torch.empty(span, dtype=dtype, device=value.device).as_strided(value.shape, value.stride())
        out.copy_(value)
    else:
        out = value.to(dtype).clone()
    return out.requires_grad_(requires_grad)


def _normal(shape: torch.Size, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """fp64 N(0, 1) drawn on ``device`` by a generator seeded from ``generator``: as
    reproducible as drawing from ``generator`` itself, but a GPU check no longer waits on
    the CPU's sampler, which dominated a GPU check's time."""
    seed = int(torch.randint(0, 2**63 - 1, (), generator=generator))
    return torch.randn(shape, generator=torch.Generator(device).manual_seed(seed), dtype=torch.float64, device=device)


def _perturbed(value, generator: torch.Generator | None):
    """A floating-point tensor moved by a few ulp of its dtype (x * (1 + 8 eps N(0, 1)),
    rounded back); anything else as it is."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return value
    noise = _normal(value.shape, generator, value.device)
    return (value.detach().double() * (1 + 8 * torch.finfo(value.dtype).eps * noise)).to(value.dtype)


def _outputs(result, who: str) -> tuple[torch.Tensor, ...]:
    """A function's result as a tuple of tensors (one tensor, or a tuple or list of them).

    Raises:
        ValueError: anything else, naming ``who``.
    """
    outputs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    if not outputs or not all(isinstance(o, torch.Tensor) for o in outputs):
        kinds = ", ".join(type(o).__name__ for o in outputs)
        raise ValueError(f"check_function: {who} must return a tensor or a tuple of tensors, got ({kinds})")
    return outputs


def _backward(outputs, tensors, dys):
    """Gradients of ``tensors`` for the upstream gradients ``dys`` of the outputs that have
    a graph (an output that does not depend on a differentiated input has none)."""
    pairs = [(o, dy.to(o.dtype)) for o, dy in zip(outputs, dys, strict=True) if o.requires_grad]
    if not pairs:
        return (None,) * len(tensors)
    return torch.autograd.grad([o for o, _ in pairs], tensors, [dy for _, dy in pairs], allow_unused=True)


def _reference_runs(reference, inputs, grad_inputs, dys) -> dict[str, tuple]:
    """``reference`` on fp64 copies of the floating-point inputs ("precise") and on copies
    in their own dtype ("lowp"): per precision ``(outputs, gradients for dys)``."""
    runs = {}
    for label, dtype in (("precise", torch.float64), ("lowp", None)):
        args = {k: _detached(v, dtype, k in grad_inputs) for k, v in inputs.items()}
        results = _outputs(reference(**args), "the reference")
        if len(results) != len(dys):
            raise ValueError(f"check_function: the reference returns {len(results)} outputs, the function {len(dys)}")
        grads = _backward(results, [args[k] for k in grad_inputs], dys) if grad_inputs else ()
        runs[label] = (tuple(r.detach() for r in results), grads)
    return runs


def check_function(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    reference: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: Mapping[str, object],
    *,
    grad_inputs: Sequence[str] | None = None,
    atol: float | None = None,
    generator: torch.Generator | None = None,
    torch_draws: int | None = None,
) -> list[Comparison]:
    """Check ``fn``'s outputs and gradients against ``reference`` by the tolerance rule.

    ``fn`` runs on ``inputs`` as given (the precision under test; a strided input keeps
    its strides). ``reference`` runs twice: on fp64 copies of the floating-point inputs
    (the precise answer) and on copies in their own dtype (PyTorch's own error). One
    random upstream gradient per output, rounded to that output's dtype, is shared by the
    three backward passes. Each output is judged on its own, so that a small output
    beside a large one is held to its own scale.

    PyTorch's own error is the worst over these inputs and ``torch_draws - 1`` copies of
    them whose floating-point tensors are moved by a few ulp (x * (1 + 8 eps N(0, 1)),
    rounded to their dtype), each with its own upstream gradients, the reference run on
    each in both precisions. The largest error of a tensor of a few elements, or of a few
    large ones, each a long sum, is one draw of a wide distribution, and one lucky draw of
    PyTorch's would fail an equally accurate kernel; so a check whose output or a
    differentiated input has fewer than ``SMALL_TENSOR`` elements takes PyTorch's error
    over ``SMALL_TENSOR_DRAWS`` samples by default. The kernel's error is judged on the
    given inputs only.

    Args:
        fn: the function under test, called with ``**inputs``; returns a tensor or a tuple
            of tensors. An autograd.Function's ``apply`` takes no keywords before torch
            2.13: pass ``lambda x: MyFunction.apply(x)``.
        reference: a plain-PyTorch function with the same signature and outputs.
        inputs: keyword arguments; tensors and plain values.
        grad_inputs: names of the floating-point tensor inputs to differentiate (default:
            every one). A gradient ``fn`` does not give (None) counts as zeros.
        atol: see :func:`compare_to_reference`.
        generator: a CPU generator seeding the upstream gradients and the perturbations
            (drawn on the tensors' device; reproducible checks).
        torch_draws: samples (the inputs, then perturbed copies) over which PyTorch's own
            error is taken; default 3, or ``SMALL_TENSOR_DRAWS`` for small tensors.

    Returns:
        Comparisons for ``output`` (``output 0``, ``output 1``, ... for several) and
        ``grad <name>`` of each differentiated input.

    Raises:
        ValueError: a name in ``grad_inputs`` that is no floating-point tensor input, or a
            function or reference that does not return tensors (or not as many).
    """
    if grad_inputs is None:
        grad_inputs = [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    for name in grad_inputs:
        value = inputs.get(name)
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            got = "no such input" if name not in inputs else f"{type(value).__name__} {getattr(value, 'dtype', '')}"
            raise ValueError(f"check_function: grad_inputs names {name!r}, not a floating-point tensor input ({got})")
    actual_args = {k: _detached(v, None, k in grad_inputs) for k, v in inputs.items()}
    out = _outputs(fn(**actual_args), "the function")
    names = ["output"] if len(out) == 1 else [f"output {i}" for i in range(len(out))]
    if torch_draws is None:
        sizes = [*(o.numel() for o in out), *(inputs[k].numel() for k in grad_inputs)]
        torch_draws = SMALL_TENSOR_DRAWS if min(sizes) < SMALL_TENSOR else 3

    def upstream():
        # rounded to each output's dtype: the precise backward then sees the very values the tested one does
        return [_normal(o.shape, generator, o.device).to(o.dtype) for o in out]

    dys = upstream()
    main = _reference_runs(reference, inputs, grad_inputs, dys)
    samples = [
        _reference_runs(reference, {k: _perturbed(v, generator) for k, v in inputs.items()}, grad_inputs, upstream())
        for _ in range(1, torch_draws)
    ]
    results = []
    for i, name in enumerate(names):
        more = [(sample["precise"][0][i], sample["lowp"][0][i]) for sample in samples]
        results.append(
            compare_to_reference(name, out[i], main["precise"][0][i], main["lowp"][0][i], atol=atol, torch_samples=more)
        )
    if not grad_inputs:
        return results
    got_grads = _backward(out, [actual_args[k] for k in grad_inputs], dys)
    for i, name in enumerate(grad_inputs):
        got, precise, lowp = got_grads[i], main["precise"][1][i], main["lowp"][1][i]
        if precise is None:  # the reference does not use this input: its gradient is zero
            precise = lowp = torch.zeros_like(inputs[name], dtype=torch.float64)
            if got is None:
                continue
        if got is None:  # no gradient from fn: zeros, as autograd's accumulation would take it
            got = torch.zeros_like(inputs[name])
        more = [(sample["precise"][1][i], sample["lowp"][1][i]) for sample in samples]
        more = [(p, q) for p, q in more if p is not None]
        results.append(compare_to_reference(f"grad {name}", got, precise, lowp, atol=atol, torch_samples=more))
    return results


def check_module(
    module: torch.nn.Module,
    reference: torch.nn.Module,
    *inputs: torch.Tensor,
    atol: float | None = None,
    generator: torch.Generator | None = None,
    torch_draws: int | None = None,
) -> list[Comparison]:
    """Check a module's output, input gradients and parameter gradients against a reference module.

    The reference module must have the same parameter names (e.g. ``torch.nn.LayerNorm``
    for ``lstrain.nn.LayerNorm``). Its parameters are overwritten with ``module``'s; a
    deep copy of it in fp64 gives the precise answer, the reference itself in the
    tested dtype gives PyTorch's own error.

    Example::

        ours = lstrain.nn.LayerNorm(1024).cuda().bfloat16()
        theirs = torch.nn.LayerNorm(1024).cuda().bfloat16()
        x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
        assert_all_passed(check_module(ours, theirs, x))

    Args:
        module: the module under test, in the precision under test.
        reference: a plain-PyTorch module with the same parameter names and shapes.
        *inputs: positional inputs for both; floating-point ones are differentiated.
        atol: see :func:`compare_to_reference`.
        generator: a CPU generator seeding the upstream gradients and the perturbations
            (drawn on the tensors' device; reproducible checks).
        torch_draws: see :func:`check_function`.

    Returns:
        Comparisons for ``output``, ``grad input<i>`` and ``grad <parameter name>``.

    Raises:
        ValueError: the two modules' parameter names or shapes differ, or an input is no
            tensor.
    """
    params = dict(module.named_parameters())
    ref_params = dict(reference.named_parameters())
    if params.keys() != ref_params.keys():
        raise ValueError(f"check_module: parameter names differ: {sorted(params)} vs {sorted(ref_params)}")
    shapes = {n: (tuple(p.shape), tuple(ref_params[n].shape)) for n, p in params.items()}
    if any(ours != theirs for ours, theirs in shapes.values()):
        raise ValueError(f"check_module: parameter shapes differ: {shapes}")
    with torch.no_grad():
        for name, p in ref_params.items():
            p.copy_(params[name])
    precise_ref = copy.deepcopy(reference).to(torch.float64)
    input_names = [f"input{i}" for i in range(len(inputs))]

    def call(m: torch.nn.Module, kw: dict) -> torch.Tensor:
        state = {name: kw[name] for name in params}
        return torch.func.functional_call(m, state, tuple(kw[n] for n in input_names))

    def reference_call(**kw):
        precise = any(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in kw.values())
        return call(precise_ref if precise else reference, kw)

    for name, value in zip(input_names, inputs, strict=True):
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"check_module: {name} is a {type(value).__name__}; inputs are tensors (bind other arguments into the "
                "modules, e.g. with functools.partial of a wrapper)"
            )
    values = {**dict(params), **dict(zip(input_names, inputs, strict=True))}
    grad_names = [n for n, v in values.items() if v.is_floating_point()]
    return check_function(
        lambda **kw: call(module, kw),
        reference_call,
        values,
        grad_inputs=grad_names,
        atol=atol,
        generator=generator,
        torch_draws=torch_draws,
    )
