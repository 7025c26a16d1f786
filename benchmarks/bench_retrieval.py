"""Retrieval service benchmark: closed-loop load against a step buffer in Milvus behind Ray Serve.

    python benchmarks/bench_retrieval.py [--steps 50000] [--clients 1,8,32,64] [--seconds 10] [--query-chars 0]

- fills a collection with ``--steps`` stored steps (random unit keys; search cost does not depend on text);
- top-1 recall of Milvus's HNSW index and of the replica's in-memory index against brute-force numpy;
- embedder texts/s (at the query length used);
- searches in the replica (``retrieval.search_on=replica``, the default), batching on and off: ``--clients``
  concurrent closed-loop clients for ``--seconds`` each, through the DeploymentHandle (what rollout workers
  use) and through HTTP on 127.0.0.1: requests/s, p50/p99 latency; then searches in Milvus
  (``search_on=milvus``), batched, through the handle, for comparison.
- ``--query-chars N`` pads each query to N characters with a tool-call history (a rollout's real query is
  the last 1,300 characters of its history); 0 keeps the short one-line question.
Everything runs on 127.0.0.1; every loop is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from benchmarks.load import percentile_ms, run_clients  # noqa: E402
from rapo_ray.core.net import free_port  # noqa: E402

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def make_query(k: int, i: int, chars: int, tag: str = "") -> str:
    """Client ``k``'s ``i``-th query; ``tag`` makes one load level's queries differ from every other level's, so
    the replica's query-vector cache (retrieval.embed_cache_size) never answers and each request is embedded."""
    q = f"Who is the mentor of the rival of Kalo{tag}{k}x{i}? <think>find the rival</think>"
    if chars <= len(q):
        return q
    turn = f"<search>rival of Kalo{k}x{i}</search><result>The rival of Kalo{k}x{i} is Zen{i}.</result><think>now the mentor</think>"
    return (turn * (chars // len(turn) + 1))[: chars - len(q)] + q


def closed_loop(call, clients: int, seconds: float, query_chars: int = 0, tag: str = "") -> dict:
    lat: list[float] = []
    errors = [0]
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client(k):
        i = 0
        while time.perf_counter() < stop:
            t = time.perf_counter()
            try:
                call(make_query(k, i, query_chars, tag))
                with lock:
                    lat.append(time.perf_counter() - t)
            except Exception:
                with lock:
                    errors[0] += 1
            i += 1

    wall = run_clients(client, clients)
    lat.sort()
    return {
        "clients": clients,
        "requests": len(lat),
        "errors": errors[0],
        "rps": len(lat) / wall,
        "p50_ms": percentile_ms(lat, 0.50),
        "p99_ms": percentile_ms(lat, 0.99),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--clients", default="1,8,32,64")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument(
        "--query-chars", type=int, default=0, help="pad queries to this many characters (0: one-line queries)"
    )
    ap.add_argument("--dir", default=str(REPO / "artifacts" / "bench_retrieval"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "retrieval.json"))
    args = ap.parse_args()
    import numpy as np
    import ray
    import requests
    from ray import serve

    from rapo_ray.agent.retriever import StoredStep
    from rapo_ray.config import load_config
    from rapo_ray.launch.launcher import SERVE_LOGGING
    from rapo_ray.retrieval.client import HANDLE_OPTIONS
    from rapo_ray.retrieval.embedder import Embedder
    from rapo_ray.retrieval.replica_index import ReplicaIndex
    from rapo_ray.retrieval.service import build_app
    from rapo_ray.retrieval.store import MilvusLiteServer, MilvusStepStore

    report: dict = {"config": vars(args)}
    emb = Embedder()
    texts = [make_query(i, 0, args.query_chars) for i in range(512)]
    t = time.perf_counter()
    qv = emb.embed(texts)
    report["embedder_texts_per_s"] = len(texts) / (time.perf_counter() - t)
    print(f"embedder: {report['embedder_texts_per_s']:.0f} texts/s")

    server = MilvusLiteServer(Path(args.dir) / "milvus")
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=256 << 20,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}},
        log_to_driver=False,
    )
    try:
        store = MilvusStepStore(server.uri, "bench", dim=emb.dim)
        rng = np.random.default_rng(0)
        keys = rng.standard_normal((args.steps, emb.dim)).astype(np.float32)
        keys /= np.linalg.norm(keys, axis=1, keepdims=True)
        if store.count() < args.steps:
            t = time.perf_counter()
            for i in range(0, args.steps, 2000):
                chunk = [
                    StoredStep(f"k{j}", f"<think>step {j}</think>", [j % 500], 1.0, f"q{j % 997}", j % 4, "bench")
                    for j in range(i, min(i + 2000, args.steps))
                ]
                store.upsert(chunk, keys[i : i + len(chunk)])
            report["insert_steps_per_s"] = args.steps / (time.perf_counter() - t)
            store.flush()
            print(f"inserted {args.steps} steps: {report['insert_steps_per_s']:.0f} steps/s")
        hits = store.search(qv[:200], top_k=1)
        brute = np.argmax(qv[:200] @ keys.T, axis=1)
        report["recall_at_1"] = float(np.mean([h[0].value == f"<think>step {b}</think>" for h, b in zip(hits, brute)]))
        print(f"top-1 recall of Milvus HNSW vs brute force (200 queries): {report['recall_at_1']:.3f}")
        t = time.perf_counter()
        replica = ReplicaIndex.from_store(store)
        report["replica_load_s"] = time.perf_counter() - t
        hits = replica.search(qv[:200], top_k=1)
        report["replica_recall_at_1"] = float(
            np.mean([h[0].value == f"<think>step {b}</think>" for h, b in zip(hits, brute)])
        )
        t = time.perf_counter()
        for i in range(0, 192, 32):
            replica.search(qv[i : i + 32], top_k=1)
        report["replica_search_ms_per_32"] = (time.perf_counter() - t) / 6 * 1000
        t = time.perf_counter()
        for i in range(0, 96, 32):
            store.search(qv[i : i + 32], top_k=1)
        report["milvus_search_ms_per_32"] = (time.perf_counter() - t) / 3 * 1000
        print(
            f"replica index: loaded {len(replica)} steps in {report['replica_load_s']:.1f} s, recall {report['replica_recall_at_1']:.3f}, "
            f"{report['replica_search_ms_per_32']:.1f} ms per 32 queries (Milvus: {report['milvus_search_ms_per_32']:.1f} ms)"
        )
        store.close()

        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=SERVE_LOGGING)
        clients = [int(c) for c in args.clients.split(",")]
        report["load"] = []
        cells = [
            ("replica", True, ("handle", "http")),
            ("replica", False, ("handle", "http")),
            ("milvus", True, ("handle",)),
        ]
        for search_on, batching, transports in cells:
            cfg = load_config(overrides=["retrieval.collection=bench", f"retrieval.search_on={search_on}"])
            report["batch_wait_ms"] = cfg.retrieval.batch_wait_ms
            name = f"bench_{search_on}_{'batched' if batching else 'unbatched'}"
            app = build_app(cfg.retrieval, server.uri, batching=batching)
            serve.run(app, name=name, route_prefix=f"/{name}", logging_config=SERVE_LOGGING)  # as a training run
            handle = serve.get_deployment_handle("StepRetriever", app_name=name).options(**HANDLE_OPTIONS)
            url = f"http://127.0.0.1:{port}/{name}"
            session = requests.Session()
            calls = {
                "handle": lambda q: handle.retrieve.remote([q], 1).result(),
                "http": lambda q: session.post(url, json={"queries": [q], "top_k": 1}, timeout=30).raise_for_status(),
            }
            for transport in transports:
                for c in clients:
                    tag = f"{search_on}{int(batching)}{transport}{c}"
                    r = closed_loop(calls[transport], c, args.seconds, args.query_chars, tag)
                    r |= {"search_on": search_on, "batching": batching, "transport": transport}
                    report["load"].append(r)
                    print(
                        f"{search_on:7} batching={batching!s:5} {transport:6} clients={c:3d}: {r['rps']:7.1f} req/s  "
                        f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  errors {r['errors']}",
                        flush=True,
                    )
            serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()
        server.stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
