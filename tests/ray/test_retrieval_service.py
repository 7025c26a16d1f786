"""The retrieval Serve app on 127.0.0.1 and the Ray Data buffer builder."""

from __future__ import annotations

import json
import threading
import time

import pytest

from rapo_ray.agent.retriever import StoredStep
from rapo_ray.core.errors import StoreError
from rapo_ray.retrieval.store import MilvusLiteServer, MilvusStepStore


def _steps(n):
    return [
        StoredStep(f"key {i}", f"<think>v{i}</think>", [i, i + 1], float(i % 3), f"q{i % 7}", i % 4, "test")
        for i in range(n)
    ]


def _a_dead_replica_degrades_retrievals_until_serve_replaces_it(handle):
    """Issue #22: the replica's death used to escape the agent loop as a Ray error (and the fleet then replaced a
    healthy rollout worker). Now every call either answers or raises ``RetrievalFailed`` within its timeout
    (the loop degrades that slot), and the service answers again once Serve has replaced the replica."""
    import ray

    from rapo_ray.core.errors import RetrievalFailed
    from rapo_ray.retrieval.client import HandleStepRetriever

    (replica,) = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA::retrieval_test" in a["name"]
    ]
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
    retriever = HandleStepRetriever(handle, timeout_s=5.0)
    outcomes, deadline = [], time.monotonic() + 180
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        try:
            hit = retriever.retrieve(["key 7"])[0]
            outcomes.append("answered")
            if hit is not None and hit.value == "<think>v7</think>":
                break
        except RetrievalFailed:
            outcomes.append("failed")
        assert time.monotonic() - t0 < 5.0 + 5.0, outcomes  # a call never waits much past its timeout
        time.sleep(0.5)
    assert outcomes and outcomes[-1] == "answered", outcomes
    assert retriever.failures == outcomes.count("failed")


@pytest.mark.parametrize("search_on", ["replica", "milvus"])
def test_serve_app_handle_and_http(serve_url, tmp_path, search_on):
    import requests
    from ray import serve

    from rapo_ray.config import load_config
    from rapo_ray.retrieval.client import HANDLE_OPTIONS, HandleStepRetriever
    from rapo_ray.retrieval.embedder import Embedder
    from rapo_ray.retrieval.service import build_app

    server = MilvusLiteServer(tmp_path / "srv")
    try:
        cfg = load_config(
            overrides=[
                "retrieval.collection=svc",
                "retrieval.batch_wait_ms=5",
                f"retrieval.search_on={search_on}",
                "retrieval.embedder=minilm",  # the keys below are MiniLM vectors
            ]
        )
        emb = Embedder()
        steps = _steps(30)
        store = MilvusStepStore(server.uri, "svc", dim=384)
        store.upsert(steps, emb.embed([s.key for s in steps]))
        store.close()
        serve.run(build_app(cfg.retrieval, server.uri), name="retrieval_test", route_prefix="/retrieve")
        # called as a rollout worker calls it (HANDLE_OPTIONS: Serve's gRPC data plane), a dead replica included
        handle = serve.get_deployment_handle("StepRetriever", app_name="retrieval_test").options(**HANDLE_OPTIONS)
        out = HandleStepRetriever(handle).retrieve(["key 7", "key 12"])
        assert [o.value for o in out] == ["<think>v7</think>", "<think>v12</think>"]
        # queries equal to stored keys take the stored vectors (replica copy) instead of being embedded
        stats = handle.embed_stats.remote().result()
        if search_on == "replica":
            assert stats == {"key_hits": 2, "cache_hits": 0, "embedded": 0}
        else:  # no in-memory copy of the keys: embedded
            assert stats == {"key_hits": 0, "cache_hits": 0, "embedded": 2}
        assert out[0].score == pytest.approx(1.0, abs=1e-5)  # the stored vector of the same text: cosine 1
        # question scopes: key 7 is question q0's; "other" must pick another question's step, "own" one of q0's
        other = HandleStepRetriever(handle, question_scope="other").retrieve(["key 7"], ["q0"])[0]
        own = HandleStepRetriever(handle, question_scope="own").retrieve(["key 8"], ["q0"])[0]
        assert other.question_id != "q0" and own.question_id == "q0"
        # concurrent calls through one client (the per-trajectory schedule's threads) go out coalesced, and each
        # caller gets the rows of its own queries under its own question filter
        shared, got, start = HandleStepRetriever(handle, question_scope="own"), {}, threading.Barrier(20)

        def call(i):
            start.wait()
            got[i] = shared.retrieve([f"key {i}"], [f"q{i % 7}"])[0]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(20)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert {i: (h.value, h.question_id) for i, h in got.items()} == {
            i: (f"<think>v{i}</think>", f"q{i % 7}") for i in range(20)
        }
        assert shared.requests < 20
        url = f"{serve_url}/retrieve"
        r = requests.post(url, json={"queries": ["key 3"], "top_k": 2}, timeout=30)
        assert r.status_code == 200 and len(r.json()["results"][0]) == 2
        assert set(r.json()["results"][0][0]) == {"value", "value_ids", "score", "reward", "meta"}
        for bad in ({"queries": "key"}, {"queries": [1]}, {"queries": ["a"], "top_k": 0}, [1, 2]):
            r = requests.post(url, json=bad, timeout=30)
            assert r.status_code == 400 and "error" in r.json()
        r = requests.post(url, data=b"{not json", timeout=30)
        assert r.status_code == 400
        assert requests.post(url, json={"queries": ["key 1"]}, timeout=30).status_code == 200  # still serving
        noisy = HandleStepRetriever(handle, noise_prob=1.0, seed=0).retrieve(["key 7"])
        assert noisy[0].noise
        # on-policy insertion (retrieval.insert_on_policy): embedded by the service, searchable at once, idempotent
        fresh = {
            "key": "a brand new history",
            "value": "<think>fresh</think>",
            "value_ids": [5, 6],
            "reward": 1.0,
            "question_id": "qnew",
            "step_index": 0,
            "source": "on_policy",
        }
        n0 = handle.count.remote().result()
        assert handle.insert.remote([fresh]).result() == 1 and handle.insert.remote([fresh]).result() == 1
        assert handle.count.remote().result() == n0 + 1
        assert HandleStepRetriever(handle).retrieve(["a brand new history"])[0].value == "<think>fresh</think>"
        if search_on == "replica":
            _a_dead_replica_degrades_retrievals_until_serve_replaces_it(handle)
    finally:
        serve.delete("retrieval_test")
        server.stop()


def test_serve_app_ranks_by_bm25_and_inserts_with_the_lexical_backend(serve_url, tmp_path):
    """retrieval.embedder=bm25 through the deployed app: the replica ranks the stored keys' words (no query is
    embedded) and an on-policy insert is searchable at once."""
    from ray import serve

    from rapo_ray.config import load_config
    from rapo_ray.retrieval.client import HANDLE_OPTIONS, HandleStepRetriever
    from rapo_ray.retrieval.lexical import HashedTermEncoder
    from rapo_ray.retrieval.service import build_app

    server = MilvusLiteServer(tmp_path / "srv")
    try:
        cfg = load_config(overrides=["retrieval.collection=lex", "retrieval.embedder=bm25"])
        steps = [
            StoredStep(f"{fruit} cost {i} dollars each", f"<think>v{i}</think>", [i], 1.0, f"q{i}", 0, "test")
            for i, fruit in enumerate(["apples", "pears", "plums", "figs"])
        ]
        store = MilvusStepStore(server.uri, "lex", dim=384)
        store.upsert(steps, HashedTermEncoder().embed([s.key for s in steps]))
        store.close()
        # the replica runs its searches on its own event loop (replica_actor_options)
        serve.run(build_app(cfg.retrieval, server.uri), name="retrieval_lex", route_prefix="/retrieve_lex")
        # called as a rollout worker calls it: over Serve's gRPC data plane
        handle = serve.get_deployment_handle("StepRetriever", app_name="retrieval_lex").options(**HANDLE_OPTIONS)
        out = HandleStepRetriever(handle).retrieve(["how much do 3 plums cost?", "figs"])
        assert [o.value for o in out] == ["<think>v2</think>", "<think>v3</think>"] and out[0].score > 0
        fresh = {
            "key": "kiwis are sold by the dozen",
            "value": "<think>kiwi</think>",
            "value_ids": [9],
            "reward": 1.0,
            "question_id": "qk",
            "step_index": 0,
            "source": "on_policy",
        }
        assert handle.insert.remote([fresh]).result() == 1 and handle.count.remote().result() == 5
        assert HandleStepRetriever(handle).retrieve(["a dozen kiwis"])[0].value == "<think>kiwi</think>"
    finally:
        serve.delete("retrieval_lex")
        server.stop()


def test_builder_counts_idempotence_and_resume(ray_session, tiny_cfg, tiny_model_dir, tmp_path):
    from dataclasses import replace

    from rapo_ray.envs.suite import task_splits
    from rapo_ray.pipelines.buffer import build_buffer

    cfg = replace(
        tiny_cfg,
        retrieval=replace(
            tiny_cfg.retrieval,
            collection="built",
            buffer_samples_per_question=2,
            buffer_keep_top_k=1,
            buffer_error_rate=0.0,
        ),
    )
    train, _ = task_splits(cfg.tasks)
    tasks = train["multihop"][:6] + train["arith"][:4]
    uri = str(tmp_path / "b.db")
    manifest = tmp_path / "manifest.json"
    rep = build_buffer(cfg, str(tiny_model_dir), uri, tasks[:5], manifest, log=lambda *_: None)
    # one kept trajectory per question, one step per tool call (answer steps excluded)
    assert rep.trajectories == 5 and rep.steps >= 10 and rep.tokens > 0
    rep2 = build_buffer(cfg, str(tiny_model_dir), uri, tasks, manifest, log=lambda *_: None)  # resume: only the new 5
    assert rep2.skipped_questions == 5 and rep2.trajectories == 5
    assert set(json.loads(manifest.read_text())["questions"]) == {t.id for t in tasks}
    # built for another setup (here the task seed maps the same ids to other questions): refused, left as it was
    kept = manifest.read_text()
    other = replace(cfg, tasks=replace(cfg.tasks, seed=cfg.tasks.seed + 1))
    seeds = rf"tasks.seed {cfg.tasks.seed} here {cfg.tasks.seed + 1}"
    with pytest.raises(StoreError, match=rf"'built'.*another setup: {seeds}.*retrieval.collection"):
        build_buffer(other, str(tiny_model_dir), uri, tasks, manifest, log=lambda *_: None)
    manifest.write_text(json.dumps({k: v for k, v in json.loads(kept).items() if k != "built_for"}))
    with pytest.raises(StoreError, match="'built'.*does not record what it was built for"):
        build_buffer(cfg, str(tiny_model_dir), uri, tasks, manifest, log=lambda *_: None)
    manifest.write_text(kept)
    # a buffer embedded by the older embedder (whose manifest was a bare list) is refused, and left as it was
    written = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(written["questions"]))
    with pytest.raises(StoreError, match="'built'.*embedder version 1.*retrieval.collection"):
        build_buffer(cfg, str(tiny_model_dir), uri, tasks, manifest, log=lambda *_: None)
    assert json.loads(manifest.read_text()) == written["questions"]
    from rapo_ray.retrieval.embedder import EMBEDDER_VERSION

    for bad, message in (
        ("{not json", "not valid JSON"),
        (json.dumps({"embedder_version": EMBEDDER_VERSION}), "no 'questions' list"),
    ):
        manifest.write_text(bad)
        with pytest.raises(StoreError, match=message):
            build_buffer(cfg, str(tiny_model_dir), uri, tasks, manifest, log=lambda *_: None)
    manifest.unlink()
    store = MilvusStepStore(uri, "built", dim=384)
    before = store.count()
    store.close()
    build_buffer(cfg, str(tiny_model_dir), uri, tasks, manifest, log=lambda *_: None)  # full re-run: no duplicates
    store = MilvusStepStore(uri, "built", dim=384)
    assert store.count() == before == rep.steps + rep2.steps
    store.close()
    assert "step traces" in rep.table()


def test_wait_ready_returns_once_the_app_runs_and_names_a_failed_deploy(serve_url):
    """The launcher deploys the retrieval app without waiting and calls ``wait_ready`` before the first rollout:
    it must return for an app that comes up, and raise with the replica's own error for one that cannot start
    (not hang, and not only "failed to update the deployments")."""
    from ray import serve

    from rapo_ray.launch.launcher import RetrievalService

    @serve.deployment(max_constructor_retry_count=1)
    class Broken:
        def __init__(self):
            raise ValueError("no embedder here")

    @serve.deployment
    class Fine:
        def __call__(self, request) -> str:
            return "ok"

    svc = RetrievalService.__new__(RetrievalService)
    for name, app in (("wait-ready-fine", Fine.bind()), ("wait-ready-broken", Broken.bind())):
        serve.run_many([serve.RunTarget(app, name, f"/{name}", None)], wait_for_applications_running=False)
        svc.app = name
        if name == "wait-ready-fine":
            svc.wait_ready()
            assert serve.status().applications[name].status == "RUNNING"
        else:
            with pytest.raises(RuntimeError, match=r"'wait-ready-broken' failed to deploy(.|\n)*no embedder here"):
                svc.wait_ready()
        serve.delete(name)
