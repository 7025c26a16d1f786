"""The torch engine against transformers: greedy tokens, logprobs, entropies, stops, weight updates, sampling."""

from __future__ import annotations

import pytest
import torch

from rapo_ray.engines import SamplingParams
from rapo_ray.engines.torch_engine import TorchEngine, batch_bucket, sample_tokens
from rapo_ray.model.factory import load_model
from tests.engine_checks import (
    check_engine_against_hf,
    check_load_weights,
    check_stops,
    check_submit,
    hf_greedy,
    teacher_forced,
)


def test_torch_engine_matches_hf(tiny_model_dir, tiny_tokenizer, prompts):
    model = load_model(tiny_model_dir)
    engine = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=4)
    check_engine_against_hf(engine, model, prompts, exact_entropy=True)
    check_stops(engine, prompts, tiny_tokenizer)
    check_load_weights(engine, load_model(tiny_model_dir), prompts)


def test_torch_engine_sampling_is_seeded_and_valid(tiny_model_dir, tiny_tokenizer, prompts):
    engine = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=6, seed=3)
    a = [r.token_ids for r in engine.generate(prompts, sp)]
    b = [r.token_ids for r in engine.generate(prompts, sp)]
    assert a == b
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], sp)
    with pytest.raises(KeyError, match="unknown parameter"):
        engine.load_weights({"nope": torch.zeros(1)}, 1)
    check_submit(engine, prompts)


def test_torch_engine_continuous_batching_matches_solo_runs(tiny_model_dir, tiny_tokenizer, prompts):
    """Two slots for eight requests of different lengths: requests are admitted as others finish, the cache
    slots are compacted, duplicates share a prefill, and every result equals the request run alone."""
    model = load_model(tiny_model_dir)
    # a 64-position cache that must grow during generation, then slots move: both inside inference mode
    engine = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=2, kv_initial_capacity=64)
    assert engine.continuous_batching
    batch = prompts + prompts[:2]  # two duplicates
    params = [SamplingParams(temperature=0.0, max_new_tokens=3 + 2 * i, ignore_eos=True) for i in range(len(batch))]
    res = engine.generate(batch, params)
    assert engine.admitted_mid_decode >= len(batch) - 2 and engine.decoder.capacity > 64
    for prompt, sp, r in zip(batch, params, res):
        assert r.token_ids == hf_greedy(model, prompt, sp.max_new_tokens)
        logp, ent = teacher_forced(model, prompt, r.token_ids)
        assert torch.allclose(torch.tensor(r.logprobs), logp, atol=1e-4)
        assert torch.allclose(torch.tensor(r.entropies), ent, atol=1e-4)


def test_torch_engine_frees_its_kv_cache_between_rollouts_and_rebuilds_it_at_its_size(
    tiny_model_dir, tiny_tokenizer, prompts
):
    """Colocated mode (issue #65): between rollouts the engine gives its KV cache back to the device the learner
    shares, all of it; the next generation rebuilds it at the size it had and decodes the same tokens. Never while
    a request waits or runs."""
    engine = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=2, kv_initial_capacity=64)
    sp = SamplingParams(temperature=0.0, max_new_tokens=80, ignore_eos=True)  # grows the cache past 64
    first = [r.token_ids for r in engine.generate(prompts[:3], sp)]
    held, capacity = engine.decoder.cache_bytes(), engine.decoder.capacity
    assert capacity > 64
    engine._waiting.append(object())  # a request not yet admitted
    assert engine.release_memory() == 0 and engine.decoder.cache_bytes() == held
    engine._waiting.clear()
    assert engine.release_memory() == held > 0 and engine.decoder.cache_bytes() == 0
    short = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    engine.generate(prompts[:1], short)  # needs few positions: rebuilt at the old size all the same
    assert engine.decoder.capacity == capacity and engine.decoder.cache_bytes() == held
    assert [r.token_ids for r in engine.generate(prompts[:3], sp)] == first


def test_the_kv_cache_holds_the_slots_of_the_live_requests_not_of_max_batch_size(
    tiny_model_dir, tiny_tokenizer, prompts
):
    """64 slots allowed, 8 to start with: 3 requests keep 8; 12 at once grow it to 16 (the next doubling, 2x the
    memory) rather than 64, and a release brings back 16."""
    engine = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=64)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    engine.generate(prompts[:3], sp)
    per_slot = engine.decoder.cache_bytes() // 8
    assert engine.decoder.slots == 8 and engine.decoder.k[0].shape[0] == 8
    twelve = (prompts * 2)[:12]
    assert [r.token_ids for r in engine.generate(twelve, sp)] == [r.token_ids for r in engine.generate(twelve, sp)]
    assert engine.decoder.slots == 16 and engine.decoder.cache_bytes() == 16 * per_slot
    assert engine.release_memory() == 16 * per_slot
    engine.generate(prompts[:1], sp)
    assert engine.decoder.slots == 16


def test_batches_pad_to_powers_of_two_within_the_slots():
    assert [batch_bucket(n, 6) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 4, 6, 6]
    assert batch_bucket(33, 64) == 64 and batch_bucket(64, 64) == 64


@pytest.mark.parametrize("max_batch_size", [4, 8])
def test_the_static_decode_step_decodes_what_generate_and_the_dynamic_step_do(
    tiny_model_dir, tiny_tokenizer, prompts, max_batch_size
):
    """Issue #65: the decode step at fixed shapes (padded batches, attention over the whole cache) that CUDA graphs
    replay, here eagerly on the CPU: greedy equals ``generate`` token for token, and every request's tokens and
    log-probs equal the dynamic step's, with requests joining mid-decode and the cache growing past 64."""
    model = load_model(tiny_model_dir)
    static = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=max_batch_size,
                         kv_initial_capacity=64, decode="static", kv_initial_slots=1)  # fmt: skip
    dynamic = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=max_batch_size,
                          kv_initial_capacity=64, decode="dynamic")  # fmt: skip
    assert (static.decode_form, dynamic.decode_form) == ("static", "dynamic")
    check_engine_against_hf(static, model, prompts, exact_entropy=True)
    params = [SamplingParams(temperature=0.0, max_new_tokens=20 + 13 * i, ignore_eos=True) for i in range(6)]
    got, want = static.generate(prompts, params), dynamic.generate(prompts, params)
    assert static.decoder.capacity > 64 and static.admitted_mid_decode == dynamic.admitted_mid_decode
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=5, ignore_eos=True)
    assert [r.token_ids for r in static.generate(prompts, sp)] == [r.token_ids for r in dynamic.generate(prompts, sp)]
    check_submit(static, prompts)


def test_cuda_graphs_are_refused_off_a_gpu_and_an_unknown_form_is_named(tiny_model_dir, tiny_tokenizer):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, decode="graphs")
    with pytest.raises(ValueError, match="decode='fast' is not one of"):
        TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, decode="fast")


def test_torch_engine_admits_requests_of_another_thread_mid_decode(tiny_model_dir, tiny_tokenizer, prompts):
    """Two requests join one that is decoding; the cache, one slot at first, grows to three with the first request's
    keys and values copied in place (its tokens still equal transformers' greedy ones)."""
    import threading

    model = load_model(tiny_model_dir)
    engine = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=8, kv_initial_slots=1)
    long_sp = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)
    short_sp = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("long", engine.generate(prompts[:1], long_sp)))
    t.start()
    while engine.decode_steps < 5 and t.is_alive():  # wait until the long request is decoding
        pass
    out["short"] = engine.generate(prompts[1:3], short_sp)
    t.join()
    assert engine.admitted_mid_decode >= 2 and engine.decoder.slots == 3
    assert out["long"][0].token_ids == hf_greedy(model, prompts[0], 300)
    for prompt, r in zip(prompts[1:3], out["short"]):
        assert r.token_ids == hf_greedy(model, prompt, 5)


def test_torch_engine_failed_step_fails_its_requests_and_engine_recovers(
    tiny_model_dir, tiny_tokenizer, prompts, monkeypatch
):
    engine = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=2)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    good = engine.generate(prompts[:3], sp)
    real_prefill, calls = engine.decoder.prefill, []

    def flaky(first, chunk):
        calls.append(first)
        if len(calls) == 2:  # the second admission (mid-decode) fails
            raise MemoryError("no room for the KV cache")
        return real_prefill(first, chunk)

    monkeypatch.setattr(engine.decoder, "prefill", flaky)
    with pytest.raises(RuntimeError, match="generation failed: MemoryError: no room for the KV cache"):
        engine.generate(prompts[:3], sp)
    assert engine._live == [] and not engine._waiting  # nothing left holding a slot
    assert [r.token_ids for r in engine.generate(prompts[:3], sp)] == [r.token_ids for r in good]


def test_torch_engine_window_limits(tiny_model_dir, tiny_tokenizer, prompts):
    engine = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer)
    window = engine.decoder.max_positions
    with pytest.raises(ValueError, match=f"prompt 1 has {window} tokens; the model's window is {window}"):
        engine.generate([prompts[0], [5] * window], SamplingParams(temperature=0.0))
    r = engine.generate([[5] * (window - 3)], SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True))[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 4  # positions window-3 .. window-1, then full


def test_torch_engine_generic_path_for_other_architectures(tiny_tokenizer, prompts):
    """A model the slot decoder does not know (GPT-2 here) runs through the padded HF-cache path."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=len(tiny_tokenizer),
        n_positions=256,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=tiny_tokenizer.bos_token_id,
        eos_token_id=tiny_tokenizer.eos_token_id,
    )
    model = GPT2LMHeadModel(cfg).eval()
    engine = TorchEngine(GPT2LMHeadModel(cfg).eval(), tiny_tokenizer, max_batch_size=4)
    engine.model.load_state_dict(model.state_dict())
    assert not engine.continuous_batching and "gpt2" in engine.fallback_reason
    check_engine_against_hf(engine, model, prompts, exact_entropy=True)


def test_sample_tokens_hand_computed():
    """Row 0 greedy (temperature 0); row 1 top-p 0.5 keeps only its 0.98-probability token; row 2 samples
    from two equal logits with the generator's stream (seeded: repeatable)."""
    logits = torch.tensor([[0.0, 10.0, 0.0], [5.0, 0.0, 1.0], [3.0, 3.0, -50.0]])
    temps, top_ps = torch.tensor([0.0, 1.0, 1.0]), torch.tensor([1.0, 0.5, 1.0])
    draws = [sample_tokens(logits, temps, top_ps, torch.Generator().manual_seed(s)).tolist() for s in range(20)]
    assert all(d[:2] == [1, 0] for d in draws)
    assert {d[2] for d in draws} == {0, 1}
    assert draws[3] == sample_tokens(logits, temps, top_ps, torch.Generator().manual_seed(3)).tolist()
    greedy = sample_tokens(logits, torch.zeros(3), torch.ones(3), torch.Generator())
    assert greedy.tolist() == [1, 0, 0]  # argmax; the tie in row 2 goes to the first index


def test_sample_tokens_refuses_tensors_on_another_device():
    """On a GPU the per-row temperatures and the generator must live with the logits (the bug a H100 found:
    both were CPU-built). The meta device stands in for the GPU here."""
    logits = torch.zeros((2, 3), device="meta")
    temps, top_ps = torch.ones(2, device="meta"), torch.ones(2, device="meta")
    with pytest.raises(ValueError, match="generator is on cpu, the logits on meta"):
        sample_tokens(logits, temps, top_ps, torch.Generator())
    with pytest.raises(ValueError, match="temps is on cpu, the logits on meta"):
        sample_tokens(logits, torch.ones(2), top_ps, torch.Generator())


def test_torch_engine_creates_every_tensor_on_the_model_device(tiny_model_dir, tiny_tokenizer, prompts):
    """Device stand-in: the model sits on the CPU while torch's default device is ``meta``, so any tensor an
    engine step makes without naming its device lands on meta and the step fails on mixing the two (what
    happened on CUDA). Slot path and generic path, greedy, seeded and unseeded sampling."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tiny_tokenizer), n_positions=256, n_embd=32, n_layer=2, n_head=2))
    engines = [
        TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=2),
        TorchEngine(gpt2.eval(), tiny_tokenizer),
    ]
    assert engines[0].continuous_batching and not engines[1].continuous_batching
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=5, ignore_eos=True, seed=1),
        SamplingParams(temperature=0.7, max_new_tokens=5, ignore_eos=True),
    ]
    for engine in engines:
        assert engine.device == torch.device("cpu")
        expected = [[r.token_ids for r in engine.generate(prompts, sp)] for sp in params[:2]]
        with torch.device("meta"):
            got = [[r.token_ids for r in engine.generate(prompts, sp)] for sp in params]
        assert got[:2] == expected and all(len(t) == 5 for t in got[2])


def test_torch_engine_device_is_the_parameters_device(tiny_model_dir, tiny_tokenizer, prompts):
    """A device named without its index (``cuda``) is kept as the parameters' own (``cuda:0``): sampling compares
    the generator's device with the logits', and ``torch.device("cuda") != torch.device("cuda:0")`` failed every
    sampled rollout on an H200. ``cpu:0`` is the CPU's spelling of the same case."""
    engine = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, device="cpu:0")
    assert engine.device == next(engine.model.parameters()).device == torch.device("cpu")
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=4, ignore_eos=True, seed=2)
    assert all(len(r.token_ids) == 4 for r in engine.generate(prompts, sp))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_engine_samples_on_cuda(tiny_model_dir, tiny_tokenizer, prompts):
    engine = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, device="cuda")
    assert engine.device == torch.device("cuda", torch.cuda.current_device())
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=4, ignore_eos=True, seed=2)
    a = [r.token_ids for r in engine.generate(prompts, sp)]
    assert a == [r.token_ids for r in engine.generate(prompts, sp)] and all(len(t) == 4 for t in a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_equals_generate_and_the_dynamic_step(tiny_model_dir, tiny_tokenizer, prompts):
    """The decode step replayed as CUDA graphs (``decode='graphs'``, the default on CUDA): greedy equals
    ``generate`` in fp32, tokens equal the dynamic step's through a cache that grows (graphs captured again) and
    through a release of the cache (colocated mode), and the live requests' cache survives each capture."""
    model = load_model(tiny_model_dir).to("cuda")
    graphs = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, device="cuda", max_batch_size=4,
                         kv_initial_capacity=64)  # fmt: skip
    dynamic = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer, device="cuda", max_batch_size=4,
                          kv_initial_capacity=64, decode="dynamic")  # fmt: skip
    assert graphs.decode_form == "graphs"
    greedy = graphs.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    for prompt, r in zip(prompts, greedy):
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert r.token_ids == out[0, len(prompt) :].tolist()
    params = [SamplingParams(temperature=0.0, max_new_tokens=20 + 13 * i, ignore_eos=True) for i in range(6)]
    for _ in range(2):
        got, want = graphs.generate(prompts, params), dynamic.generate(prompts, params)
        assert [g.token_ids for g in got] == [w.token_ids for w in want] and graphs.decoder.capacity > 64
        assert graphs.release_memory() > 0


def test_simulated_engine_models_a_batched_decode(tiny_tokenizer, monkeypatch):
    from rapo_ray.engines import simulated
    from rapo_ray.engines.simulated import SimulatedEngine

    slept = []
    monkeypatch.setattr(simulated.time, "sleep", slept.append)
    engine = SimulatedEngine(tiny_tokenizer, token_ms=10.0, min_tokens=3, max_tokens=9, seed=0)
    params = [SamplingParams(max_new_tokens=5), SamplingParams(max_new_tokens=64), SamplingParams(max_new_tokens=64)]
    out = engine.generate([[1, 2]] * 3, params)
    lengths = [len(r.token_ids) for r in out]
    assert lengths[0] <= 5 and all(3 <= n <= 9 for n in lengths)  # sampled in [3, 9], capped by max_new_tokens
    assert [r.finish_reason for r in out] == [
        "length" if n == p.max_new_tokens else "stop" for n, p in zip(lengths, params)
    ]
    assert slept == [pytest.approx(max(lengths) * 0.010)]  # the batch lasts its longest sequence
    assert engine.decoded_tokens == sum(lengths) and all(r.logprobs == [0.0] * len(r.token_ids) for r in out)
    # the filler closes no tag: the agent loop ends the trajectory at it
    assert "<" not in tiny_tokenizer.decode(out[1].token_ids)
    engine.load_weights({}, 7)
    assert engine.version == 7
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        SimulatedEngine(tiny_tokenizer, token_ms=1.0, min_tokens=5, max_tokens=4)


def test_vllm_loggers_take_the_environments_level_before_vllm_is_imported(monkeypatch):
    """VLLM_LOGGING_LEVEL reaches the 'vllm' logger without importing vLLM; an unknown level leaves it alone."""
    import logging

    from rapo_ray.engines.vllm_engine import apply_vllm_log_level

    logger = logging.getLogger("vllm")
    before = logger.level
    try:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "error")
        apply_vllm_log_level()
        assert logger.level == logging.ERROR
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "loud")
        apply_vllm_log_level()
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(before)
