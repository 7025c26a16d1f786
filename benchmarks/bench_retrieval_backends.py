"""Step-retrieval backends (retrieval.embedder) on the same data, in one process (issue #39).

    python benchmarks/bench_retrieval_backends.py --run RUN [--milvus-dir DIR] [--parts quality,latency]
        [--backends minilm,minilm-onnx-int8,bm25] [--out benchmarks/results/retrieval_backends.json]

``--run``: a RAPO run (its config, its trajectories, and a checkpoint's tokenizer unless ``--tokenizer`` names a
model folder with the same tokenizer, e.g. the run's starting policy). Its step buffer is read
from the milvus-lite folder ``--milvus-dir`` (default: the run's ``run.artifacts_dir/milvus``; point it at a copy
while another run uses that folder, since milvus-lite locks it). Parts:

``quality`` (does not depend on the machine's load):
- (a) ``top1_agree``: on the run's real retrieval queries (the history before each retrieved block, as the run
  queried it: question + history, the run's question scope) against the run's stored keys, how often the
  backend's top-1 step is one MiniLM fp32 ranks first too (ties in MiniLM's score count);
- (b) R@1 on proxies: GSM8K question -> its own solution, and history (the question and the steps so far) -> the
  step that follows, over GSM8K's calculator steps (``--gsm8k`` problems) and the bundled multihop expert's steps;
- encode throughput (texts/s of the run's queries, this process, ``--threads``) with the load average beside it.

``latency`` (run it alone on the box): each backend's Serve deployment over the run's keys, the run's queries
sent one per call by 1/8/32 closed-loop client threads sharing one ``HandleStepRetriever`` for ``--seconds`` each
(as the per-trajectory schedule's threads in one rollout worker do; query cache off, so every query that is not a
stored key is encoded): calls/s, p50/p99 per call, the Serve requests those calls became, and the CPU milliseconds
per call of the clients' process and of the replica. ``--serve-settings``: ``rapo`` deploys and calls the service
as a training run does (the launcher's Serve logging; ``service.replica_actor_options``; a rollout worker's
``client.HANDLE_OPTIONS`` and its coalescing of concurrent calls), ``rapo-per-call`` the same with one request per
call, ``ray-defaults`` as Ray Serve does by default (the same logging, one request per call); give several to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import ray
import torch
from ray import serve

from benchmarks.bench_query_forms import collection_rows, run_queries
from benchmarks.load import percentile_ms, run_clients
from rapo_ray.agent.retriever import StoredStep, query_text
from rapo_ray.config import load_config
from rapo_ray.core.devices import machine_record
from rapo_ray.core.files import write_json_atomic
from rapo_ray.envs import tasks as bundled
from rapo_ray.envs.loaders import gsm8k_calc_steps, gsm8k_solutions
from rapo_ray.launch.launcher import SERVE_LOGGING
from rapo_ray.model.factory import load_tokenizer
from rapo_ray.retrieval.backends import BACKENDS, is_lexical, make_encoder, prepare_backend
from rapo_ray.retrieval.client import HANDLE_OPTIONS, HandleStepRetriever
from rapo_ray.retrieval.lexical import Bm25Index
from rapo_ray.retrieval.service import build_app, replica_actor_options
from rapo_ray.retrieval.store import MilvusLiteServer, MilvusStepStore, step_rows
from rapo_ray.training.trainer import rl_task_pool

REPO = Path(__file__).resolve().parents[1]
SERVE_SETTINGS = ("rapo", "rapo-per-call", "ray-defaults")
GSM8K_TRAIN = REPO.parent / "shared" / "data" / "gsm8k_openai" / "train.jsonl"


def score_matrix(backend: str, encoder, keys: list[str], queries: list[str]) -> np.ndarray:
    """[Q, N]: every query's score against every key, as the backend's replica ranks them."""
    if is_lexical(backend):
        index = Bm25Index()
        for row, key in enumerate(keys):
            index.set(row, encoder.embedded_text(key))
        return index.scores([encoder.embedded_text(q) for q in queries])
    return encoder.embed(queries) @ encoder.embed(keys).T


def recall_at_1(backend: str, encoder, pairs: list[tuple[str, str]]) -> float:
    """Share of (query, target) pairs whose top-1 among all distinct targets is its own (ties: the first)."""
    corpus = list(dict.fromkeys(t for _, t in pairs))
    top = score_matrix(backend, encoder, corpus, [q for q, _ in pairs]).argmax(axis=1)
    return float(np.mean([corpus[j] == t for j, (_, t) in zip(top, pairs)]))


def history_next_step(question: str, steps: list[str]) -> list[tuple[str, str]]:
    """(history, next step) pairs of one solution: the question and its steps so far -> the step that follows
    (what a stored key leads to)."""
    return [(" ".join([question, *steps[:i]]), steps[i]) for i in range(len(steps))]


def gsm8k_pairs(limit: int) -> dict[str, list[tuple[str, str]]]:
    rows = gsm8k_solutions(GSM8K_TRAIN, limit)
    question_solution = [(ex.question, solution) for ex, solution in rows]
    history_step = []
    for ex, solution in rows:
        history_step += history_next_step(
            ex.question, [f"{s.thought} {s.expression}" for s in gsm8k_calc_steps(solution)]
        )
    return {"gsm8k question -> solution": question_solution, "gsm8k history -> next step": history_step}


def multihop_pairs(size: int) -> list[tuple[str, str]]:
    pairs = []
    for problem in bundled.generate("multihop", "train", size, seed=0):
        steps = [f"{thought} {call} {result}" for thought, _, call, result in problem.expert_steps]
        pairs += history_next_step(problem.question, steps)
    return pairs


def buffer_keys(milvus_dir: Path, collection: str | None) -> tuple[str, list[dict]]:
    """(collection, rows with id/key/question_id) of the buffer in the milvus-lite folder ``milvus_dir``."""
    if collection is None:
        manifests = sorted(milvus_dir.glob("manifest-*.json"))
        if len(manifests) != 1:
            sys.exit(f"--milvus-dir {milvus_dir}: {len(manifests)} buffer manifests; name one with --collection")
        collection = manifests[0].stem.removeprefix("manifest-")
    server = MilvusLiteServer(milvus_dir)
    try:
        return collection, collection_rows(server.uri, collection, ["id", "key", "question_id"])
    finally:
        server.stop()


def quality(args, cfg, backends, encoders, keys, queries) -> dict:
    scope = cfg.retrieval.question_scope
    qids = np.array([r["question_id"] for r in keys])
    allowed = np.ones((len(queries), len(keys)), dtype=bool)
    if scope != "any":
        same = qids[None, :] == np.array([q["question_id"] for q in queries])[:, None]
        allowed = ~same if scope == "other" else same
    key_texts = [r["key"] for r in keys]
    query_texts = [q["text"] for q in queries]
    out, reference = {}, None
    proxies = {**gsm8k_pairs(args.gsm8k), "multihop history -> next step": multihop_pairs(args.multihop)}
    for backend in backends:
        enc = encoders[backend]
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        scores = score_matrix(backend, enc, key_texts, query_texts)
        seconds = time.perf_counter() - t0
        scores = np.where(allowed, scores, -np.inf)
        if reference is None:
            reference = scores  # minilm comes first
        top1 = scores.argmax(axis=1)
        best = reference.max(axis=1)
        agree = np.isclose(reference[np.arange(len(queries)), top1], best, atol=1e-6)
        out[backend] = {
            "top1_agree_with_minilm": float(agree.mean()),
            "texts_per_s": (len(key_texts) + len(query_texts)) / seconds,
            "load_average_1min": load,
            **{f"R@1 {name}": recall_at_1(backend, enc, pairs) for name, pairs in proxies.items()},
        }
        print(backend, json.dumps({k: round(v, 3) for k, v in out[backend].items()}), flush=True)
    out["pairs"] = {name: len(pairs) for name, pairs in proxies.items()}
    return out


def latency(args, backends, files, keys, queries) -> dict:
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}},
        log_to_driver=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": 0}, logging_config=SERVE_LOGGING)
    settings = args.serve_settings.split(",")
    out: dict = {setting: {} for setting in settings}
    try:
        for backend in backends:
            for setting in settings:  # in turn per backend, so that a change in the box's load hits both
                # One milvus-lite server per deployment: a server kept across backends dropped the driver's
                # connection (gRPC GOAWAY "too_many_pings") while the previous backend was under load.
                server = MilvusLiteServer(Path(args.scratch) / "milvus" / f"{backend}-{setting}")
                try:
                    out[setting][backend] = backend_latency(
                        args, backend, setting, files[backend], server.uri, keys, queries
                    )
                finally:
                    serve.delete("bench")
                    server.stop()
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def replica_cpu_s() -> float:
    """CPU seconds (user + system) used so far by the processes of the benchmark app's replicas, found by their
    process titles."""
    total = 0.0
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [""])[0].startswith("ray::ServeReplica:bench:"):
            with contextlib.suppress(psutil.Error):  # gone meanwhile
                times = proc.cpu_times()
                total += times.user + times.system
    return total


def backend_latency(args, backend: str, setting: str, files, uri: str, keys, queries) -> dict:
    """One backend's Serve deployment over the run's keys, deployed and called with ``setting``
    (``--serve-settings``), loaded by 1/8/32 closed-loop clients."""
    cfg = load_config(
        overrides=[
            f"retrieval.collection=bench_{backend.replace('-', '_')}",
            f"retrieval.embedder={backend}",
            "retrieval.embed_cache_size=0",
        ]
    )
    enc = make_encoder(backend, files, cfg.retrieval.pooling, cfg.retrieval.query_max_chars)
    store = MilvusStepStore(uri, cfg.retrieval.collection, dim=enc.dim)
    steps = [StoredStep(r["key"], "<think>x</think>", [0], 1.0, r["question_id"], 0, "bench") for r in keys]
    store.upsert_rows(step_rows(steps, enc.embed([s.key for s in steps])))
    store.flush()
    store.close()
    ours = setting != "ray-defaults"  # deployed and called as a run does (rapo-per-call without coalescing)
    # Serve's defaults: ours without the runtime_env that moves user code onto the replica's own loop
    defaults = {k: v for k, v in replica_actor_options(cfg.retrieval).items() if k != "runtime_env"}
    app = build_app(cfg.retrieval, uri, embedder_files=files, actor_options=None if ours else defaults)
    serve.run(app, name="bench", route_prefix="/b", logging_config=SERVE_LOGGING)
    handle = serve.get_deployment_handle("StepRetriever", app_name="bench")
    handle = handle.options(**HANDLE_OPTIONS) if ours else handle
    retriever = HandleStepRetriever(handle, max_chars=cfg.retrieval.query_max_chars, coalesce=setting == "rapo")
    texts = [q["text"] for q in queries]
    out = {}
    for clients in [int(c) for c in args.clients.split(",")]:
        lat, lock, stop = [], threading.Lock(), time.perf_counter() + args.seconds

        def client(k, lat=lat, lock=lock, stop=stop):
            i = k
            while time.perf_counter() < stop:
                t = time.perf_counter()
                retriever.retrieve([texts[i % len(texts)]])
                with lock:
                    lat.append(time.perf_counter() - t)
                i += clients

        mine, replica, requests = os.times(), replica_cpu_s(), retriever.requests
        wall = run_clients(client, clients)
        mine_s = sum(os.times()[:2]) - sum(mine[:2])  # this process's user + system CPU: the clients and their router
        replica_s = replica_cpu_s() - replica
        lat.sort()
        out[clients] = {
            "calls": len(lat),
            "requests": retriever.requests - requests,
            "calls_per_s": len(lat) / wall,
            "p50_ms": percentile_ms(lat, 0.5),
            "p99_ms": percentile_ms(lat, 0.99),
            "clients_cpu_ms_per_call": 1000 * mine_s / max(len(lat), 1),
            "replica_cpu_ms_per_call": 1000 * replica_s / max(len(lat), 1),
        }
        print(setting, backend, clients, json.dumps({k: round(v, 2) for k, v in out[clients].items()}), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path, help="a finished RAPO run directory")
    ap.add_argument("--milvus-dir", type=Path, default=None, help="its buffer's milvus-lite folder (or a copy)")
    ap.add_argument("--collection", default=None, help="the buffer's collection (default: the folder's only one)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a model folder (default: the run's last checkpoint)")
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, of: {', '.join(BACKENDS)}")
    ap.add_argument("--parts", default="quality,latency", help="quality, latency or both")
    ap.add_argument("--gsm8k", type=int, default=1000, help="GSM8K training problems in the proxies")
    ap.add_argument("--multihop", type=int, default=1000, help="bundled multihop problems in the proxy")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument(
        "--serve-settings",
        default="rapo",
        help=f"comma-separated, of: {', '.join(SERVE_SETTINGS)} (see above)",
    )
    ap.add_argument("--seconds", type=float, default=15.0, help="per load level")
    ap.add_argument("--threads", type=int, default=1, help="torch / onnxruntime threads (a replica uses 1)")
    ap.add_argument("--scratch", default=str(REPO / "artifacts" / "bench_retrieval_backends"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "retrieval_backends.json")
    args = ap.parse_args()
    backends = ["minilm"] + [b for b in args.backends.split(",") if b and b != "minilm"]  # minilm: the reference
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        sys.exit(f"--backends: unknown {unknown}; valid: {list(BACKENDS)}")
    bad = set(args.serve_settings.split(",")) - set(SERVE_SETTINGS)
    if bad:
        sys.exit(f"--serve-settings: unknown {sorted(bad)}; valid: {', '.join(SERVE_SETTINGS)}")
    parts = set(args.parts.split(","))
    if not parts or parts - {"quality", "latency"}:
        sys.exit(f"--parts {args.parts!r}: give quality, latency or both")
    if not (args.run / "config.yaml").is_file():
        sys.exit(f"--run {args.run}: no config.yaml there (not a run directory)")
    checkpoints = sorted((args.run / "checkpoints").glob("step-*"))
    tokenizer_dir = args.tokenizer or (checkpoints[-1] if checkpoints else None)
    if tokenizer_dir is None:
        sys.exit(f"--run {args.run}: no checkpoints/step-* to read the tokenizer from; give --tokenizer")
    torch.set_num_threads(args.threads)
    cfg = load_config(args.run / "config.yaml", [])
    milvus_dir = args.milvus_dir or Path(cfg.run.artifacts_dir) / "milvus"
    collection, keys = buffer_keys(milvus_dir, args.collection)
    pool, _ = rl_task_pool(cfg)
    question_of = {t.id: t.question for ts in pool.values() for t in ts}
    queries = run_queries(args.run, load_tokenizer(tokenizer_dir))
    max_chars = cfg.retrieval.query_max_chars
    for q in queries:
        q["text"] = query_text(question_of[q["question_id"]], q["history"], max_chars)
    if not keys or not queries:
        sys.exit(f"{args.run}: {len(keys)} stored steps and {len(queries)} retrievals: nothing to measure")
    print(f"{len(keys)} stored steps in {collection}, {len(queries)} retrievals of {args.run}", flush=True)
    files = {b: prepare_backend(b, args.scratch, cfg.retrieval.pooling) for b in backends}
    report = {
        "run": str(args.run),
        "collection": collection,
        "stored_steps": len(keys),
        "retrievals": len(queries),
        "question_scope": cfg.retrieval.question_scope,
        "threads": args.threads,
        "machine": machine_record(),
    }
    if "quality" in parts:
        encoders = {b: make_encoder(b, files[b], cfg.retrieval.pooling, max_chars) for b in backends}
        report["quality"] = quality(args, cfg, backends, encoders, keys, queries)
    if "latency" in parts:
        report["latency"] = latency(args, backends, files, keys, queries)
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
