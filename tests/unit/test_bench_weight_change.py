"""benchmarks/weight_change.py against hand-computed values."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from rapo_ray.core.errors import ModelLoadError
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


def test_a_run_without_a_complete_checkpoint_is_an_error_that_names_it(tmp_path):
    wc = benchmark_module("weight_change")
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        wc.load_weights(tmp_path)
    step = tmp_path / "checkpoints" / "step-000030"  # written, but the save never finished (no COMPLETE marker)
    step.mkdir(parents=True)
    (step / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, str(step / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        wc.load_weights(tmp_path)
    (step / "COMPLETE").write_text("ok\n")
    folder, weights = wc.load_weights(tmp_path)
    assert folder == step and weights["w"].tolist() == [1.0, 1.0]
