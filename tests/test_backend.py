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


def test_device_limits():
    """The interpreter reports an H200's shared memory and TMA but no asynchronous copies
    (it runs no Gluon); a GPU its own (Triton checks launches against the same opt-in maximum)."""
    index = _backend.device_index(torch.zeros(1, device=DEVICE))
    if index < 0:
        assert _backend.shared_memory_per_program(index) == _backend.HOPPER_SHARED_MEMORY
        assert _backend.has_tma(index)
        assert not _backend.has_async_copy(index)
    else:
        assert 48 * 1024 <= _backend.shared_memory_per_program(index) <= _backend.HOPPER_SHARED_MEMORY
        assert _backend.has_tma(index) == (torch.cuda.get_device_capability(index)[0] >= 9)
        assert _backend.has_async_copy(index) == (torch.cuda.get_device_capability(index)[0] >= 8)
