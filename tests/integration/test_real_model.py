"""SmolLM2-135M-Instruct, the packaged real model: its conversion, the agent loop on its BPE tokenizer (tags are
several tokens), and the engine and the learner agreeing on the log-probs of the tokens the engine sampled."""

from __future__ import annotations

import json

import torch

from rapo_ray.agent.loop import AgentLoop
from rapo_ray.agent.retriever import InMemoryStepRetriever, StoredStep
from rapo_ray.algos.loss import target_logprobs
from rapo_ray.algos.rapo import HybridRollout
from rapo_ray.core.files import file_sha256
from rapo_ray.engines.base import GenerationResult, InferenceEngine, SamplingParams
from rapo_ray.engines.torch_engine import TorchEngine
from rapo_ray.model.factory import load_model, load_tokenizer
from rapo_ray.model.gguf import ensure_converted, packaged_gguf
from rapo_ray.types import protocol
from rapo_ray.types.trajectory import GENERATED, RETRIEVED, TOOL_RESULT, Task
from tests.helpers import settings


def test_the_conversion_is_cached_by_the_gguf_fingerprint(smollm2_dir):
    record = json.loads((smollm2_dir / "converted_from.json").read_text())
    gguf = packaged_gguf("smollm2-135m-instruct")
    assert record["sha256"] == file_sha256(gguf) and smollm2_dir.name.endswith(record["sha256"][:12])
    assert record["parameters"] == 134_515_008
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_converted(gguf, smollm2_dir.parents[1], "smollm2-135m-instruct") == smollm2_dir
    assert weights.stat().st_mtime_ns == before  # reused, not converted again
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30


class ScriptEngine(InferenceEngine):
    """Emits the token ids of pre-written steps, in order, and records them."""

    name = "script"

    def __init__(self, tok, steps):
        super().__init__()
        self.tok, self.steps, self.produced = tok, steps, []

    def load_weights(self, sd, v):
        self.version = v

    def generate(self, prompts, params):
        out = []
        for _ in prompts:
            text = self.steps[len(self.produced)] if len(self.produced) < len(self.steps) else "<|im_end|>"
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            self.produced.append(ids)
            out.append(GenerationResult(ids, [-0.5] * len(ids), [1.0] * len(ids), "stop", None))
        return out


def test_the_loop_on_a_real_bpe_tokenizer_keeps_tokens_as_sampled(smollm2_dir, tools):
    """Tags are 3 tokens here ('</', 'python', '>'), and BPE merges across a tag's end: the first step ends in the
    single token '>.' after '</python'. The loop must still see the call, and every appended segment must be the
    ids that were produced or tokenized once: never a re-tokenization of decoded text."""
    tok = load_tokenizer(smollm2_dir)
    steps = [
        "<think>6 times 7</think><python>print(6*7)</python>.",
        "<think>the tool says 42</think><answer>\\boxed{42}</answer>",
    ]
    assert [tok.decode([i]) for i in tok(steps[0], add_special_tokens=False)["input_ids"][-3:]] == [
        "</",
        "python",
        ">.",
    ]
    value = "<think>multiply</think><python>print(2*3)</python><result>6</result>"
    stored = StoredStep("q", value, tok(value, add_special_tokens=False)["input_ids"], question_id="other")
    engine = ScriptEngine(tok, steps)
    s = settings(system_prompt=protocol.SYSTEM_PROMPT, max_response_tokens=400)
    loop = AgentLoop(
        engine, tok, tools, s, retriever=InMemoryStepRetriever([stored]), rollout=HybridRollout(1, retrieve_prob=1.0)
    )
    (t,), _ = loop.run_groups([Task("q", "What is 6*7?", ("42",), "math")], 1)
    # the prompt is the model's chat template around the paper's system prompt
    prompt = tok.decode(t.prompt_ids.tolist())
    assert prompt.startswith("<|im_start|>system\n" + protocol.SYSTEM_PROMPT) and prompt.endswith(
        "<|im_start|>assistant\n"
    )
    assert t.finish_reason == "answer" and t.tool_calls == 1 and t.correct and t.reward > 0
    kinds = [k for k, _, _ in t.segments]
    assert kinds == [GENERATED, TOOL_RESULT, RETRIEVED, GENERATED]
    segs = {k: [] for k in (GENERATED, TOOL_RESULT, RETRIEVED)}
    for kind, a, b in t.segments:
        segs[kind].append(t.response_ids[a:b].tolist())
        assert set(t.loss_mask[a:b].tolist()) == {1 if kind == GENERATED else 0}
    assert segs[GENERATED] == engine.produced  # exactly the sampled ids
    assert tok.decode(segs[TOOL_RESULT][0]) == "<result>42</result>"
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert segs[RETRIEVED][0] == enc("<retrieve>") + stored.value_ids + enc("</retrieve>")
    assert len(t.response_ids) == len(t.logprobs) == len(t.token_entropies) == len(t.loss_mask)


def test_the_torch_engine_stops_inside_a_merged_last_token(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    engine = TorchEngine(load_model(smollm2_dir), tok)
    ids = tok("print(1)</python>.", add_special_tokens=False)["input_ids"]
    assert engine._stop_reason(ids, SamplingParams(stop_strings=["</python>"])) == "</python>"
    assert engine._stop_reason(ids[:-1], SamplingParams(stop_strings=["</python>"])) is None


def test_engine_and_learner_log_probs_agree_on_the_real_model(smollm2_dir):
    """The torch engine samples (T=1) and reports log pi of each token; the learner's function recomputes them
    from the same weights on the whole sequence. In fp32 on a CPU the gap is numerical only."""
    tok = load_tokenizer(smollm2_dir)
    model = load_model(smollm2_dir)
    engine = TorchEngine(model, tok)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in ("What is 17 + 25?", "Name a prime number.")
    ]
    results = engine.generate(prompts, [SamplingParams(temperature=1.0, max_new_tokens=24, seed=s) for s in (1, 2)])
    gaps = []
    for prompt, res in zip(prompts, results):
        ids = torch.tensor([list(prompt) + list(res.token_ids)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1].float()
        learner = target_logprobs(logits, ids)[0, len(prompt) - 1 :]
        gaps.append((learner - torch.tensor(res.logprobs)).abs())
    gap = torch.cat(gaps)
    assert gap.numel() >= 2 and float(gap.max()) < 1e-3, f"mean {float(gap.mean()):.2e} max {float(gap.max()):.2e}"
