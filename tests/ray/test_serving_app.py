"""The OpenAI-compatible serving app end to end on a local Ray Serve."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest


def _user(text="What is 6*7?"):
    return [{"role": "user", "content": text}]


HOSTILE_STEPS = [
    "<think>a</think><python>open('/etc/rapo_pwned', 'w').write('x')</python>",
    "<think>b</think><python>while True:\n    pass</python>",
    "<think>c</think><python>import os\nos.system('touch /tmp/rapo_pwned_shell')</python>",
    "<think>d</think><answer>\\boxed{survived}</answer>",
]


@pytest.fixture(scope="module")
def agent_apps(serve_url, tiny_cfg, tiny_model_dir):
    """Two apps: the tiny bundled model with auth on, and a scripted hostile agent without auth."""
    from ray import serve

    from rapo_ray.serving.app import build_agent_app

    cfg = replace(
        tiny_cfg,
        serve=replace(
            tiny_cfg.serve,
            api_key="sekret",
            model_name="tiny",
            max_tokens=64,
            default_max_tokens=32,
            max_step_tokens=16,
            max_prompt_tokens=256,
        ),
    )
    serve.run(build_agent_app(cfg, tiny_model_dir), name="agent_test", route_prefix="/agent")
    hostile = replace(
        tiny_cfg,
        rollout=replace(tiny_cfg.rollout, tool_timeout_s=1.0),
        serve=replace(
            tiny_cfg.serve,
            model_name="scripted",
            engine_factory="rapo_ray.engines.scripted:scripted_engine",
            engine_kwargs={"steps": HOSTILE_STEPS},
        ),
    )
    serve.run(build_agent_app(hostile, tiny_model_dir), name="scripted_test", route_prefix="/scripted")
    yield {"agent": f"{serve_url}/agent", "scripted": f"{serve_url}/scripted"}
    serve.delete("agent_test")
    serve.delete("scripted_test")


def test_chat_completion_and_streaming_round_trip(agent_apps):
    import openai

    client = openai.OpenAI(base_url=agent_apps["agent"] + "/v1", api_key="sekret", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    resp = client.chat.completions.create(model="tiny", messages=_user(), max_tokens=24, temperature=0.0)
    choice = resp.choices[0]
    assert (
        resp.object == "chat.completion"
        and choice.message.role == "assistant"
        and isinstance(choice.message.content, str)
    )
    assert choice.finish_reason in ("stop", "length")
    assert 0 < resp.usage.completion_tokens <= 24 and resp.usage.prompt_tokens > 0
    extra = choice.message.model_extra
    assert isinstance(extra["reasoning_content"], str) and isinstance(extra["tool_trace"], list)
    # Greedy decoding is deterministic: the stream carries the same reasoning and answer.
    stream = client.chat.completions.create(
        model="tiny",
        messages=_user(),
        max_tokens=24,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == extra["reasoning_content"] and content == choice.message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_bad_requests_get_400_and_the_replica_keeps_serving(agent_apps):
    import openai
    import requests

    client = openai.OpenAI(base_url=agent_apps["agent"] + "/v1", api_key="sekret", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="'max_tokens' must be in"):
        client.chat.completions.create(model="tiny", messages=_user(), max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="messages\\[0\\].role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="serve.max_prompt_tokens"):
        client.chat.completions.create(model="tiny", messages=_user("1 2 3 " * 400), max_tokens=8)
    headers = {"Authorization": "Bearer sekret"}
    url = agent_apps["agent"] + "/v1/chat/completions"
    r = requests.post(url, json={"model": "tiny"}, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == "'messages' is required"
    r = requests.post(url, data=b"x" * 300_000, headers=headers, timeout=60)
    assert r.status_code == 400 and "bytes; the limit is" in r.json()["error"]["message"]
    r = requests.post(url, data=b"{not json", headers=headers, timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    lone = b'{"messages": [{"role": "user", "content": "x\\ud800"}]}'  # valid JSON, not valid Unicode (was a 500)
    r = requests.post(url, data=lone, headers=headers, timeout=60)
    assert r.status_code == 400 and "messages[0].content is not valid Unicode" in r.json()["error"]["message"]
    resp = client.chat.completions.create(model="tiny", messages=_user(), max_tokens=8)
    assert resp.choices[0].message.role == "assistant"


def test_wrong_or_missing_key_gets_401(agent_apps):
    import openai
    import requests

    bad = openai.OpenAI(base_url=agent_apps["agent"] + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=_user(), max_tokens=8)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = requests.post(agent_apps["agent"] + "/v1/chat/completions", json={"messages": _user()}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(agent_apps["agent"] + "/health", timeout=60).json()["status"] == "ok"


def test_hostile_python_in_a_conversation_is_contained(agent_apps):
    import openai

    client = openai.OpenAI(base_url=agent_apps["scripted"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(model="scripted", messages=_user("Do something bad."), max_tokens=400)
    msg = resp.choices[0].message
    trace = msg.model_extra["tool_trace"]
    assert [t["tool"] for t in trace] == ["python"] * 3, (trace, msg.model_extra["reasoning_content"])
    assert "writing outside the working directory is not allowed" in trace[0]["output"]
    assert "CPU time limit (1 s) exceeded" in trace[1]["output"] or "timed out after 1 s" in trace[1]["output"]
    assert "os.system is not allowed" in trace[2]["output"]
    assert msg.content == "\\boxed{survived}" and resp.choices[0].finish_reason == "stop"
    assert not Path("/etc/rapo_pwned").exists() and not Path("/tmp/rapo_pwned_shell").exists()
    again = client.chat.completions.create(
        model="scripted", messages=_user("Again."), max_tokens=400, extra_body={"max_tool_calls": 0}
    )
    assert again.model_extra["agent"]["finish_reason"] == "tool_limit"  # the limit is enforced per request


def test_a_replica_death_fails_no_request_and_health_reports_it(agent_apps, tiny_cfg, tiny_model_dir):
    """Issue #22: when the only replica was killed under load its 32 requests in flight got HTTP 500 and /health
    never said so. With two replicas behind the router, requests in flight on a killed one are sent again to the
    other: none fails; /health says "degraded" until Serve has replaced it, then "ok"."""
    import ray
    import requests
    from ray import serve

    from rapo_ray.serving.app import build_agent_app

    steps = ["<think>slow</think><python>import time; time.sleep(1.0); print(1)</python>", "<answer>1</answer>"]
    cfg = replace(
        tiny_cfg,
        serve=replace(
            tiny_cfg.serve,
            model_name="agent",
            min_replicas=2,
            max_replicas=2,
            num_cpus=0.5,
            engine_factory="rapo_ray.engines.scripted:scripted_engine",
            engine_kwargs={"steps": steps},
        ),
    )
    serve.run(build_agent_app(cfg, tiny_model_dir), name="replicas_test", route_prefix="/replicas")
    base = agent_apps["agent"].replace("/agent", "/replicas")
    try:
        assert requests.get(base + "/health", timeout=30).json()["replicas_running"] == 2
        results, health = [], []

        def ask(i):
            r = requests.post(base + "/v1/chat/completions", json={"messages": _user(f"q{i}")}, timeout=120)
            results.append((r.status_code, r.json()))

        # the victim is looked up before the load starts: listing actors took long enough on a loaded box for every
        # request to finish before the kill (then nothing was in flight to retry)
        replicas = [
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if "SERVE_REPLICA::replicas_test#AgentServer" in a["name"]
        ]
        victim = ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # requests in flight on both replicas: 8 each, 4 tool calls at a time, 1 s per call
        ray.kill(victim, no_restart=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            h = requests.get(base + "/health", timeout=30)
            health.append((h.status_code, h.json()["status"], round(time.monotonic() - t0, 2)))
            if health[-1][1] == "ok" and any(s == "degraded" for _, s, _ in health):
                break
            time.sleep(0.2)
        for t in threads:
            t.join()
        assert [code for code, _ in results] == [200] * 16, [r for r in results if r[0] != 200]
        assert all(body["choices"][0]["message"]["content"] == "1" for _, body in results)
        assert ("degraded" in [s for _, s, _ in health]) and health[-1][1] == "ok", health
        assert max(seconds for *_, seconds in health) < 5.0, health  # /health answers fast, even while degraded
        assert requests.get(base + "/health", timeout=30).json()["retried_requests"] >= 1
    finally:
        serve.delete("replicas_test")


def test_new_checkpoint_rolls_out_without_errors(agent_apps, tiny_cfg, tiny_model_dir, tmp_path):
    """Redeploying with another checkpoint under client load: every request succeeds, then the new one serves."""
    import shutil

    import openai
    from ray import serve

    from rapo_ray.serving.app import build_agent_app

    new_ckpt = tmp_path / "v2"
    shutil.copytree(tiny_model_dir, new_ckpt)
    cfg = replace(
        tiny_cfg,
        serve=replace(
            tiny_cfg.serve,
            model_name="agent",
            engine_factory="rapo_ray.engines.scripted:scripted_engine",
            engine_kwargs={"steps": ["<think>x</think><answer>\\boxed{1}</answer>"]},
        ),
    )
    serve.run(build_agent_app(cfg, tiny_model_dir), name="rolling_test", route_prefix="/rolling")
    client = openai.OpenAI(
        base_url=agent_apps["agent"].replace("/agent", "/rolling") + "/v1", api_key="x", max_retries=0, timeout=120
    )
    old_root = client.models.list().data[0].model_extra["root"]
    stop, ok, errors = threading.Event(), [], []

    def hammer():
        while not stop.is_set():
            try:
                resp = client.chat.completions.create(model="agent", messages=_user(), max_tokens=16)
                ok.append(Path(resp.model_extra["agent"]["checkpoint"]).name)
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(repr(exc))

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        serve.run(build_agent_app(cfg, new_ckpt), name="rolling_test", route_prefix="/rolling")
        deadline = time.time() + 60
        while time.time() < deadline and client.models.list().data[0].model_extra["root"] == old_root:
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
        serve.delete("rolling_test")
    assert errors == []
    assert (
        old_root == str(Path(tiny_model_dir).resolve())
        and ok[0] == Path(tiny_model_dir).name
        and ok[-1] == "v2"
        and len(ok) > 10
    )
