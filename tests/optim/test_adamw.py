import copy

import pytest
import torch

import lstrain
from lstrain.optim import FusedAdamW
from tests.conftest import DEVICE


def _params(dtype=torch.float32, device=DEVICE):
    torch.manual_seed(0)
    shapes = [(20, 10), (20,), (20,), (3, 20), (3,), (1,)]
    return shapes, [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype)) for s in shapes]


def _feed(params, grads):
    for p, g in zip(params, grads, strict=True):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)


@pytest.mark.parametrize("decoupled", [True, False])
def test_matches_torch_adamw_over_100_steps(decoupled):
    shapes, ours = _params()
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    groups = [{"params": ours[:3]}, {"params": ours[3:], "weight_decay": 0.0, "lr": 3e-3}]
    ref_groups = [{"params": theirs[:3]}, {"params": theirs[3:], "weight_decay": 0.0, "lr": 3e-3}]
    optimizer = FusedAdamW(groups, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, decoupled=decoupled)
    reference = (torch.optim.AdamW if decoupled else torch.optim.Adam)(
        ref_groups, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, foreach=False
    )
    for _ in range(100):
        grads = [torch.randn(s, device=DEVICE) for s in shapes]
        optimizer.zero_grad()
        _feed(ours, grads)
        _feed(theirs, grads)
        optimizer.step()
        reference.step()
    # fp32 bias corrections on the device and a different operation order: a few ulps
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _reference_bf16_step(master, m, v, grad, step, lr, betas, eps, weight_decay):
    """The same algorithm in plain PyTorch: fp32 master and moments, bf16 parameter."""
    g = grad.float()
    master.mul_(1 - lr * weight_decay)
    m.add_((1 - betas[0]) * (g - m))
    v.mul_(betas[1]).add_((1 - betas[1]) * g * g)
    denom = v.sqrt() / (1 - betas[1] ** step) ** 0.5 + eps
    master.sub_(lr / (1 - betas[0] ** step) * (m / denom))
    return master.to(torch.bfloat16)


def test_bf16_parameters_follow_the_fp32_master():
    shapes, ours = _params(torch.bfloat16)
    masters = [p.detach().float().clone() for p in ours]
    moments = [(torch.zeros_like(m), torch.zeros_like(m)) for m in masters]
    optimizer = FusedAdamW(ours, lr=1e-2, weight_decay=0.05)
    for step in range(1, 21):
        grads = [torch.randn(s, device=DEVICE).bfloat16() for s in shapes]
        optimizer.zero_grad()
        _feed(ours, grads)
        optimizer.step()
        for p, master, (m, v), g in zip(ours, masters, moments, grads, strict=True):
            expected = _reference_bf16_step(master, m, v, g, step, 1e-2, (0.9, 0.999), 1e-8, 0.05)
            assert p.dtype == torch.bfloat16
            torch.testing.assert_close(optimizer.state[p]["master_param"], master, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(p.float(), expected.float(), rtol=8e-3, atol=1e-6)


def test_gradient_clipping_matches_torch():
    shapes, ours = _params()
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    optimizer = FusedAdamW(ours, lr=1e-2, max_grad_norm=0.5)
    reference = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    for _ in range(10):
        grads = [3 * torch.randn(s, device=DEVICE) for s in shapes]
        optimizer.zero_grad()
        _feed(ours, grads)
        _feed(theirs, grads)
        optimizer.step()
        torch.nn.utils.clip_grad_norm_(theirs, 0.5)
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_training_a_model_is_unchanged_by_the_flat_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2)).to(DEVICE)
    twin = copy.deepcopy(model)
    optimizer = FusedAdamW(model.parameters(), lr=1e-2)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    assert all(p.grad is not None for p in model.parameters())  # views into the flat buffer
    for _ in range(5):
        x = torch.randn(4, 6, device=DEVICE)
        for m, o in ((model, optimizer), (twin, reference)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    optimizer.flat.check_attached()
    assert model.state_dict().keys() == twin.state_dict().keys()


def test_save_kill_resume_is_bit_for_bit(tmp_path):
    shapes, first = _params()
    optimizer = FusedAdamW(first, lr=1e-2)
    grads = [[torch.randn(s, device=DEVICE) for s in shapes] for _ in range(6)]
    for g in grads[:3]:
        optimizer.zero_grad()
        _feed(first, g)
        optimizer.step()
    torch.save({"params": [p.detach().clone() for p in first], "optim": optimizer.state_dict()}, tmp_path / "ckpt.pt")
    for g in grads[3:]:
        optimizer.zero_grad()
        _feed(first, g)
        optimizer.step()
    saved = torch.load(tmp_path / "ckpt.pt")
    second = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    resumed = FusedAdamW(second, lr=123.0)  # the state dict restores lr too
    resumed.load_state_dict(saved["optim"])
    for g in grads[3:]:
        resumed.zero_grad()
        _feed(second, g)
        resumed.step()
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_lr_changes_from_a_scheduler_take_effect():
    shapes, params = _params()
    optimizer = FusedAdamW(params, lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step == 0 else 0.0)
    before = [p.detach().clone() for p in params]
    _feed(params, [torch.randn(s, device=DEVICE) for s in shapes])
    optimizer.step()
    scheduler.step()
    _feed(params, [torch.randn(s, device=DEVICE) for s in shapes])
    after_first = [p.detach().clone() for p in params]
    optimizer.step()  # lr is 0 now, weight decay * lr too
    assert all(torch.equal(a, p) for a, p in zip(after_first, params, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(after_first, before, strict=True))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr must be >= 0"),
        (dict(betas=(0.9, 1.0)), "betas\\[1\\] must be in \\[0, 1\\)"),
        (dict(betas=(-0.1, 0.9)), "betas\\[0\\]"),
        (dict(betas=(0.9, 0.99, 0.999)), "betas must be a pair"),
        (dict(betas=0.9), "betas must be a pair"),
        (dict(eps=-1e-8), "eps must be >= 0"),
        (dict(weight_decay=-0.1), "weight_decay must be >= 0"),
        (dict(max_grad_norm=0.0), "max_grad_norm must be > 0"),
    ],
)
def test_bad_hyperparameters_are_errors(kwargs, match):
    _, params = _params()
    with pytest.raises(ValueError, match=match):
        FusedAdamW(params, **kwargs)


def test_frozen_parameters_are_never_updated():
    """A parameter that does not require grad is skipped, as torch skips a parameter
    without a gradient: weight decay must not shrink it."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2)).to(DEVICE)
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    reference = copy.deepcopy(model)
    ours = FusedAdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    theirs = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.5)
    x = torch.randn(3, 6, device=DEVICE)
    for _ in range(3):
        for m, optimizer in ((model, ours), (reference, theirs)):
            optimizer.zero_grad()
            m(x).square().sum().backward()
            optimizer.step()
    assert torch.equal(model[0].weight, frozen)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    with pytest.raises(ValueError, match="no parameter requires grad"):
        FusedAdamW([model[0].weight])


def test_bad_parameters_are_errors():
    p = torch.nn.Parameter(torch.randn(3, device=DEVICE))
    with pytest.raises(ValueError, match="several devices"):
        FusedAdamW([p, torch.nn.Parameter(torch.randn(3, device="meta"))])
    with pytest.raises(ValueError, match="appears twice"):
        lstrain.optim.FlatParameters([[p], [p]])
    optimizer = FusedAdamW([p])
    optimizer.zero_grad(set_to_none=True)  # torch's semantics: the next step re-attaches
    assert p.grad is None
    with pytest.raises(RuntimeError, match="grad was replaced or set to None"):
        optimizer.flat.check_attached()


@pytest.mark.parametrize(
    "options",
    [
        dict(momentum=0.0),
        dict(momentum=0.9),
        dict(momentum=0.9, dampening=0.1, weight_decay=1e-2),
        dict(momentum=0.9, nesterov=True, weight_decay=1e-3),
    ],
)
def test_sgd_matches_torch(options):
    shapes, ours = _params()
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    optimizer = lstrain.optim.FusedSGD(ours, lr=1e-2, **options)
    reference = torch.optim.SGD(theirs, lr=1e-2, foreach=False, **options)
    for _ in range(50):
        grads = [torch.randn(s, device=DEVICE) for s in shapes]
        optimizer.zero_grad()
        _feed(ours, grads)
        _feed(theirs, grads)
        optimizer.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_sgd_bad_options():
    _, params = _params()
    with pytest.raises(ValueError, match="nesterov needs momentum"):
        lstrain.optim.FusedSGD(params, nesterov=True)
    with pytest.raises(ValueError, match="momentum must be in"):
        lstrain.optim.FusedSGD(params, momentum=1.5)
