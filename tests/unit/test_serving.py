"""Serving without Ray: the OpenAI wire format, cross-request batching, checkpoints, the serve config."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from rapo_ray.config import load_config
from rapo_ray.core.errors import ConfigError
from rapo_ray.engines.base import GenerationResult, InferenceEngine, SamplingParams
from rapo_ray.serving.batching import BatchingEngine
from rapo_ray.serving.chat import BadRequest, answer_of, parse_chat_request, tool_trace

SERVE_CFG = load_config(
    overrides=[
        "serve.max_tokens=64",
        "serve.default_max_tokens=32",
        "serve.max_request_chars=200",
        "serve.max_tool_calls=3",
    ]
).serve


def _user(text="What is 6*7?"):
    return [{"role": "user", "content": text}]


class _EchoEngine(InferenceEngine):
    """Returns [len(prompt), first token] per prompt; records each call's batch size."""

    def __init__(self, fail_on: int | None = None):
        super().__init__()
        self.batches, self.fail_on = [], fail_on

    def generate(self, prompts, params):
        time.sleep(0.05)  # a busy engine, so concurrent callers pile up behind it
        self.batches.append(len(prompts))
        if self.fail_on is not None and any(p[0] == self.fail_on for p in prompts):
            raise RuntimeError("engine failure")
        return [GenerationResult([len(p), p[0]], [0.0, 0.0], [0.0, 0.0], "stop") for p in prompts]

    def load_weights(self, state_dict, version):
        self.version = version


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "'messages' is required"),
        ([1], "must be a JSON object"),
        ({"messages": "hi"}, "'messages' must be a non-empty list"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": ["hi"]}, "messages[0] must be an object"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be one of"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be a string"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
        (
            {"messages": _user() + [{"role": "system", "content": "x"}]},
            "messages[1]: a system message is only allowed first",
        ),
        ({"messages": _user() + [{"role": "assistant", "content": "x"}]}, "the last message must be from the user"),
        ({"messages": _user("x" * 201)}, "hold 201 characters; the limit is 200"),
        ({"messages": _user(), "max_tokens": 65}, "'max_tokens' must be in [1, 64], got 65"),
        ({"messages": _user(), "max_tokens": "10"}, "'max_tokens' must be an integer, got str"),
        ({"messages": _user(), "temperature": 3}, "'temperature' must be in [0, 2], got 3"),
        ({"messages": _user(), "temperature": True}, "'temperature' must be a number, got bool"),
        ({"messages": _user(), "n": 2}, "'n' must be 1"),
        ({"messages": _user(), "stream": "yes"}, "'stream' must be a boolean"),
        ({"messages": _user(), "model": "gpt-4"}, "unknown model 'gpt-4'; this server serves 'agent'"),
        ({"messages": _user(), "max_tool_calls": 4}, "'max_tool_calls' must be in [0, 3], got 4"),
        ({"messages": _user(), "tools": [{"type": "function"}]}, "'tools' is not supported"),
        ({"messages": _user(), "stop": ["\n"]}, "'stop' is not supported"),
        ({"messages": _user(), "frequency_penalty": 0.5}, "'frequency_penalty' is not supported"),
        ({"messages": _user(), "foo": 1}, "unknown fields ['foo']"),
    ],
)
def test_bad_requests_name_the_field(body, message):
    with pytest.raises(BadRequest) as err:
        parse_chat_request(body, SERVE_CFG, "agent")
    assert message in str(err.value)


def test_fuzzed_request_bodies_are_accepted_or_get_a_400_naming_the_problem():
    """Random JSON shapes and strings (lone surrogates, control characters, huge numbers) in every field: the
    parser accepts a body whose text the tokenizer can encode, or raises ``BadRequest`` with a message the HTTP
    layer can encode; nothing else."""
    import json
    import random

    rng = random.Random(0)
    alphabet = ["a", "é", "\u2028", "\x00", "\ud800", "\udfff", "\U0001f600", "<python>", '"', "\\"]

    def value(depth: int = 0):
        kind = rng.randrange(9 if depth < 3 else 6)
        if kind == 0:
            return "".join(rng.choice(alphabet) for _ in range(rng.randrange(6)))
        if kind == 1:
            return rng.choice([0, 1, -1, 2**70, 64, 10**9])
        if kind == 2:
            return rng.choice([0.5, -1e308, float("inf"), float("nan")])
        if kind == 3:
            return rng.choice([True, False, None])
        if kind == 4:
            return {"role": rng.choice(["user", "system", "assistant", "tool", value(3)]), "content": value(depth + 1)}
        if kind == 5:
            return {"type": "text", "text": value(3)}
        if kind == 6:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(FIELDS): value(depth + 1) for _ in range(rng.randrange(4))}

    FIELDS = [
        "messages",
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "stream",
        "stream_options",
        "n",
        "seed",
        "max_tool_calls",
        "tools",
        "stop",
        "user",
        "role",
        "content",
        "\ud800",
    ]
    outcomes = {"accepted": 0, "400": 0}
    for _ in range(3000):
        body = {f: value() for f in rng.sample(FIELDS, rng.randrange(1, 5))}
        if rng.random() < 0.7:
            body["messages"] = [{"role": "user", "content": value(2)}] if rng.random() < 0.5 else value(1)
        try:
            req = parse_chat_request(body, SERVE_CFG, "agent")
            for m in req.messages:  # what the tokenizer gets: it cannot encode a lone surrogate (was a bare 500)
                m["content"].encode("utf-8")
            outcomes["accepted"] += 1
        except BadRequest as exc:
            json.dumps({"message": str(exc)}, ensure_ascii=False).encode("utf-8")  # what the 400 response sends
            outcomes["400"] += 1
    assert outcomes["accepted"] > 0 and outcomes["400"] > 0, outcomes


def test_default_valued_and_bookkeeping_fields_are_accepted():
    req = parse_chat_request(
        {
            "messages": _user(),
            "frequency_penalty": 0,
            "stop": None,
            "logprobs": False,
            "user": "u1",
            "metadata": {"k": "v"},
        },
        SERVE_CFG,
        "agent",
    )
    assert req.messages == _user()


def test_request_defaults_and_text_parts():
    req = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_completion_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        SERVE_CFG,
        "agent",
    )
    assert req.messages[1] == {"role": "user", "content": "ab"} and req.max_tokens == 12
    assert (
        req.stream and req.include_usage and req.temperature == 1.0 and req.max_tool_calls == 3 and req.model == "agent"
    )
    assert parse_chat_request({"messages": _user()}, SERVE_CFG, "agent").max_tokens == SERVE_CFG.default_max_tokens


def test_answer_and_tool_trace_from_segments():
    segs = [
        ("generated", "<think>a</think><python>print(6*7)</python>"),
        ("tool_result", "<result>42</result>"),
        ("generated", "<think>b</think><search>x</python>"),
        ("tool_result", "<result>Error: bad</result>"),
        ("generated", "<think>c</think><answer>\\boxed{42}</answer>"),
    ]
    assert answer_of("".join(t for k, t in segs if k == "generated")) == "\\boxed{42}"
    assert answer_of("<think>no answer</think>") == "no answer"
    assert tool_trace(segs) == [
        {"tool": "python", "input": "print(6*7)", "output": "42"},
        {
            "tool": "python",
            "input": "malformed call: </python> closes <search> (mismatched tags)",
            "output": "Error: bad",
        },
    ]


def test_conversation_frame_matches_single_turn_prompt():
    from rapo_ray.types import protocol

    assert protocol.render_conversation(_user("q"), "s") == protocol.render_prompt("q", "s")
    two = protocol.render_conversation(_user("q1") + [{"role": "assistant", "content": "a1"}] + _user("q2"), "s")
    assert two == "<|bos|><|system|>s<|user|>q1<|assistant|>a1<|eos|><|user|>q2<|assistant|>"


def test_batching_engine_merges_concurrent_calls_and_routes_results():
    inner = _EchoEngine()
    eng = BatchingEngine(inner, max_batch_size=64, wait_ms=20)
    out = {}

    def call(i):
        out[i] = eng.generate([[i] * (i + 1), [100 + i]], SamplingParams(max_new_tokens=2))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: [r.token_ids for r in res] for i, res in out.items()} == {
        i: [[i + 1, i], [1, 100 + i]] for i in range(16)
    }
    assert sum(inner.batches) == 32 and len(inner.batches) < 16  # fewer engine calls than conversations
    assert eng.engine_calls == len(inner.batches) and eng.prompts_served == 32
    eng.load_weights({}, 7)
    assert eng.version == 7
    eng.close()


def test_batching_engine_error_reaches_callers_and_batcher_survives():
    eng = BatchingEngine(_EchoEngine(fail_on=13), wait_ms=1)
    with pytest.raises(RuntimeError, match="engine failure"):
        eng.generate([[13]], SamplingParams())
    assert eng.generate([[5]], SamplingParams())[0].token_ids == [1, 5]
    eng.close()


def test_batching_engine_passes_through_to_a_continuous_engine(tiny_model_dir, tiny_tokenizer):
    """Conversations call the torch engine directly from their threads; their turns share decode steps."""
    from rapo_ray.engines.torch_engine import TorchEngine
    from rapo_ray.model.factory import load_model

    inner = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer)
    eng = BatchingEngine(inner, max_batch_size=64, wait_ms=20)
    assert eng.passthrough and eng.alive
    prompts = [[tiny_tokenizer.bos_token_id or 1, 10 + i, 20 + i] for i in range(8)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    solo = [r.token_ids for r in TorchEngine(load_model(tiny_model_dir), tiny_tokenizer).generate(prompts, sp)]
    out = {}
    threads = [
        threading.Thread(target=lambda i=i: out.setdefault(i, eng.generate([prompts[i]], sp)[0].token_ids))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(8)] == solo
    stats = eng.stats()
    assert stats["engine_calls"] == 8 and stats["prompts"] == 8
    assert stats["decode_rows"] / stats["decode_steps"] > 1  # turns of different conversations shared steps
    eng.load_weights(load_model(tiny_model_dir).state_dict(), 3)
    assert eng.version == 3
    eng.close()
    assert not eng.alive


def test_resolve_checkpoint(tmp_path, tiny_model_dir):
    import shutil

    from rapo_ray.core.errors import ModelLoadError
    from rapo_ray.model.factory import resolve_checkpoint

    assert resolve_checkpoint(tiny_model_dir) == Path(tiny_model_dir)
    run = tmp_path / "runs" / "rapo-1"
    for step in ("step-000010", "step-000020"):
        shutil.copytree(tiny_model_dir, run / "checkpoints" / step)
        (run / "checkpoints" / step / "COMPLETE").write_text("ok\n")
        time.sleep(0.01)
    shutil.copytree(tiny_model_dir, run / "checkpoints" / "step-000030")  # being written: no marker
    assert resolve_checkpoint(run).name == "step-000020"
    assert resolve_checkpoint(tmp_path / "runs").name == "step-000020"
    with pytest.raises(ModelLoadError, match="incomplete"):
        resolve_checkpoint(run / "checkpoints" / "step-000030")
    with pytest.raises(ModelLoadError, match="no such directory"):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path / "empty")


def test_serve_config_file_validates_and_builds(tiny_model_dir):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from rapo_ray.serving.app import app_builder

    data = yaml.safe_load((Path(__file__).parents[2] / "configs" / "serve" / "agent.yaml").read_text())
    schema = ServeDeploySchema.parse_obj(data)
    app_cfg = schema.applications[0]
    assert app_cfg.import_path == "rapo_ray.serving.app:app_builder" and data["http_options"]["host"] == "127.0.0.1"
    args = dict(app_cfg.args, checkpoint=str(tiny_model_dir))
    app = app_builder(args)
    assert type(app).__name__ == "Application"
    with pytest.raises(ConfigError, match="'checkpoint' is required"):
        app_builder({})
    with pytest.raises(ConfigError, match="serve.nope"):
        app_builder({"checkpoint": str(tiny_model_dir), "serve.nope": 1})
