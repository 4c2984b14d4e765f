"""Optimizers without fp32 master weights: bf16 weights and moments rounded stochastically.

The rounding is random, so the tests are statistical where they must be, with bounds of
six standard deviations (a false alarm about once in 10**8 runs) and fixed seeds: each
result is one of the two bf16 neighbours of the exact fp32 update, it is the exact update
on average, and updates below half a unit in the last place add up where rounding to
nearest loses them.
"""

import math

import pytest
import torch

from lstrain.optim import FusedAdamW, FusedSGD
from tests.conftest import DEVICE

ROUNDED = {"master_weights": False, "state_dtype": torch.bfloat16}


def _toward_zero(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` with the 16 bits that bf16 drops cleared (bf16's neighbour toward zero)."""
    return (x.view(torch.int32) & ~0xFFFF).view(torch.float32)


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values either side of fp32 ``x`` (both ``x`` where bf16 holds it), as fp32."""
    down = _toward_zero(x)
    up = torch.where(down == x, down, (down.view(torch.int32) + 0x10000).view(torch.float32))
    return torch.minimum(down, up), torch.maximum(down, up)


def _bf16_param(values: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(values.to(DEVICE, torch.bfloat16))


def test_each_weight_is_a_neighbour_of_the_exact_update_and_unbiased():
    torch.manual_seed(0)
    n = 16384
    p = _bf16_param(torch.randn(n))
    exact = torch.nn.Parameter(p.detach().float().clone())
    grad = torch.randn(n, device=DEVICE).bfloat16()
    ours = FusedAdamW([p], lr=3e-3, weight_decay=0.1, **ROUNDED)
    theirs = torch.optim.AdamW([exact], lr=3e-3, weight_decay=0.1, foreach=False)
    p.grad.copy_(grad)
    exact.grad = grad.float()
    ours.step()
    theirs.step()
    # the fp32 update to within a few fp32 units (another order of operations), its neighbours
    low, _ = _neighbours(exact.detach() - exact.detach().abs() * 1e-6)
    _, high = _neighbours(exact.detach() + exact.detach().abs() * 1e-6)
    got = p.detach().float()
    assert bool(((got >= low) & (got <= high)).all())
    down, up = _neighbours(exact.detach())
    moved = up != down
    assert moved.float().mean() > 0.99  # the update is not a bf16 value: rounding has a choice
    # in units of the gap and toward larger magnitudes, the error lies in (-1, 1) with mean 0
    error = ((got - exact.detach()) / (up - down) * exact.detach().sign())[moved]
    assert abs(error.double().mean().item()) < 6 * 0.5 / math.sqrt(error.numel())


def test_rounds_up_as_often_as_the_distance_says():
    """1 - 0.3 units below 1.0 rounds to 1 - 1 unit 30% of the time, to 1.0 otherwise."""
    n = 65536
    p = _bf16_param(torch.ones(n))
    unit = 2.0**-8  # bf16's gap just below 1
    p.grad = torch.full((n,), 0.3 * unit, device=DEVICE, dtype=torch.bfloat16)
    step = p.grad[0].float().item()  # what lr 1 * the bf16 gradient takes off
    FusedSGD([p], lr=1.0, master_weights=False).step()
    got = p.detach().float()
    assert set(got.unique().tolist()) == {1.0 - unit, 1.0}
    share = (got < 1.0).double().mean().item()
    want = step / unit
    assert abs(share - want) < 6 * math.sqrt(want * (1 - want) / n)


def test_small_updates_add_up_where_rounding_to_nearest_loses_them():
    """lr 1e-4 on weights at 1.0 (bf16 units of 2**-8 below): each step is ~1/40 of a unit."""
    n, steps, lr = 8192, 40, 1e-4
    grad = torch.ones(n, device=DEVICE, dtype=torch.bfloat16)
    rounded, nearest = _bf16_param(torch.ones(n)), _bf16_param(torch.ones(n))
    exact = torch.nn.Parameter(torch.ones(n, device=DEVICE))
    optimizers = [
        FusedAdamW([rounded], lr=lr, weight_decay=0.0, **ROUNDED),
        torch.optim.AdamW([nearest], lr=lr, weight_decay=0.0),  # bf16 weights and moments, to nearest
        torch.optim.AdamW([exact], lr=lr, weight_decay=0.0),
    ]
    for _ in range(steps):
        for p, optimizer in zip((rounded, nearest, exact), optimizers, strict=True):
            p.grad = grad.to(p.dtype)
            optimizer.step()
    assert bool((nearest == 1.0).all())  # every update lost
    drift = 1.0 - exact[0].item()
    assert drift == pytest.approx(steps * lr, rel=1e-2)
    got = 1.0 - rounded.detach().double().mean().item()
    # each step's rounding adds a zero-mean error of at most one unit: a random walk
    assert abs(got - drift) < 6 * 2.0**-8 * math.sqrt(steps) / math.sqrt(n)


def test_a_bf16_second_moment_decays():
    """beta2 = 0.999 takes 0.1% off v per step, under half a bf16 unit: to nearest, v stays."""
    n, steps = 8192, 60
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, device=DEVICE))
    optimizer = FusedAdamW([p], lr=0.0, weight_decay=0.0, state_dtype=torch.bfloat16)
    p.grad = torch.ones(n, device=DEVICE)
    optimizer.step()
    p.grad.zero_()
    for _ in range(steps):
        optimizer.step()
    v = optimizer.state[p]["exp_avg_sq"]
    assert v.dtype == torch.bfloat16
    want = 1e-3 * 0.999**steps
    assert want / 1e-3 < 0.95
    # each step's relative rounding error is zero-mean and below 2**-7
    assert abs(v.double().mean().item() / want - 1) < 6 * 2.0**-7 * math.sqrt(steps) / math.sqrt(n)


def test_the_seed_fixes_the_rounding():
    def run(seed):
        torch.manual_seed(0)
        p = _bf16_param(torch.randn(4096))
        optimizer = FusedAdamW([p], lr=1e-3, rounding_seed=seed, **ROUNDED)
        for _ in range(3):
            p.grad.copy_(torch.randn(4096, device=DEVICE))
            optimizer.step()
        return p.detach().clone(), optimizer.state[p]["exp_avg"].clone()

    (a, ma), (b, mb), (c, mc) = run(7), run(7), run(8)
    assert torch.equal(a, b) and torch.equal(ma, mb)
    assert not torch.equal(a, c) and not torch.equal(ma, mc)


def test_nan_in_gives_nan_out():
    p = _bf16_param(torch.ones(2048))
    optimizer = FusedAdamW([p], lr=1e-3, **ROUNDED)
    p.grad.fill_(0.5)
    p.grad[5] = math.nan
    optimizer.step()
    assert bool(p[5].isnan()) and bool(optimizer.state[p]["exp_avg"][5].isnan())
    assert bool(p[torch.arange(2048, device=DEVICE) != 5].isfinite().all())


def test_state_is_bf16_without_masters_and_torch_loads_it():
    torch.manual_seed(0)
    p = _bf16_param(torch.randn(10, 3))
    optimizer = FusedAdamW([p], lr=1e-3, **ROUNDED)
    p.grad.copy_(torch.randn(10, 3, device=DEVICE))
    optimizer.step()
    state = optimizer.state_dict()["state"][0]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}  # no master_param
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg"].shape == (10, 3)
    twin = _bf16_param(p.detach().float())
    torch_optimizer = torch.optim.AdamW([twin], lr=1e-3)
    torch_optimizer.load_state_dict(optimizer.state_dict())
    assert torch.equal(torch_optimizer.state[twin]["exp_avg_sq"], state["exp_avg_sq"])
    # and back, into an optimizer that keeps fp32 moments and masters
    back = FusedAdamW([twin], lr=1e-3)
    back.load_state_dict(torch_optimizer.state_dict())
    assert back.state[twin]["exp_avg"].dtype == torch.float32
    assert torch.equal(back.state[twin]["exp_avg"], state["exp_avg"].float())


def test_sgd_momentum_in_bf16():
    torch.manual_seed(0)
    n = 8192
    p = _bf16_param(torch.randn(n))
    exact = torch.nn.Parameter(p.detach().float().clone())
    ours = FusedSGD([p], lr=0.1, momentum=0.9, **ROUNDED)
    theirs = torch.optim.SGD([exact], lr=0.1, momentum=0.9)
    grad = torch.randn(n, device=DEVICE).bfloat16()
    largest = exact.detach().abs().clone()  # a weight's bf16 unit is at most eps times its largest value
    for _ in range(2):
        p.grad = grad.clone()
        exact.grad = grad.float()
        ours.step()
        theirs.step()
        largest = torch.maximum(largest, exact.detach().abs())
    assert ours.state[p]["momentum_buffer"].dtype == torch.bfloat16
    # two rounded steps (and a rounded momentum): within a few bf16 units, right on average
    unit = torch.finfo(torch.bfloat16).eps * largest.clamp(min=2.0**-10)
    error = (p.detach().float() - exact.detach()) / unit * exact.detach().sign()  # toward larger magnitudes
    assert bool((error.abs() <= 4).all())
    assert abs(error.double().mean().item()) < 6 * 1.0 / math.sqrt(n)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"master_weights": "no"}, "master_weights must be True or False"),
        ({"state_dtype": torch.float16}, "state_dtype must be torch.float32 or torch.bfloat16"),
        ({"rounding_seed": -1}, "rounding_seed must be an int"),
        ({"rounding_seed": 2**31}, "rounding_seed must be an int"),
        ({"rounding_seed": True}, "rounding_seed must be an int"),
        ({"rounding_seed": 1.5}, "rounding_seed must be an int"),
    ],
)
def test_bad_rounding_options_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedAdamW([_bf16_param(torch.ones(4))], **kwargs)


def test_fp16_parameters_need_master_weights():
    params = [_bf16_param(torch.ones(4)), torch.nn.Parameter(torch.ones(4, device=DEVICE, dtype=torch.float16))]
    with pytest.raises(ValueError, match="float16 parameters .* need master_weights=True"):
        FusedAdamW(params, master_weights=False)
    FusedAdamW(params, state_dtype=torch.bfloat16)  # with masters: fine


def _regression_run(options: dict, steps: int = 50) -> list[float]:
    """A bf16 MLP fitting a fixed random teacher: its training losses under FusedAdamW(**options)."""
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(DEVICE)
    x = torch.randn(256, 16, device=DEVICE)
    with torch.no_grad():
        y = teacher(x).bfloat16()
    student = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    student = student.to(DEVICE, torch.bfloat16)
    optimizer = FusedAdamW(student.parameters(), lr=3e-3, weight_decay=0.01, **options)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (student(x.bfloat16()).float() - y.float()).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_training_without_masters_tracks_training_with_them():
    with_masters = _regression_run({})
    rounded = _regression_run(ROUNDED)
    assert with_masters[-1] < 0.3 * with_masters[0]  # it learns
    assert rounded[-1] < 0.3 * rounded[0]
    # the same curve to within the rounding noise (bf16 moments and weights)
    assert abs(rounded[-1] - with_masters[-1]) < 0.1 * with_masters[-1], (rounded[-1], with_masters[-1])
