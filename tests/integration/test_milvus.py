"""The step store against a real milvus-lite server (a child process, temporary directory): recall, idempotence,
the replica index, a killed server, a cut-short index file, the search tool's document index."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest

from rapo_ray.agent.retriever import StoredStep
from rapo_ray.core.errors import StoreError
from rapo_ray.retrieval.replica_index import ReplicaIndex
from rapo_ray.retrieval.store import GRPC_OPTIONS, KEY_CHARS, MilvusLiteServer, MilvusStepStore, step_rows


def _unit(n, d, seed):
    v = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _steps(n):
    return [
        StoredStep(f"key {i}", f"<think>v{i}</think>", [i, i + 1], float(i % 3), f"q{i % 7}", i % 4, "test")
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    return str(tmp_path_factory.mktemp("milvus") / "steps.db")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_round_trip_recall_and_idempotence(lite):
    store = MilvusStepStore(lite, "rt", dim=16)
    vec = _unit(400, 16, 0)
    steps = _steps(400)
    assert store.upsert(steps, vec) == 400
    assert store.upsert(steps, vec) == 400  # same content -> same ids: no duplicates
    assert store.count() == 400
    queries = _unit(50, 16, 1)
    hits = store.search(queries, top_k=3)
    brute = np.argsort(-(queries @ vec.T), axis=1)[:, 0]
    recall = np.mean([h[0].value == steps[b].value for h, b in zip(hits, brute)])
    assert recall >= 0.99
    assert all(len(h) == 3 and h[0].score >= h[1].score >= h[2].score for h in hits)
    assert hits[0][0].value_ids == steps[brute[0]].value_ids
    # a query that matches nothing useful still gets k results with scores
    far = -np.ones((1, 16), dtype=np.float32) / 4.0
    (row,) = store.search(far, top_k=3)
    assert len(row) == 3 and all(np.isfinite(h.score) for h in row)
    qids = [steps[b].question_id for b in brute[:5]]
    excl = store.search(queries[:5], top_k=2, question_filter=[("other", q) for q in qids])
    assert all(len(row) == 2 and h.question_id != q for row, q in zip(excl, qids) for h in row)
    own = store.search(queries[:5], top_k=2, question_filter=[("own", q) for q in qids[:4]] + [None])
    assert all(len(row) == 2 and h.question_id == q for row, q in zip(own[:4], qids) for h in row)
    assert own[4][0].value == hits[4][0].value  # no filter: the plain nearest row
    store.close()


def test_the_store_client_pings_no_more_often_than_a_grpc_server_accepts(lite):
    """pymilvus's own keep-alive (a ping every 10 s, calls or not) made milvus-lite answer with a GOAWAY after about
    100 s idle, logged as an error on the job's console; the store's connection asks for less. The console line itself
    takes minutes to show, so this checks that the options reach pymilvus's channel (its handler keeps them)."""
    store = MilvusStepStore(lite, "pings", dim=4)
    options = store.client._get_connection()._grpc_options
    assert options == GRPC_OPTIONS
    assert options["grpc.keepalive_time_ms"] >= 300_000 and not options["grpc.keepalive_permit_without_calls"]
    store.close()


def test_copying_a_collection_prints_no_client_timestamp_warning(lite):
    """A replica copies the buffer with pymilvus's query iterator, which warned at every copy that milvus-lite gave
    no MVCC timestamp (a line on the job's console: pymilvus's logger writes to stderr itself). The copy is whole,
    that warning is gone, and the iterator's other warnings still pass."""
    store = MilvusStepStore(lite, "copy_quiet", dim=8)  # (pymilvus configures its loggers on connecting)
    store.upsert(_steps(30), _unit(30, 8, 0))
    store.flush()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    iterator_log = logging.getLogger("pymilvus.client.iterator.query_iterator")
    iterator_log.addHandler(handler)
    try:
        assert len(ReplicaIndex.from_store(store, batch_size=10)) == 30
        iterator_log.warning("another warning")
    finally:
        iterator_log.removeHandler(handler)
        store.close()
    assert [r.getMessage() for r in records] == ["another warning"]


def test_replica_index_matches_brute_force_and_milvus(lite):

    store = MilvusStepStore(lite, "replica", dim=16)
    vec, steps = _unit(400, 16, 0), _steps(400)
    store.upsert(steps, vec)
    store.flush()
    index = ReplicaIndex.from_store(store, batch_size=128)  # several iterator pages
    assert len(index) == 400
    queries = _unit(50, 16, 1)
    brute = np.argsort(-(queries @ vec.T), axis=1)[:, :3]
    hits = index.search(queries, top_k=3)
    assert [[h.value for h in row] for row in hits] == [[steps[j].value for j in row] for row in brute]
    assert np.allclose([h.score for h in hits[0]], (queries[0] @ vec.T)[brute[0]], atol=1e-5)
    assert hits[0][0].value_ids == steps[brute[0][0]].value_ids and hits[0][0].reward == steps[brute[0][0]].reward
    milvus = store.search(queries, top_k=1)
    assert np.mean([m[0].value == h[0].value for m, h in zip(milvus, hits)]) >= 0.99
    # exclusion skips every row of the query's question, even when all the best rows are that question's
    qid = steps[brute[0][0]].question_id
    excl = index.search(queries[:1], top_k=5, question_filter=[("other", qid)])[0]
    assert len(excl) == 5 and all(h.question_id != qid for h in excl)
    # "own": only the query's question's rows, best first (brute force over those rows), and none for an unknown one
    own, unknown = index.search(queries[:2], top_k=3, question_filter=[("own", "q3"), ("own", "nope")])
    rows_q3 = [j for j, st in enumerate(steps) if st.question_id == "q3"]
    best = sorted(rows_q3, key=lambda j: -(queries[0] @ vec[j]))[:3]
    assert [h.value for h in own] == [steps[j].value for j in best] and unknown == []
    # upsert semantics: same id replaces, new id appends
    moved = vec[:1] * -1
    index.add_rows(step_rows(steps[:1], moved))
    assert len(index) == 400 and index.search(moved, top_k=1)[0][0].value == steps[0].value
    new_row = step_rows([StoredStep("new", "<think>new</think>", [1], 1.0, "qn", 0, "x")], _unit(1, 16, 9))
    index.add_rows(new_row)
    assert len(index) == 401 and index.search(_unit(1, 16, 9), top_k=1)[0][0].value == "<think>new</think>"
    # a row replaced under the same id with another question id leaves the old question's "own" rows
    index.add([new_row[0]["id"]], _unit(1, 16, 9), [("<think>moved</think>", "[]", 0.0, "q-moved")])
    assert len(index) == 401
    assert [h.value for h in index.search(_unit(1, 16, 9), top_k=3, question_filter=[("own", "q-moved")])[0]] == [
        "<think>moved</think>"
    ]
    assert index.search(_unit(1, 16, 9), top_k=3, question_filter=[("own", "qn")]) == [[]]
    with pytest.raises(ValueError, match="dim 8"):
        index.add(["x"], np.zeros((1, 8), dtype=np.float32), [("v", "[]", 0.0, "q")])
    assert ReplicaIndex(16).search(queries[:2], top_k=3) == [[], []]  # empty buffer: no hits, no error
    store.close()


def test_replica_index_hands_back_stored_vectors_of_queries_equal_to_a_key():
    """``key_vectors``: a query whose embedded text (here: its last 4 characters) equals a stored key's gets that
    row's vector; other queries, keys the store may have cut, and an index without ``key_text`` get None."""
    vec = _unit(3, 16, 2)
    payloads = [("v", "[]", 1.0, "q")] * 3
    keys = ["history 1 ab", "history 2 cd", "x" * KEY_CHARS]  # the last one may have been cut: never matched
    index = ReplicaIndex(16, key_text=lambda t: t[-4:])
    index.add(["a", "b", "c"], vec, payloads, keys)
    got = index.key_vectors(["other 1 ab", "history 2 cd", "nothing", "x" * KEY_CHARS])
    assert np.array_equal(got[0], vec[0]) and np.array_equal(got[1], vec[1]) and got[2] is None and got[3] is None
    got[0][:] = 0  # a copy: the index's own row is untouched
    assert np.array_equal(index.key_vectors(["history 1 ab"])[0], vec[0])
    index.add(["a"], vec[2:3], payloads[:1], ["history 1 ab"])  # upsert: the key now maps to the new vector
    assert np.array_equal(index.key_vectors(["history 1 ab"])[0], vec[2])
    plain = ReplicaIndex(16)
    plain.add(["a"], vec[:1], payloads[:1], keys[:1])
    assert plain.key_vectors(["history 1 ab"]) == [None]
    with pytest.raises(ValueError, match="1 keys"):
        index.add(["a", "b"], vec[:2], payloads[:2], keys[:1])


def test_dimension_mismatch_is_clear(lite):
    MilvusStepStore(lite, "dims", dim=16).close()
    with pytest.raises(StoreError, match="has vector dim 16, but the embedder gives 384"):
        MilvusStepStore(lite, "dims", dim=384)


def test_milvus_lite_server_dies_with_its_run_and_a_held_lock_is_named(tmp_path):
    """A run killed with SIGKILL takes its milvus-lite server with it, so the next run can open the same data
    directory; a second server on a directory that is in use fails with an error that says so."""
    import os
    import signal
    import subprocess
    import sys

    data = tmp_path / "srv"
    script = (
        f"import sys, time\nfrom rapo_ray.retrieval.store import MilvusLiteServer\n"
        f"s = MilvusLiteServer({str(data)!r})\nprint(s.proc.pid, flush=True)\ntime.sleep(600)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = None
    try:
        server_pid = int(run.stdout.readline())
        with pytest.raises(StoreError, match="another milvus-lite server holds the data directory"):
            MilvusLiteServer(data, start_timeout_s=30)
        run.send_signal(signal.SIGKILL)
        run.wait()
        deadline = time.time() + 30
        while time.time() < deadline and _alive(server_pid):
            time.sleep(0.2)
        assert not _alive(server_pid), "the killed run's milvus-lite server is still running"
        again = MilvusLiteServer(data)  # the lock is free again
        again.stop()
    finally:
        run.kill()
        if server_pid and _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_a_killed_milvus_lite_server_is_started_again_with_its_data(tmp_path):
    """Issue #22: the run's milvus-lite server died with SIGKILL and stayed dead, so a replica that Serve replaced
    could not load the buffer again. The supervisor starts it again on the same URI, with the rows written before."""
    import os
    import signal

    import numpy as np

    from rapo_ray.agent.retriever import StoredStep
    from rapo_ray.retrieval.store import MilvusStepStore, step_rows

    server = MilvusLiteServer(tmp_path / "srv")
    try:
        store = MilvusStepStore(server.uri, "steps", 4, create=True)
        step = StoredStep(key="k", value="<think>v</think>", value_ids=[1, 2], reward=1.0, question_id="q1")
        store.upsert_rows(step_rows([step], np.ones((1, 4), dtype=np.float32)))
        store.flush()
        first = server.proc.pid
        os.kill(first, signal.SIGKILL)
        deadline = time.time() + 60
        while time.time() < deadline and (server.restarts == 0 or server.proc.pid == first):
            time.sleep(0.2)
        assert server.restarts == 1 and server.proc.pid != first and _alive(server.proc.pid)
        again = MilvusStepStore(server.uri, "steps", 4, create=False)
        assert again.count() == 1  # the same data directory, the row written before the kill
        again.close()
        store.close()
    finally:
        server.stop()
    assert not _alive(server.proc.pid) and server.restarts == 1  # stop() is not a death to recover from


def test_an_index_file_cut_short_by_a_killed_server_is_built_again_with_every_row(tmp_path, caplog):
    """Session 15: a milvus-lite server killed right after a flush (while it wrote the HNSW index in the
    background) left the index file short, and the restarted server's every load failed ("read error in
    ...vector.hnsw.idx: 0 != 1"). The index is rebuilt from the stored vectors; the rows stay."""

    import numpy as np

    from rapo_ray.agent.retriever import StoredStep
    from rapo_ray.retrieval.store import MilvusStepStore, step_rows

    steps = [
        StoredStep(key=f"k{i}", value=f"<think>{i}</think>", value_ids=[i], question_id=f"q{i}") for i in range(30)
    ]
    vectors = np.eye(30, 8, dtype=np.float32) + 0.01
    server = MilvusLiteServer(tmp_path / "srv")
    try:
        store = MilvusStepStore(server.uri, "steps", 8, create=True)
        store.upsert_rows(step_rows(steps, vectors))
        store.flush()
        deadline = time.time() + 60  # the index is built in the background after the flush
        while time.time() < deadline and store.client.describe_index("steps", "vector")["state"] != "Finished":
            time.sleep(0.2)
        store.close()
    finally:
        server.stop()
    index_files = list((tmp_path / "srv").rglob("*.idx"))
    assert index_files, "milvus-lite wrote no index file: the layout this test cuts has changed"
    for f in index_files:
        f.write_bytes(b"")
    server = MilvusLiteServer(tmp_path / "srv")
    try:
        with caplog.at_level("WARNING", logger="rapo_ray.retrieval"):
            again = MilvusStepStore(server.uri, "steps", 8, create=False)
        assert "building the index again" in caplog.text
        assert again.count() == 30
        hits = again.client.search("steps", data=[vectors[7].tolist()], limit=1, output_fields=["key"])
        assert hits[0][0]["entity"]["key"] == "k7"
        again.close()
    finally:
        server.stop()


def test_unreachable_milvus_names_uri():
    from rapo_ray.core.net import free_port

    port = free_port()  # nothing listens there
    with pytest.raises(StoreError, match=f"Milvus at http://127.0.0.1:{port} is unreachable"):
        MilvusStepStore(f"http://127.0.0.1:{port}", "x", dim=8)


def test_milvus_document_index_for_the_search_tool(tmp_path):
    """The search tool's corpus in its own Milvus collection: idempotent adds, dense top-k, a SearchTool on top."""
    from rapo_ray.envs.tools import SearchTool
    from rapo_ray.retrieval.embedder import Embedder
    from rapo_ray.retrieval.store import MilvusDocumentIndex

    docs = [
        "The mentor of Alice is Bob.",
        "Paris is the capital of France.",
        "Photosynthesis turns light into chemical energy.",
        "The Pacific is the largest ocean.",
    ]
    index = MilvusDocumentIndex(str(tmp_path / "corpus.db"), "docs", Embedder(pooling="mean"))
    index.add(docs)
    index.add(docs[:2])  # same texts again: upserted, not duplicated
    assert index.count() == 4
    hits = index.search("What is the capital city of France?", 2)
    assert hits[0][0] == "Paris is the capital of France." and len(hits) == 2 and hits[0][1] >= hits[1][1]
    res = SearchTool(index, top_k=1).run("largest ocean")
    assert res.ok and res.text == "The Pacific is the largest ocean."
    index.close()


def test_search_tool_over_milvus_for_the_bundled_corpus(tmp_path, tiny_cfg):
    from dataclasses import replace

    from rapo_ray.envs import tasks as bundled
    from rapo_ray.envs.suite import build_tools
    from rapo_ray.retrieval.search_index import search_index_for

    tcfg = replace(tiny_cfg.tasks, search_backend="milvus", search_milvus_uri=str(tmp_path / "search.db"))
    tools = build_tools(tcfg, tiny_cfg.rollout, search_index_for(tcfg))
    try:
        docs = bundled.make_world(tcfg.seed).documents()
        assert tools.search.index.count() == len(docs)
        res = tools.call("search", docs[0].rsplit(" is ", 1)[0])  # "The mentor of X" -> its fact among the top 3
        assert res.ok and docs[0] in res.text.split("\n")
    finally:
        tools.close()


def test_equal_scores_are_broken_by_row_id_whatever_order_the_rows_were_loaded_in():
    ids = [f"s{i}" for i in range(6)]
    vec = np.tile(np.eye(1, 4, dtype=np.float32), (6, 1))  # every row scores the same
    payloads = [(f"value {i}", "[]", 1.0, f"q{i % 2}") for i in range(6)]
    results = []
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 4, 0, 2]):
        index = ReplicaIndex(4)
        index.add([ids[i] for i in order], vec[order], [payloads[i] for i in order])
        index._order_rows_by_id()
        hits = index.search(vec[:1], top_k=3, question_filter=[("own", "q1")])[0]
        results.append([h.value for h in index.search(vec[:1], top_k=4)[0]] + [h.value for h in hits])
    assert results[0] == results[1] == ["value 0", "value 1", "value 2", "value 3", "value 1", "value 3", "value 5"]


@pytest.mark.parametrize("backend", ["minilm", "minilm-onnx-int8", "bm25"])
def test_each_backend_answers_the_same_after_a_restart_from_milvus(tmp_path, backend):
    """The retrieval replica (the Serve deployment's class, called directly) is built over a stored buffer, takes
    on-policy inserts while it serves, and is then replaced by a new one that loads everything back from Milvus:
    both answer every query with the same steps and scores, ties included."""
    from rapo_ray.retrieval.backends import prepare_backend
    from rapo_ray.retrieval.service import StepRetrieverService

    def step(i):
        key = f"Question {i % 5}: {['apples', 'pears', 'clips', 'hours', 'wallets'][i % 5]} cost {i * 3} dollars."
        return {
            "key": key + f" Step {i}",
            "value": f"<think>v{i}</think>",
            "value_ids": [i],
            "reward": 1.0,
            "question_id": f"q{i % 5}",
            "step_index": i % 3,
            "source": "test",
        }

    files = prepare_backend(backend, tmp_path / "artifacts", "last")
    server = MilvusLiteServer(tmp_path / "srv")
    replica = StepRetrieverService.func_or_class
    queries = [step(4)["key"], "apples cost 12 dollars", "how many clips?", "nothing in common", "Step 7"]
    scopes = [None, ("other", "q0"), ("own", "q2"), None, None]
    replicas = []

    def start():  # each replica's Milvus client is closed before the server stops (no client retrying a dead one)
        replicas.append(replica(server.uri, "steps", embedder=backend, embedder_files=files))
        return replicas[-1]

    try:
        assert start().insert([step(i) for i in range(0, 40, 2)]) == 20  # the built buffer
        first = start()  # a replica over it
        first.insert([step(i) for i in range(1, 40, 2)])  # on-policy inserts while serving, ids in no order
        before = first._search([(queries, 3, scopes)])[0]
        after = start()._search([(queries, 3, scopes)])[0]  # a replica started after it, from Milvus
        assert after == before
        assert before[0][0]["value"] == "<think>v4</think>" and all(len(row) == 3 for row in before)
        assert all(h["meta"]["question_id"] != "q0" for h in before[1])
        assert all(h["meta"]["question_id"] == "q2" for h in before[2])
    finally:
        for r in replicas:
            r.store.close()
        server.stop()


def test_a_buffer_for_another_backend_takes_its_siblings_steps_instead_of_sampling(tiny_cfg, tiny_model_dir, tmp_path):
    """The steps of a BM25 buffer, re-embedded for MiniLM: the same steps, MiniLM key vectors, nothing sampled (a
    sample would need Ray, which this test does not start)."""
    from dataclasses import replace

    from rapo_ray.envs.suite import task_splits
    from rapo_ray.pipelines.buffer import (
        _write_manifest,
        buffer_fingerprint,
        build_buffer,
        manifest_path,
        with_buffer_collection,
    )
    from rapo_ray.retrieval.backends import make_encoder
    from rapo_ray.retrieval.embedder import Embedder
    from rapo_ray.retrieval.key_text import DIM

    def setup(embedder):
        cfg = replace(tiny_cfg, run=replace(tiny_cfg.run, artifacts_dir=str(tmp_path)))
        return with_buffer_collection(replace(cfg, retrieval=replace(cfg.retrieval, embedder=embedder)), tiny_model_dir)

    bm25, minilm = setup("bm25"), setup("minilm")
    train, _ = task_splits(tiny_cfg.tasks)
    tasks = train["multihop"][:3]
    steps = [
        StoredStep(f"{t.question} history {j}", f"<think>{t.id} {j}</think>", [j, 7], 1.0, t.id, j, "scripted-expert")
        for t in tasks
        for j in range(2)
    ]
    uri = str(tmp_path / "steps.db")
    sibling = MilvusStepStore(uri, bm25.retrieval.collection, DIM)
    sibling.upsert(steps, make_encoder("bm25", "", "last", 1300).embed([s.key for s in steps]))
    sibling.close()
    _write_manifest(manifest_path(bm25), {t.id for t in tasks}, buffer_fingerprint(bm25, str(tiny_model_dir)))
    said = []
    report = build_buffer(minilm, str(tiny_model_dir), uri, tasks, manifest_path(minilm), log=said.append)
    assert report.reindexed == 3 and report.steps == 6 and report.trajectories == 0
    assert any("6 steps of 3 questions taken from" in line for line in said), said
    store = MilvusStepStore(uri, minilm.retrieval.collection, DIM, create=False)
    try:
        assert store.steps([t.id for t in tasks]) == sorted(steps, key=lambda s: (s.question_id, s.step_index))
        hit = store.search(Embedder().embed([steps[3].key]), top_k=1)[0][0]  # a MiniLM vector finds its own key
        assert hit.value == steps[3].value and hit.score == pytest.approx(1.0, abs=1e-4)
    finally:
        store.close()
    manifest = json.loads(manifest_path(minilm).read_text())
    assert set(manifest["questions"]) == {t.id for t in tasks}
    assert manifest["built_for"] == buffer_fingerprint(minilm, str(tiny_model_dir))
