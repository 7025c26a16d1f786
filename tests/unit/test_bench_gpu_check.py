"""benchmarks/gpu_check.py's inputs: the learner shapes and the model it checks (a config-only folder is given
random weights; a folder with weights is used as it is)."""

from __future__ import annotations

import argparse

import pytest

from rapo_ray.model.factory import has_weights, load_model
from tests.helpers import benchmark_module


def test_learner_shape_parses_and_bad_ones_are_named():
    gc = benchmark_module("gpu_check")
    assert gc.parse_learner_shape("8x640/2") == (8, 640, 2)
    for bad in ("8x640", "8-640/2", "0x640/2", "8x1/1", "axb/c"):
        with pytest.raises(SystemExit, match=f"--learner-shape '{bad}'"):
            gc.parse_learner_shape(bad)


def test_a_folder_without_weights_gets_seeded_random_ones_once(tiny_model_dir, tmp_path):
    gc = benchmark_module("gpu_check")
    source = tmp_path / "config-only"
    source.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            (source / f.name).write_bytes(f.read_bytes())
    assert not has_weights(source)
    args = argparse.Namespace(preset="", model_dir=str(source), artifacts=str(tmp_path / "art"), size="")
    path, name, weights = gc.resolve_model(args, "cpu")
    assert (name, weights) == ("config-only", "random init from config") and has_weights(path)
    first = load_model(path).state_dict()
    assert gc.resolve_model(args, "cpu")[0] == path  # built once, then reused
    rebuilt = load_model(gc.random_init_dir(source, tmp_path / "art2")).state_dict()
    assert all((first[k] == rebuilt[k]).all() for k in first)  # seeded: the same weights wherever built
    assert load_model(tiny_model_dir).config.hidden_size == load_model(path).config.hidden_size

    args.model_dir = str(tiny_model_dir)
    assert gc.resolve_model(args, "cpu") == (tiny_model_dir, tiny_model_dir.name, "trained")
    args.model_dir = str(tmp_path / "missing")
    with pytest.raises(SystemExit, match="needs config.json and tokenizer.json"):
        gc.resolve_model(args, "cpu")
