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
