import torch

from lstrain import _backend
from lstrain.ops import layer_norm
from tests.conftest import DEVICE, EXPECTED_BACKEND


def test_the_interpreter_runs_cpu_tensors_when_there_is_no_gpu():
    assert _backend.interpreter_active() == (not torch.cuda.is_available())
    assert _backend.backend_for(torch.zeros(1, device=DEVICE)) == EXPECTED_BACKEND


def test_record_backends_collects_and_nests():
    x = torch.randn(2, 8, device=DEVICE)
    with _backend.record_backends() as outer:
        layer_norm(x, 8)
        with _backend.record_backends() as inner:
            layer_norm(x, 8)
        layer_norm(x, 8)
    assert inner == [("layer_norm", EXPECTED_BACKEND)]
    assert outer == [("layer_norm", EXPECTED_BACKEND)] * 2
    layer_norm(x, 8)  # nothing recorded outside a block
    assert outer == [("layer_norm", EXPECTED_BACKEND)] * 2
