"""Optimizers without a flat gradient buffer (``flat_grads=False``): each ``.grad`` is
autograd's own tensor, read in place through a table of addresses."""

import pytest
import torch

from lstrain.optim import DataParallel, FlatParameters, FusedAdamW, FusedSGD
from tests.conftest import DEVICE


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    # odd widths: every parameter ends inside a padded block
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3)).to(DEVICE, dtype)


def _loss(model, seed):
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(seed)).to(DEVICE, next(model.parameters()).dtype)
    return model(x).square().sum()


def _assert_close(model, twin):
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("clear", ["set_to_none", "zero in place", "model.zero_grad", "accumulate"])
def test_matches_torch_however_the_gradients_were_cleared(kind, clear):
    model, twin = _model(), _model()
    if kind == "adamw":
        ours = FusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, flat_grads=False)
        theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    else:
        ours = FusedSGD(model.parameters(), lr=1e-2, momentum=0.9, max_grad_norm=1.0, flat_grads=False)
        theirs = torch.optim.SGD(twin.parameters(), lr=1e-2, momentum=0.9, foreach=False)
    assert all(p.grad is None for p in model.parameters())  # nothing allocated up front
    for step in range(4):
        for m, optimizer in ((model, ours), (twin, theirs)):
            if clear == "set_to_none":
                optimizer.zero_grad(set_to_none=True)
            elif clear == "zero in place":
                optimizer.zero_grad(set_to_none=False)
            else:
                m.zero_grad()
            _loss(m, step).backward()
            if clear == "accumulate":
                _loss(m, step + 100).backward()
            if optimizer is theirs:
                torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
            optimizer.step()
        _assert_close(model, twin)
    assert all(b.grad is None for b in ours.flat.buffers)


def test_the_same_update_as_the_flat_gradient_buffer_bit_for_bit():
    """bf16 parameters without masters, bf16 moments, clipping, two groups, a parameter
    without a gradient: the same kernels, the same stochastic rounding, gradients read
    from elsewhere."""
    model, twin = _model(dtype=torch.bfloat16), _model(dtype=torch.bfloat16)
    options = dict(lr=1e-2, max_grad_norm=0.5, master_weights=False, state_dtype=torch.bfloat16)

    def groups(m):
        return [{"params": [m[0].weight, m[2].weight]}, {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0}]

    ours = FusedAdamW(groups(model), **options, flat_grads=False)
    flat = FusedAdamW(groups(twin), **options)
    for step in range(5):
        for m, optimizer in ((model, ours), (twin, flat)):
            optimizer.zero_grad(set_to_none=True)
            _loss(m, step).backward()
            if step == 2:
                m[2].bias.grad = None  # skipped, as torch skips it
            optimizer.step()
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(a, b)
    for a, b in zip(ours.state_dict()["state"].values(), flat.state_dict()["state"].values(), strict=True):
        assert all(torch.equal(a[key], b[key]) for key in ("step", "exp_avg", "exp_avg_sq"))


def test_a_non_contiguous_gradient_is_read_in_the_parameters_order():
    model, twin = _model(), _model()
    ours = FusedAdamW(model.parameters(), lr=1e-2, flat_grads=False)
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    for m, optimizer in ((model, ours), (twin, theirs)):
        _loss(m, 0).backward()
        weight = m[0].weight
        weight.grad = weight.grad.t().contiguous().t()  # the same values, column-major
        assert not weight.grad.is_contiguous()
        optimizer.step()
    _assert_close(model, twin)


def test_gradients_are_freed_by_set_to_none():
    model = _model()
    optimizer = FusedAdamW(model.parameters(), flat_grads=False)
    _loss(model, 0).backward()
    grads = [p.grad for p in model.parameters()]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    assert all(g is not None for g in grads)  # ours to keep: the optimizer holds none of them


def test_what_needs_the_flat_gradient_buffers_refuses_loudly():
    model = _model()
    optimizer = FusedAdamW(model.parameters(), flat_grads=False)
    for call in (optimizer.flat.check_attached, optimizer.flat.attach_grads, optimizer.flat.zero_grad):
        with pytest.raises(RuntimeError, match="grads=False"):
            call()
    with pytest.raises(RuntimeError, match="flat_grads=False"):
        DataParallel(optimizer)
    with pytest.raises(ValueError, match="flat_grads must be True or False"):
        FusedAdamW(_model().parameters(), flat_grads=None)
    assert FlatParameters([list(_model().parameters())], grads=False).buffers[0].grad is None


def test_a_sparse_gradient_is_an_error_naming_it():
    model = _model()
    optimizer = FusedSGD(model.parameters(), flat_grads=False)
    weight = model[0].weight
    weight.grad = torch.zeros_like(weight).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        optimizer.step()


@pytest.mark.gpu
def test_a_captured_step_matches_eager_and_peaks_lower_than_the_flat_buffer():
    """The table is written after the capture, before the first replay: the graph's
    gradients then lie in its own memory. The captured step's peak sits below the flat
    buffer's by about the gradients' size, which backward makes as it frees activations."""
    from lstrain.train import CapturedStep

    def build(flat_grads):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(DEVICE, torch.bfloat16)
        optimizer = FusedAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0, flat_grads=flat_grads)

        def step(x):
            optimizer.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()
            optimizer.step()

        return model, optimizer, step

    x = torch.randn(4096, 1024, device=DEVICE, dtype=torch.bfloat16)
    peaks, models = {}, {}
    for flat_grads in (True, False):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()  # the other run's model and graph stay alive
        torch.cuda.reset_peak_memory_stats()
        model, optimizer, step = build(flat_grads)
        captured = CapturedStep(step, restore=(model, optimizer))
        for _ in range(3):
            captured(x)
        torch.cuda.synchronize()
        peaks[flat_grads] = torch.cuda.max_memory_allocated() - before
        models[flat_grads] = model
    eager_model, _, eager_step = build(False)
    for _ in range(3):
        eager_step(x)
    for a, b, c in zip(models[False].parameters(), eager_model.parameters(), models[True].parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    grads = sum(p.numel() * p.element_size() for p in eager_model.parameters())
    assert peaks[True] - peaks[False] > grads / 2, (peaks, grads)
