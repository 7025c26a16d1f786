"""Model and tokenizer loading and saving (rapo_ray/model)."""

from __future__ import annotations

import pytest
import torch

from rapo_ray.core.errors import ModelLoadError
from rapo_ray.envs import tasks
from rapo_ray.model.factory import load_model, load_tokenizer, save_model
from rapo_ray.types import protocol


def test_protocol_tags_are_single_tokens(tiny_tokenizer):
    for tag in protocol.SPECIAL_TOKENS:
        ids = tiny_tokenizer(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, tag


def test_tokenizer_round_trip_keeps_ids(tiny_tokenizer, tmp_path):
    prob = tasks.generate("multihop", "train", 1, 0)[0]
    text = protocol.render_prompt(prob.question) + tasks.expert_text(prob)
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text
    tiny_tokenizer.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert (again.pad_token_id, again.eos_token_id) == (tiny_tokenizer.pad_token_id, tiny_tokenizer.eos_token_id)


def test_model_save_load_exact(tiny_model_dir, tiny_tokenizer, tmp_path):
    model = load_model(tiny_model_dir)
    out = save_model(model, tiny_tokenizer, tmp_path / "copy")
    again = load_model(out)
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "copy.tmp").exists()


def test_missing_and_corrupt_folders(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path / "empty")
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "qwen2"}')
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match=r"cannot load model from .*bad"):
        load_model(bad)


def test_model_path_must_be_a_model(tmp_path):
    from rapo_ray.config import load_config
    from rapo_ray.model.factory import resolve_model_dir

    cfg = load_config(overrides=[f"model.path={tmp_path}"])
    with pytest.raises(ModelLoadError, match="model.path=.*not an HF model folder"):
        resolve_model_dir(cfg)


def test_min_vocab_pads_the_embedding_to_a_real_models_rows():
    """model.min_vocab (set by the model.size presets): the embedding has the real model's rows, so its weights
    weigh what the real model's do; a tokenizer's own vocabulary larger than it wins."""
    from dataclasses import replace

    from rapo_ray.config import ModelConfig
    from rapo_ray.model.factory import build_model

    shape = replace(ModelConfig(), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
    padded = build_model(replace(shape, min_vocab=600), vocab_size=512, bos_id=1, eos_id=2, pad_id=0)
    assert padded.get_input_embeddings().weight.shape == (600, 16) and padded.config.vocab_size == 600
    assert build_model(replace(shape, min_vocab=300), 512, 1, 2, 0).config.vocab_size == 512
