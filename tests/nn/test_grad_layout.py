"""Weight gradients reach autograd's accumulation in the parameter's own layout: where a
module hands its op a ``weight.t()`` view (Linear), a transposed gradient would make the add
into ``.grad`` (or into a flat optimizer's gradient buffer) a strided one."""

import pytest
import torch

import lstrain

MODULES = {
    "Linear activation": (lambda d: lstrain.nn.Linear(32, 48, activation="gelu_tanh", device=d), 32),
    "SwiGLUMLP": (lambda d: lstrain.nn.SwiGLUMLP(32, 48, device=d), 32),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_weight_gradients_arrive_contiguous(device, name):
    make, width = MODULES[name]
    torch.manual_seed(0)
    module = make(device)
    arrived = {}
    for param_name, param in module.named_parameters():
        param.register_hook(lambda grad, param_name=param_name: arrived.update({param_name: grad.is_contiguous()}))
    module(torch.randn(16, width, device=device)).square().sum().backward()
    assert set(arrived) == {n for n, _ in module.named_parameters()}
    assert all(arrived.values()), arrived
