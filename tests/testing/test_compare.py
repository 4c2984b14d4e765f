import pytest
import torch

from lstrain.testing import Comparison, assert_all_passed, check_function, check_module, compare_to_reference


def test_rule_allows_twice_torchs_error_plus_atol():
    precise = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    lowp = precise + torch.tensor([0.0, 0.01, 0.0], dtype=torch.float64)
    inside = compare_to_reference("y", precise + 0.019, precise, lowp, atol=0.0)
    outside = compare_to_reference("y", precise + 0.021, precise, lowp, atol=0.0)
    assert inside.passed and not outside.passed
    assert outside.worst_index in {(0,), (1,), (2,)}
    assert "2 x torch's own" in outside.message() and "FAILS" in outside.message()


def test_torchs_own_error_is_the_worst_of_its_samples():
    precise = torch.tensor([1.0, 2.0], dtype=torch.float64)
    other = torch.tensor([5.0, 6.0], dtype=torch.float64)
    samples = [(other, other + torch.tensor([0.0, 0.03], dtype=torch.float64))]
    lucky = compare_to_reference("y", precise + 0.05, precise, precise, atol=0.0)
    fair = compare_to_reference("y", precise + 0.05, precise, precise, atol=0.0, torch_samples=samples)
    assert not lucky.passed
    assert fair.passed and fair.torch_error == pytest.approx(0.03)


def test_check_function_takes_torchs_error_over_perturbed_samples():
    x = {"x": torch.randn(50, 3, generator=torch.Generator().manual_seed(0))}

    def summed(x):
        return x.sum(0)

    one = check_function(summed, summed, x, generator=torch.Generator().manual_seed(1), torch_draws=1)
    three = check_function(summed, summed, x, generator=torch.Generator().manual_seed(1), torch_draws=3)
    assert [c.error for c in one] == [c.error for c in three]
    assert all(c.torch_error >= d.torch_error for c, d in zip(three, one, strict=True))


def test_check_function_is_reproducible_from_its_generator(device):
    """The upstream gradients and perturbations are drawn on the tensors' device, seeded from
    the CPU generator: the same seed gives the same errors, another seed other draws."""
    x = {"x": torch.randn(64, 5, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)}

    def summed(x):
        return x.sum(0)

    def errors(seed):
        results = check_function(summed, summed, x, generator=torch.Generator().manual_seed(seed))
        return [(c.error, c.torch_error) for c in results]

    assert errors(1) == errors(1)
    assert errors(1) != errors(2)


def test_atol_scales_with_the_reference_magnitude():
    precise = torch.tensor([100.0], dtype=torch.float64)
    c = compare_to_reference("y", precise + 0.05, precise, precise, atol=1e-3)
    assert c.allowed == pytest.approx(0.1) and c.passed


def test_nan_must_match_the_reference():
    precise = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    assert compare_to_reference("y", precise.clone(), precise, precise).passed
    wrong = compare_to_reference("y", torch.tensor([float("nan"), 1.0]), precise, precise)
    assert not wrong.passed and wrong.nan_mismatch == 2 and "NaN pattern" in wrong.message()


def test_infinities_must_match_exactly():
    precise = torch.tensor([float("-inf"), 0.0], dtype=torch.float64)
    assert compare_to_reference("y", precise.clone(), precise, precise).passed
    assert not compare_to_reference("y", torch.tensor([0.0, 0.0]), precise, precise).passed


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shapes differ"):
        compare_to_reference("y", torch.zeros(2), torch.zeros(3), torch.zeros(3))


def test_assert_all_passed_lists_every_comparison():
    good = Comparison("output", 0.0, 1.0, 0.5, (0,), 1.0, 1.0)
    bad = Comparison("grad x", 2.0, 1.0, 0.5, (3, 1), 5.0, 3.0)
    assert_all_passed([good])
    with pytest.raises(AssertionError, match=r"(?s)for case 7.*output.*grad x: max error 2 at \(3, 1\)"):
        assert_all_passed([good, bad], "case 7")


def test_check_function_catches_a_wrong_gradient():
    class WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.exp()

        @staticmethod
        def backward(ctx, dy):
            return dy  # missing the exp(x) factor

    x = torch.randn(16, dtype=torch.bfloat16)
    results = check_function(lambda x: WrongGrad.apply(x), lambda x: x.exp(), {"x": x})
    assert [c.name for c in results] == ["output", "grad x"]
    assert results[0].passed and not results[1].passed


def test_check_module_compares_parameter_gradients():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(8, 4).bfloat16(), torch.nn.Linear(8, 4).bfloat16()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    results = check_module(ours, theirs, x)
    assert {c.name for c in results} == {"output", "grad weight", "grad bias", "grad input0"}
    assert_all_passed(results)
    with pytest.raises(ValueError, match="parameter names differ"):
        check_module(ours, torch.nn.Linear(8, 4, bias=False), x)
    with pytest.raises(ValueError, match="parameter shapes differ"):
        check_module(ours, torch.nn.LayerNorm(8), x)


def test_relu_reference_takes_our_side_of_the_kink_only_within_rounding_of_zero():
    from lstrain.testing.checks import _relu_reference

    x = torch.tensor([1e-6, -1e-6, 0.5, -0.5])

    def flipped(**kw):  # an implementation on the wrong side everywhere
        return -kw["a"]

    reference = _relu_reference(lambda **kw: kw["a"] * 1.0, flipped, {"a": x}, atol=1e-3)
    expected = torch.tensor([0.0, -1e-6, 0.5, 0.0], dtype=torch.float64)
    torch.testing.assert_close(reference(a=x.double()), expected, rtol=1e-6, atol=0.0)


class _ZeroGradient(torch.autograd.Function):
    """mean(x^2) whose backward gives zeros: wrong, by gradients of ~1e-4."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x.float() ** 2).mean().to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return torch.zeros_like(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_wrong_gradient_of_small_values_fails(dtype):
    """The atol scales with the tensor: a gradient of 1e-4 is not judged against 1's slack."""
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    results = check_function(
        lambda x: _ZeroGradient.apply(x), lambda x: (x.float() ** 2).mean().to(x.dtype), {"x": x},
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    assert [c.name for c in results if not c.passed] == ["grad x"]


def test_several_outputs_are_judged_each_at_its_scale():
    """A small output beside a large one: zeroing the small one must fail (side by side in
    one tensor it hid under the large one's atol)."""
    gen = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(16, 32, generator=gen).half(), "s": (torch.randn(16, 32, generator=gen) * 1e-3).half()}

    def reference(x, s):
        return x * 2, s + x * 1e-3

    def broken(x, s):
        return x * 2, torch.zeros_like(s)

    good = check_function(reference, reference, inputs, generator=torch.Generator().manual_seed(1))
    assert all(c.passed for c in good) and [c.name for c in good][:2] == ["output 0", "output 1"]
    bad = check_function(broken, reference, inputs, generator=torch.Generator().manual_seed(1))
    assert {c.name for c in bad if not c.passed} >= {"output 1"}


def test_a_strided_input_reaches_the_function_strided():
    wide = torch.randn(6, 80, generator=torch.Generator().manual_seed(0))
    seen = []

    def fn(x):
        seen.append((x.stride(), x.is_contiguous()))
        return x * 3

    assert_all_passed(check_function(fn, lambda x: x * 3, {"x": wide[:, :40]}, generator=torch.Generator()))
    assert seen == [((80, 1), False)]


def test_torchs_own_overflow_is_allowed_alike():
    x = torch.tensor([1.0, 2.0, 12.0], dtype=torch.float16)  # exp(12) = 162755 > fp16's 65504
    assert_all_passed(check_function(torch.exp, torch.exp, {"x": x}, generator=torch.Generator()))
    finite = compare_to_reference("y", torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([float("inf")]))
    assert finite.passed  # a finite result where torch overflowed is judged as usual (here exact)


def test_a_missing_gradient_counts_as_zeros():
    class NoFloorGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, floor):
            return torch.maximum(x, floor)

        @staticmethod
        def backward(ctx, dy):
            return dy, None  # the floor never wins below: its true gradient is zero

    inputs = {"x": torch.rand(8) + 1.0, "floor": torch.zeros(8)}
    reference = lambda x, floor: torch.maximum(x, floor)  # noqa: E731
    function = lambda x, floor: NoFloorGradient.apply(x, floor)  # noqa: E731 (apply: no keywords before torch 2.13)
    assert_all_passed(check_function(function, reference, inputs, generator=torch.Generator()))


def test_misuse_is_named():
    x = {"x": torch.randn(4), "n": torch.arange(4)}
    with pytest.raises(ValueError, match=r"grad_inputs names 'y', not a floating-point tensor input \(no such"):
        check_function(torch.sin, torch.sin, x, grad_inputs=["y"])
    with pytest.raises(ValueError, match="grad_inputs names 'n', not a floating-point tensor input"):
        check_function(lambda x, n: x * n, lambda x, n: x * n, x, grad_inputs=["n"])
    with pytest.raises(ValueError, match="the function must return a tensor or a tuple of tensors, got \\(int\\)"):
        check_function(lambda x, n: 3, lambda x, n: x, x)
    with pytest.raises(ValueError, match="check_module: input1 is a int; inputs are tensors"):
        check_module(torch.nn.Linear(4, 2), torch.nn.Linear(4, 2), torch.randn(3, 4), 5)
