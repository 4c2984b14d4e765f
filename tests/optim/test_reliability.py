"""The silent failures of issue 28: each case against torch.optim as the reference.

Every test here failed on the optimizers before the fix (stale or zero gradients, an
un-updated model, a shared step counter, a bare broadcast error, state half overwritten).
"""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lstrain import _backend
from lstrain.optim import FusedAdamW, FusedSGD
from tests.conftest import DEVICE, EXPECTED_BACKEND


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(DEVICE, dtype)


def _loss(model, seed):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)).to(DEVICE, next(model.parameters()).dtype)
    return model(x).square().sum()


def _assert_close(model, twin, **tolerance):
    tolerance = tolerance or dict(rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


# Item 1: model.zero_grad() / p.grad = None detached .grad from the flat buffer.


@pytest.mark.parametrize("clear", ["model.zero_grad", "grad = None", "set_to_none", "accumulate"])
def test_gradients_reach_the_step_however_they_were_cleared(clear):
    model, twin = _model(), _model()
    ours = FusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    for step in range(4):
        for m, optimizer in ((model, ours), (twin, theirs)):
            if clear == "grad = None":
                for p in m.parameters():
                    p.grad = None
            elif clear == "set_to_none":
                optimizer.zero_grad(set_to_none=True)
            else:
                m.zero_grad()
            _loss(m, step).backward()
            if clear == "accumulate":
                _loss(m, step + 100).backward()
            if optimizer is theirs:
                torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
            optimizer.step()
        _assert_close(model, twin)
    ours.flat.check_attached()  # the views are back: the next backward fills the buffer directly


def test_the_views_survive_the_optimizers_zero_grad():
    model = _model()
    optimizer = FusedAdamW(model.parameters())
    views = [p.grad for p in model.parameters()]
    _loss(model, 0).backward()
    optimizer.zero_grad()
    assert all(p.grad is view for p, view in zip(model.parameters(), views, strict=True))
    assert all(torch.count_nonzero(b.grad) == 0 for b in optimizer.flat.buffers)


# Item 2: casting or moving the model after building the optimizer.


def _repoint(model):
    for p in model.parameters():
        p.data = p.data.clone()  # what vector_to_parameters and hand-written loaders do


@pytest.mark.parametrize("move", [lambda m: m.double(), lambda m: m.half(), lambda m: m.to(torch.bfloat16), _repoint])
def test_a_moved_or_cast_model_is_an_error_naming_the_fix(move):
    model = _model()
    optimizer = FusedAdamW(model.parameters())
    move(model)
    with pytest.raises(RuntimeError, match="build the optimizer after moving or casting the model"):
        optimizer.step()


@pytest.mark.gpu
def test_a_model_moved_off_the_gpu_is_an_error():
    model = _model()
    optimizer = FusedAdamW(model.parameters())
    model.cpu()
    with pytest.raises(RuntimeError, match="build the optimizer after moving or casting the model"):
        optimizer.step()


def test_a_second_optimizer_over_the_same_parameters_takes_them():
    model, twin = _model(), _model()
    first = FusedAdamW(model.parameters(), lr=1e-2)
    second = FusedAdamW(model.parameters(), lr=1e-2)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match="another FusedAdamW built over it after this one"):
        first.step()
    for step in range(2):
        for m, optimizer in ((model, second), (twin, reference)):
            optimizer.zero_grad()
            _loss(m, step).backward()
            optimizer.step()
    _assert_close(model, twin)


# Item 3: parameters without a gradient, or frozen after the optimizer was built.


@settings(max_examples=8)
@given(
    st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=2, max_size=5),
    st.sampled_from(["adamw", "adam", "sgd"]),
)
def test_parameters_without_gradients_are_left_alone_as_torch_does(uses, kind):
    """Each step a random subset of the parameters gets a gradient; the others have
    ``.grad`` None and must keep weights, moments and step count, as in torch."""
    torch.manual_seed(0)
    shapes = [(5, 3), (5,), (1,), (2, 7)]
    ours = [torch.nn.Parameter(torch.randn(s, device=DEVICE)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    if kind == "sgd":
        optimizer = FusedSGD(ours, lr=0.1, momentum=0.9, weight_decay=0.1)
        reference = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, weight_decay=0.1, foreach=False)
    else:
        optimizer = FusedAdamW(ours, lr=0.1, weight_decay=0.1, decoupled=kind == "adamw")
        reference = (torch.optim.AdamW if kind == "adamw" else torch.optim.Adam)(
            theirs, lr=0.1, weight_decay=0.1, foreach=False
        )
    for used in uses:
        grads = [torch.randn(s, device=DEVICE) if u else None for s, u in zip(shapes, used, strict=True)]
        for params, opt in ((ours, optimizer), (theirs, reference)):
            opt.zero_grad(set_to_none=True)
            for p, g in zip(params, grads, strict=True):
                p.grad = None if g is None else g.clone()
            opt.step()
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            if kind != "sgd" and b in reference.state:
                assert optimizer.state[a]["step"].item() == reference.state[b]["step"].item()


def test_a_parameter_frozen_after_the_optimizer_was_built_is_left_alone():
    model, twin = _model(), _model()
    ours = FusedAdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    theirs = torch.optim.AdamW(twin.parameters(), lr=0.1, weight_decay=0.5)
    for step in range(4):
        if step == 2:
            model[0].weight.requires_grad_(False)
            twin[0].weight.requires_grad_(False)
        frozen = model[0].weight.detach().clone()
        for m, optimizer in ((model, ours), (twin, theirs)):
            optimizer.zero_grad()  # ours keeps the views (zeroed): requires_grad decides
            _loss(m, step).backward()
            optimizer.step()
        if step >= 2:
            assert torch.equal(model[0].weight, frozen)
        _assert_close(model, twin)


def test_a_parameter_frozen_when_built_trains_once_unfrozen():
    model, twin = _model(), _model()
    model[0].weight.requires_grad_(False)
    twin[0].weight.requires_grad_(False)
    ours = FusedAdamW(model.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    for step in range(4):
        if step == 2:
            model[0].weight.requires_grad_(True)
            twin[0].weight.requires_grad_(True)
        for m, optimizer in ((model, ours), (twin, theirs)):
            optimizer.zero_grad()
            _loss(m, step).backward()
            optimizer.step()
        _assert_close(model, twin)
    assert ours.state[model[0].weight]["step"].item() == 2.0


# Item 4: state dicts in torch's layout, one step tensor per parameter.


def _train(model, optimizer, steps, start=0):
    for step in range(start, start + steps):
        optimizer.zero_grad()
        _loss(model, step).backward()
        optimizer.step()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_state_dicts_round_trip_through_torch(kind):
    def ours(model):
        if kind == "sgd":
            return FusedSGD(model.parameters(), lr=1e-2, momentum=0.9)
        return FusedAdamW(model.parameters(), lr=1e-2)

    def theirs(model):
        if kind == "sgd":
            return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=False)
        return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

    # ours -> torch -> ours, against torch all the way
    reference = _model()
    reference_optimizer = theirs(reference)
    _train(reference, reference_optimizer, 2)
    model = _model()
    optimizer = ours(model)
    _train(model, optimizer, 2)
    saved = optimizer.state_dict()
    if kind == "adamw":
        steps = [entry["step"] for entry in saved["state"].values()]
        assert all(s.dtype == torch.float32 and s.device.type == "cpu" and s.shape == () for s in steps)
        assert len({s.untyped_storage().data_ptr() for s in steps}) == len(steps)  # each its own tensor
    else:
        assert all(set(entry) == {"momentum_buffer"} for entry in saved["state"].values())
    assert saved["state"].keys() == reference_optimizer.state_dict()["state"].keys()
    middle = copy.deepcopy(model)
    middle_optimizer = theirs(middle)
    middle_optimizer.load_state_dict(copy.deepcopy(saved))
    _train(middle, middle_optimizer, 2, start=2)
    _train(reference, reference_optimizer, 2, start=2)
    _assert_close(middle, reference)
    if kind == "adamw":
        assert all(s["step"].item() == 4.0 for s in middle_optimizer.state.values())
    back = copy.deepcopy(middle)
    back_optimizer = ours(back)
    back_optimizer.load_state_dict(copy.deepcopy(middle_optimizer.state_dict()))
    _train(back, back_optimizer, 2, start=4)
    _train(reference, reference_optimizer, 2, start=4)
    _assert_close(back, reference)


def test_a_16_bit_master_survives_a_round_trip_and_a_stale_one_is_dropped():
    model = _model(dtype=torch.bfloat16)
    optimizer = FusedAdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 2)
    saved = copy.deepcopy(optimizer.state_dict())
    resumed_model = copy.deepcopy(model)
    resumed = FusedAdamW(resumed_model.parameters(), lr=1e-2)
    resumed.load_state_dict(saved)
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(optimizer.state[p]["master_param"], resumed.state[q]["master_param"])
    # torch.optim stepped the bf16 weights without touching the (extra) master copy
    stale = copy.deepcopy(model)
    torch_optimizer = torch.optim.AdamW(stale.parameters(), lr=1e-2)
    torch_optimizer.load_state_dict(copy.deepcopy(saved))
    _train(stale, torch_optimizer, 1, start=2)
    weights = [p.detach().clone() for p in stale.parameters()]
    again = FusedAdamW(stale.parameters(), lr=1e-2, weight_decay=0.0)
    again.load_state_dict(torch_optimizer.state_dict())
    again.param_groups[0]["lr"] = 0.0  # a step that moves nothing: the weights must stay
    _train(stale, again, 1, start=3)
    for p, weight in zip(stale.parameters(), weights, strict=True):
        assert torch.equal(p, weight)
        assert torch.equal(again.state[p]["master_param"], p.float())


@pytest.mark.parametrize("model_first", [True, False])
def test_a_16_bit_resume_is_bit_for_bit_whichever_state_loads_first(model_first):
    """The saved fp32 masters hold what the bf16 weights lost to rounding: a resume keeps
    them whether the model's state or the optimizer's is loaded first."""
    model = _model(dtype=torch.bfloat16)
    optimizer = FusedAdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 2)
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    _train(model, optimizer, 2, start=2)
    resumed_model = _model(seed=1, dtype=torch.bfloat16)
    resumed = FusedAdamW(resumed_model.parameters(), lr=1e-2)
    if model_first:
        resumed_model.load_state_dict(saved_model)
        resumed.load_state_dict(saved_optimizer)
    else:
        resumed.load_state_dict(saved_optimizer)
        resumed_model.load_state_dict(saved_model)
    _train(resumed_model, resumed, 2, start=2)
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(optimizer.state[p]["master_param"], resumed.state[q]["master_param"])


def test_a_tensor_lr_that_a_scheduler_fills_in_place_reaches_the_update():
    model, twin = _model(), _model()
    ours = FusedAdamW(model.parameters(), lr=torch.tensor(1e-2))
    theirs = torch.optim.AdamW(twin.parameters(), lr=torch.tensor(1e-2), foreach=False)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ours, theirs)]
    for step in range(3):
        for m, o, scheduler in zip((model, twin), (ours, theirs), schedulers, strict=True):
            _train(m, o, 1, start=step)
            scheduler.step()
    _assert_close(model, twin)


def test_a_16_bit_model_loaded_after_building_the_optimizer_is_not_reverted():
    """``model.load_state_dict`` writes the bf16 weights in place; the fp32 master copy
    must follow, or the first step writes the old weights back."""
    model = _model(dtype=torch.bfloat16)
    loaded = _model(seed=1, dtype=torch.bfloat16).state_dict()
    optimizer = FusedAdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    model.load_state_dict(loaded)
    _train(model, optimizer, 1)
    for name, p in model.named_parameters():
        assert torch.equal(p, loaded[name]), name


# Item 5: add_param_group.


def test_add_param_group_then_step_matches_torch():
    model, twin = _model(), _model()
    ours = FusedAdamW(model[0].parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(twin[0].parameters(), lr=1e-2, foreach=False)
    _train(model, ours, 2)
    _train(twin, theirs, 2)
    ours.add_param_group({"params": model[2].parameters(), "lr": 3e-2, "weight_decay": 0.0})
    theirs.add_param_group({"params": twin[2].parameters(), "lr": 3e-2, "weight_decay": 0.0})
    _train(model, ours, 3, start=2)
    _train(twin, theirs, 3, start=2)
    _assert_close(model, twin)
    assert [s["step"].item() for s in ours.state.values()] == [5.0, 5.0, 3.0, 3.0]


def test_add_param_group_with_a_bad_group_changes_nothing():
    model = _model()
    optimizer = FusedAdamW(model[0].parameters())
    with pytest.raises(ValueError, match="lr must be >= 0"):
        optimizer.add_param_group({"params": model[2].parameters(), "lr": -1.0})
    assert len(optimizer.param_groups) == 1
    optimizer.add_param_group({"params": model[2].parameters()})  # the parameters are free to add


# Item 6: load_state_dict checks everything before changing anything.


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_mismatched_state_dict_changes_nothing(kind):
    model = _model()
    optimizer = FusedSGD(model.parameters(), momentum=0.9) if kind == "sgd" else FusedAdamW(model.parameters())
    _train(model, optimizer, 2)
    bad = copy.deepcopy(optimizer.state_dict())
    key = "momentum_buffer" if kind == "sgd" else "exp_avg_sq"
    bad["state"][3][key] = torch.zeros(4)  # the last bias has 3 elements
    bad["param_groups"][0]["lr"] = 0.5
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match=rf"{key} of parameter 3 \(group 0\) has shape \(4,\), the parameter \(3,\)"):
        optimizer.load_state_dict(bad)
    after = optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for index, entry in before["state"].items():
        for name, value in entry.items():
            assert torch.equal(after["state"][index][name], value), (index, name)


def test_load_state_dict_refuses_what_it_cannot_honour():
    model = _model()
    optimizer = FusedAdamW(model.parameters())
    saved = optimizer.state_dict()
    saved["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="group 0: FusedAdamW: amsgrad=True is not supported"):
        optimizer.load_state_dict(saved)
    with pytest.raises(ValueError, match="maximize=True is not supported"):
        FusedSGD([{"params": model.parameters(), "maximize": True}])
    saved = optimizer.state_dict()
    saved["state"] = {99: {"step": torch.tensor(1.0)}}
    with pytest.raises(ValueError, match="state for parameter 99, which no group lists"):
        optimizer.load_state_dict(saved)


def test_a_parameter_without_saved_state_starts_afresh():
    model, twin = _model(), _model()
    optimizer = FusedAdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 2)
    optimizer.load_state_dict(torch.optim.AdamW(twin.parameters(), lr=1e-2).state_dict())  # no state yet
    assert all(s["step"].item() == 0 and torch.count_nonzero(s["exp_avg"]) == 0 for s in optimizer.state.values())


# Other silent failures of the same kinds.


def test_sgd_honours_nesterov_per_group():
    model, twin = _model(), _model()
    groups = lambda m: [  # noqa: E731
        {"params": m[0].parameters(), "nesterov": True},
        {"params": m[2].parameters()},
    ]
    ours = FusedSGD(groups(model), lr=1e-2, momentum=0.9)
    theirs = torch.optim.SGD(groups(twin), lr=1e-2, momentum=0.9, foreach=False)
    _train(model, ours, 3)
    _train(twin, theirs, 3)
    _assert_close(model, twin)


def test_non_contiguous_and_view_parameters_train_as_in_torch():
    torch.manual_seed(0)
    base = torch.randn(6, 4, device=DEVICE)
    ours = [
        torch.nn.Parameter(base.t()),
        torch.nn.Parameter(base[1:3]),
        torch.nn.Parameter(torch.randn(0, device=DEVICE)),
    ]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    optimizer = FusedAdamW(ours, lr=1e-2)
    reference = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    for step in range(3):
        for params, opt in ((ours, optimizer), (theirs, reference)):
            opt.zero_grad()
            (params[0].sum() * step + params[1].square().sum() + params[2].sum()).backward()
            opt.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)


def test_step_records_its_backend():
    model = _model()
    optimizer = FusedSGD(model.parameters())
    with _backend.record_backends() as ran:
        optimizer.step()
    assert ran == [("FusedSGD", EXPECTED_BACKEND)]


@pytest.mark.gpu
def test_a_whole_training_step_is_captured_in_a_cuda_graph_without_a_sync():
    """zero_grad, forward, backward and a clipped step in one CUDA graph: the host-side
    checks of step() must do no device work once nothing changes, and no step syncs."""
    model, twin = _model(), _model()
    captured = FusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    eager = FusedAdamW(twin.parameters(), lr=1e-2, max_grad_norm=1.0)
    static_x = torch.randn(4, 6, device=DEVICE)

    def train_step(m, optimizer, x):
        optimizer.zero_grad()
        m(x).square().sum().backward()
        optimizer.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            train_step(model, captured, static_x)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        train_step(twin, eager, static_x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step(model, captured, static_x)
    for step in range(4):
        x = torch.randn(4, 6, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(step))
        static_x.copy_(x)
        graph.replay()
        torch.cuda.set_sync_debug_mode("error")
        try:
            train_step(twin, eager, x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _assert_close(model, twin)


@pytest.mark.parametrize("schedule", [(0.0, 0.9, 0.9), (0.9, 0.0, 0.0, 0.9), (0.0, 0.0, 0.5, 0.9)])
@pytest.mark.parametrize("dampening", [0.0, 0.3])
def test_sgd_momentum_changed_mid_run_as_torch(schedule, dampening):
    """A group's momentum set by a schedule: torch starts the buffer from the gradient at
    the first step with momentum and leaves it alone while momentum is 0; the state dict
    holds a buffer exactly when torch's does, and a torch state dict taken mid-run resumes."""
    model, twin = _model(), _model()
    ours = FusedSGD(model.parameters(), lr=0.1, dampening=dampening, weight_decay=0.01)
    theirs = torch.optim.SGD(twin.parameters(), lr=0.1, dampening=dampening, weight_decay=0.01, foreach=False)
    for step, momentum in enumerate(schedule):
        for optimizer in (ours, theirs):
            optimizer.param_groups[0]["momentum"] = momentum
        _train(model, ours, 1, start=step)
        _train(twin, theirs, 1, start=step)
        _assert_close(model, twin)
        saved, expected = ours.state_dict(), theirs.state_dict()
        assert {k: set(v) for k, v in saved["state"].items()} == {k: set(v) for k, v in expected["state"].items()}
        if step == 1:  # resume both from torch's state dict
            ours = FusedSGD(model.parameters(), lr=0.1, dampening=dampening, weight_decay=0.01)
            ours.load_state_dict(copy.deepcopy(expected))
