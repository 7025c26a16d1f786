"""benchmarks/weight_change.py against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import benchmark_module


def test_relative_l2_and_max_abs_by_hand():
    wc = benchmark_module("weight_change")
    base = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[0.0, 4.0]])}  # ||base|| = 5
    new = {"a": torch.tensor([3.0, 0.3]), "b": torch.tensor([[0.0, 3.6]]), "extra": torch.zeros(1)}
    out = wc.weight_change(base, new)  # diff (0, 0.3, 0, -0.4): norm 0.5
    assert out["relative_l2"] == pytest.approx(0.1) and out["max_abs"] == pytest.approx(0.4)
    assert wc.weight_change(base, base) == {"relative_l2": 0.0, "max_abs": 0.0}


def test_a_missing_or_reshaped_tensor_is_named():
    wc = benchmark_module("weight_change")
    base = {"layer.w": torch.ones(2)}
    with pytest.raises(KeyError, match="layer.w"):
        wc.weight_change(base, {})
    with pytest.raises(ValueError, match=r"layer.w.*\(3,\)"):
        wc.weight_change(base, {"layer.w": torch.ones(3)})


def test_a_run_without_checkpoints_is_an_error_that_names_it(tmp_path):
    wc = benchmark_module("weight_change")
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        wc.last_checkpoint(tmp_path)
