"""The vLLM engine against transformers (skipped where vLLM does not import)."""

from __future__ import annotations

import torch

from rapo_ray.engines import SamplingParams
from rapo_ray.model.factory import load_model
from tests.engine_checks import check_engine_against_hf, check_load_weights, check_stops, check_submit


def test_vllm_engine_matches_hf(tiny_model_dir, tiny_tokenizer, prompts):
    from rapo_ray.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, max_model_len=512, kv_cache_gb=0.25)
    try:
        model = load_model(tiny_model_dir)
        check_engine_against_hf(engine, model, prompts, exact_entropy=False)
        check_stops(engine, prompts, tiny_tokenizer)
        check_submit(engine, prompts)
        assert engine.in_process  # the received tensors go straight to the model runner
        check_load_weights(engine, model, prompts)
        # the same weights again through a safetensors file in /dev/shm (an engine core in another process)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        direct = engine.generate(prompts, greedy)
        engine.in_process = False
        engine.load_weights({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, version=8)
        via_file = engine.generate(prompts, greedy)
        assert engine.version == 8 and [r.token_ids for r in via_file] == [r.token_ids for r in direct]
        assert all(
            torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6)
            for a, b in zip(direct, via_file)
        )
        assert not list(engine._shm.iterdir())
    finally:
        engine.close()
