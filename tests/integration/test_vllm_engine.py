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


def test_a_job_engine_start_keeps_vllm_and_torch_notices_off_the_console(tiny_model_dir):
    """With the environment a job gives its workers (launcher.QUIET_ENV), building an engine on a CPU prints neither
    vLLM's import-time Triton notice (before vLLM configures its logging) nor torch's C++ NUMA-binding warning."""
    import os
    import subprocess
    import sys

    from rapo_ray.launch.launcher import QUIET_ENV

    code = (
        "from rapo_ray.engines.vllm_engine import VLLMEngine\n"
        f"VLLMEngine({str(tiny_model_dir)!r}, max_model_len=256, kv_cache_gb=0.25).close()\n"
        "print('engine closed')\n"
    )
    env = os.environ | QUIET_ENV
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "engine closed" in done.stdout, done.stderr[-2000:]
    assert "Triton is installed" not in done.stderr and "NUMA binding" not in done.stderr, done.stderr[-2000:]


def test_seeded_sampling_survives_more_waiting_prompt_tokens_than_one_engine_step_takes(tiny_model_dir):
    """40 prompts of 200 tokens wait at once (8,000 tokens, past vLLM-CPU's 4,096-token step): with chunked prefill
    vLLM 0.32 rewound a cut prompt's seeded generator, which a CPU generator refuses, and the engine died. Each
    request also gets its own seed's tokens: the same as when it runs alone."""
    from rapo_ray.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, max_model_len=512, kv_cache_gb=0.25)
    try:
        prompts = [[(i * 7 + j) % 300 + 5 for j in range(200)] for i in range(40)]
        params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=i) for i in range(40)]
        results = [f.result() for f in [engine.submit(p, sp) for p, sp in zip(prompts, params)]]
        assert [len(r.token_ids) for r in results] == [6] * 40
        assert engine.generate([prompts[7]], params[7])[0].token_ids == results[7].token_ids
    finally:
        engine.close()
