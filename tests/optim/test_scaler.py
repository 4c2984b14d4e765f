import pytest
import torch

from lstrain.optim import FusedAdamW, LossScaler
from tests.conftest import DEVICE


def _make():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, device=DEVICE)) for s in ((8, 4), (8,), (3, 8))]


def _backward(params, x, poison):
    loss = (x @ params[0].t() + params[1]).tanh() @ params[2].t()
    loss = loss.square().mean()
    if poison:
        loss = loss * float("inf")
    return loss


def test_matches_torch_grad_scaler():
    ours, theirs = _make(), [torch.nn.Parameter(p.detach().clone()) for p in _make()]
    optimizer = FusedAdamW(ours, lr=1e-2)
    reference = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    scaler = LossScaler(init_scale=2.0**10, growth_interval=3, device=DEVICE)
    torch_scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**10, growth_interval=3)
    scales = []
    for step in range(12):
        x = torch.randn(5, 4, device=DEVICE)
        poison = step in (2, 7)
        optimizer.zero_grad()
        scaler.scale(_backward(ours, x, poison)).backward()
        scaler.step(optimizer)
        scaler.update()
        reference.zero_grad()
        torch_scaler.scale(_backward(theirs, x, poison)).backward()
        torch_scaler.step(reference)
        torch_scaler.update()
        scales.append((scaler.get_scale().item(), torch_scaler.get_scale()))
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(a == b for a, b in scales), scales
    assert scales[2][0] == 2.0**9  # backed off after the first overflow


def test_an_overflowing_step_changes_nothing():
    params = _make()
    optimizer = FusedAdamW(params, lr=1e-2)
    scaler = LossScaler(device=DEVICE)
    x = torch.randn(5, 4, device=DEVICE)
    scaler.scale(_backward(params, x, False)).backward()
    scaler.step(optimizer)
    scaler.update()
    before = [p.detach().clone() for p in params]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in params]
    step = optimizer.state[params[0]]["step"].clone()
    optimizer.zero_grad()
    scaler.scale(_backward(params, x, True)).backward()
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    assert all(torch.equal(m, optimizer.state[p]["exp_avg"]) for m, p in zip(moments, params, strict=True))
    assert torch.equal(step, optimizer.state[params[0]]["step"])
    assert scaler.get_scale().item() == 2.0**15


def test_state_dict_round_trip():
    scaler = LossScaler(init_scale=8.0, growth_interval=5, device=DEVICE)
    other = LossScaler(device=DEVICE)
    other.load_state_dict(scaler.state_dict())
    assert other.get_scale().item() == 8.0 and other.growth_interval == 5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(init_scale=0.0), "init_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaler(device=DEVICE, **kwargs)


def test_update_before_step_is_an_error():
    with pytest.raises(RuntimeError, match="call step"):
        LossScaler(device=DEVICE).update()


@pytest.mark.parametrize("make", [torch.optim.AdamW, torch.optim.SGD])
def test_a_plain_torch_optimizer_is_served_as_grad_scaler_serves_it(make):
    ours, theirs = _make(), _make()
    optimizer, reference = make(ours, lr=1e-2), make(theirs, lr=1e-2)
    scaler = LossScaler(init_scale=2.0**10, growth_interval=2, device=DEVICE)
    torch_scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**10, growth_interval=2)
    for step in range(6):
        x = torch.randn(5, 4, device=DEVICE)
        for params, opt, s in ((ours, optimizer, scaler), (theirs, reference, torch_scaler)):
            opt.zero_grad()
            s.scale(_backward(params, x, poison=step == 3)).backward()
            s.step(opt)
            s.update()
        assert scaler.get_scale().item() == torch_scaler.get_scale()
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b)


def test_grad_scaler_state_dicts_load_both_ways():
    torch_scaler = torch.amp.GradScaler(DEVICE, init_scale=64.0, growth_interval=7)
    params = _make()
    optimizer = torch.optim.SGD(params, lr=0.1)
    torch_scaler.scale(_backward(params, torch.randn(5, 4, device=DEVICE), False)).backward()
    torch_scaler.step(optimizer)
    torch_scaler.update()  # the growth tracker is 1 now
    scaler = LossScaler(device=DEVICE)
    scaler.load_state_dict(torch_scaler.state_dict())
    assert scaler.state_dict() == torch_scaler.state_dict()
    back = torch.amp.GradScaler(DEVICE)
    back.load_state_dict(scaler.state_dict())
    assert back.state_dict() == torch_scaler.state_dict()
    with pytest.raises(ValueError, match="missing"):
        scaler.load_state_dict({})


def test_the_default_device_is_the_current_cuda_device_or_the_cpu():
    scale = LossScaler().get_scale()
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert scale.device == expected


def test_a_scale_on_another_device_than_the_parameters_is_an_error():
    optimizer = FusedAdamW(_make())
    with pytest.raises(ValueError, match="pass device= to LossScaler"):
        LossScaler(device="meta").step(optimizer)


def test_an_fp16_loss_is_scaled_as_grad_scaler_scales_it():
    loss = torch.tensor(3.0, dtype=torch.float16, device=DEVICE)
    ours = LossScaler(device=DEVICE).scale(loss)  # the default scale 2**16 is past fp16's range
    theirs = torch.amp.GradScaler(DEVICE).scale(loss)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs) and torch.isfinite(ours)
