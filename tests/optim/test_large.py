"""A flat buffer of more than 2**31 elements: every kernel of a step must reach past it.

One bf16 parameter of 2**31 + 4096 elements (4.3 GB), zero but for a few marked elements
on both sides of 2**31; their updates are checked against torch.optim on a copy of just
those elements. Peak memory: data + grad (8.6 GB) and three fp32 buffers (25.8 GB) for
AdamW, two for SGD, under 40 GB; a few seconds on an H200.
"""

import pytest
import torch

from lstrain.optim import FusedAdamW, FusedSGD, LossScaler

pytestmark = [pytest.mark.gpu, pytest.mark.large_memory]

NUMEL = 2**31 + 4096
MARKED = [0, 2**31 - 1, 2**31, 2**31 + 1000, NUMEL - 1]  # either side of 2**31, and the last


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_buffer_past_two_to_the_31_is_updated_everywhere(kind):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    index = torch.tensor(MARKED, device="cuda")
    weights = torch.tensor([0.5, -1.0, 2.0, 0.25, -0.75], dtype=torch.bfloat16, device="cuda")
    grads = torch.tensor([1.0, -2.0, 3.0, 0.5, 4.0], dtype=torch.bfloat16, device="cuda")
    param = torch.nn.Parameter(torch.zeros(NUMEL, dtype=torch.bfloat16, device="cuda"))
    with torch.no_grad():
        param[index] = weights
    reference = torch.nn.Parameter(weights.float())
    if kind == "adamw":
        optimizer = FusedAdamW([param], lr=1e-2, weight_decay=0.1)
        torch_optimizer = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1)
    else:
        optimizer = FusedSGD([param], lr=1e-2, momentum=0.9, weight_decay=0.1)
        torch_optimizer = torch.optim.SGD([reference], lr=1e-2, momentum=0.9, weight_decay=0.1)

    param.grad[index] = grads
    # the clip-norm reduction sees every marked gradient, those past 2**31 included
    torch.testing.assert_close(optimizer.grad_norm(), grads.float().norm(), rtol=1e-6, atol=0)
    for _ in range(2):
        optimizer.step()
        reference.grad = grads.float()
        torch_optimizer.step()
    master = optimizer.state[param]["master_param"]
    torch.testing.assert_close(master[index], reference.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(param[index].float(), reference.detach().bfloat16().float(), rtol=8e-3, atol=0)
    assert torch.count_nonzero(param) == len(MARKED)  # zero weights with zero gradients stay zero

    optimizer.zero_grad()
    assert torch.count_nonzero(param.grad) == 0

    # the loss scaler's overflow check sees an inf past 2**31: the step changes nothing
    before = param[index].clone()
    param.grad[NUMEL - 1] = float("inf")
    param.grad[0] = 1.0
    scaler = LossScaler(device="cuda")
    scaler.step(optimizer)
    assert optimizer.found_inf.item() == 1.0
    assert torch.equal(param[index], before)
    assert torch.cuda.max_memory_allocated() < 60 * 2**30
