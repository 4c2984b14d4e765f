import pytest
import torch

from lstrain.models.inputs import (
    check_ids_in_range,
    check_input_ids,
    check_integer,
    check_shaped_like_input_ids,
    should_check_ids,
)


def test_input_ids_shape_dtype_and_length_are_named():
    with pytest.raises(
        ValueError, match=r"^M: input_ids must be \[batch, seq\] int64 or int32, got shape \(4,\) torch.int64$"
    ):
        check_input_ids("M", torch.zeros(4, dtype=torch.int64), "n_positions", 8)
    with pytest.raises(ValueError, match=r"torch.float32$"):
        check_input_ids("M", torch.zeros(1, 4), "n_positions", 8)
    with pytest.raises(ValueError, match=r"^M: input_ids has 9 positions; n_positions allows 1 to 8$"):
        check_input_ids("M", torch.zeros(1, 9, dtype=torch.int32), "n_positions", 8)
    check_input_ids("M", torch.zeros(2, 8, dtype=torch.int32), "n_positions", 8)


def test_shape_and_dtype_checks_skip_none_and_name_the_first_bad_tensor():
    ids = torch.zeros(2, 3, dtype=torch.int64)
    named = [("a", None), ("b", torch.zeros(2, 3)), ("c", torch.zeros(3, 2))]
    with pytest.raises(ValueError, match=r"^M: c must be shaped like input_ids \(2, 3\), got \(3, 2\)$"):
        check_shaped_like_input_ids("M", ids, named)
    with pytest.raises(ValueError, match=r"^M: b must be int64 or int32, got torch.float32$"):
        check_integer("M", named)
    check_integer("M", [("a", None), ("d", ids.int())])


def test_range_error_names_the_first_bad_value_and_its_index():
    ids = torch.tensor([[0, 5, -100], [7, -1, 2]])
    with pytest.raises(ValueError, match=r"^M: labels 7 at \(1, 0\) is outside the vocabulary \[0, 6\)$"):
        check_ids_in_range("M", "labels", ids, 6, ignore=-100, table="vocabulary")
    with pytest.raises(ValueError, match=r"^M: p -100 at \(0, 2\) is outside \[0, 6\) \(note\)$"):
        check_ids_in_range("M", "p", ids, 6, note=" (note)")
    check_ids_in_range("M", "labels", None, 6)
    check_ids_in_range("M", "labels", torch.tensor([[0, 5, -100]]), 6, ignore=-100)


def test_ids_are_read_on_the_cpu_by_default_and_never_while_compiling(monkeypatch):
    assert should_check_ids(None, torch.zeros(1, dtype=torch.int64))
    assert not should_check_ids(None, torch.zeros(1, dtype=torch.int64, device="meta"))
    assert should_check_ids(True, torch.zeros(1, dtype=torch.int64, device="meta"))
    assert not should_check_ids(False, torch.zeros(1, dtype=torch.int64))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not should_check_ids(True, torch.zeros(1, dtype=torch.int64))
