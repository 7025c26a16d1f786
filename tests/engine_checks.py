"""Checks that every inference engine must pass against transformers (the torch engine's tests and vLLM's)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from rapo_ray.algos.entropy import token_entropy_from_logits
from rapo_ray.engines import SamplingParams


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def teacher_forced(model, prompt, generated):
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(generated)[:, None])[:, 0]
    return logp, token_entropy_from_logits(logits)


def check_engine_against_hf(engine, model, prompts, exact_entropy: bool):
    res = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for prompt, r in zip(prompts, res):
        assert r.token_ids == hf_greedy(model, prompt, 12)[: len(r.token_ids)]
        assert len(r.token_ids) == len(r.logprobs) == len(r.entropies)
        logp, ent = teacher_forced(model, prompt, r.token_ids)
        assert torch.allclose(torch.tensor(r.logprobs), logp, atol=1e-4)
        if exact_entropy:
            assert torch.allclose(torch.tensor(r.entropies), ent, atol=1e-4)
        else:
            assert r.entropy_is_estimate and all(e <= h + 1e-4 for e, h in zip(r.entropies, ent.tolist()))


def check_stops(engine, prompts, tokenizer):
    base = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=10))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    stop_tok = base.token_ids[3]
    first = base.token_ids.index(stop_tok)
    r = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[stop_tok]))[0]
    assert r.token_ids == base.token_ids[: first + 1] and r.finish_reason == "stop" and r.stop_reason == stop_tok
    # a stop string: the decoded text of the first 5 generated tokens' last token
    text = tokenizer.decode(base.token_ids[4:5], skip_special_tokens=False)
    r = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=10, stop_strings=[text]))[0]
    assert r.finish_reason == "stop" and len(r.token_ids) <= 5
    assert tokenizer.decode(r.token_ids, skip_special_tokens=False).endswith(text)


def check_submit(engine, prompts):
    """Requests submitted one by one, a second wave while the first decodes (a trajectory's next turn
    joining a running batch), give what one batched ``generate`` gives, in submission order."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    expected = engine.generate(prompts, greedy)
    first = [engine.submit(p, greedy) for p in prompts[:3]]
    second = [engine.submit(p, greedy) for p in prompts[3:]]
    got = [f.result(timeout=120) for f in first + second]
    # and ``generate`` from several threads at once (serving's callers), each getting its own results
    with ThreadPoolExecutor(3) as pool:
        threaded = list(pool.map(lambda p: engine.generate([p], greedy)[0], prompts))
    for e, g in zip(expected + expected, got + threaded):
        assert g.token_ids == e.token_ids and len(g.token_ids) == 40
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-4)
    assert engine.continuous_batching


def check_load_weights(engine, model, prompts):
    before = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    torch.manual_seed(1)
    new_sd = {k: v + 0.5 * torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(new_sd)
    sent = model.state_dict()
    if model.config.tie_word_embeddings:  # as the weight sync sends a tied model: without the aliased lm_head
        sent.pop("lm_head.weight")
    engine.load_weights(sent, version=7)
    assert engine.version == 7
    after = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    for prompt, r in zip(prompts, after):  # the engine now computes the updated model exactly
        logp, _ = teacher_forced(model, prompt, r.token_ids)
        assert torch.allclose(torch.tensor(r.logprobs), logp, atol=1e-4)
