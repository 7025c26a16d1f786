"""Retrieval query forms: how often a cheaper query finds the same stored step as the full history (issue #21).

    python benchmarks/bench_query_forms.py --run runs/rapo-...  [--out benchmarks/results/query_forms.json]

Reads a finished RAPO run: its step buffer (every stored key, from the run's Milvus collection, started as a
milvus-lite server over ``<artifacts>/milvus`` unless ``retrieval.milvus_uri`` names one) and every retrieval its
hybrid rollouts made (the history before each ``<retrieve>`` block, rebuilt from ``trajectories/*.parquet``). For
each query form (``QUERY_FORMS`` below, plus tails of the full form cut shorter) it embeds the
buffer's keys and the run's queries the same way, searches exactly (inner product, the run's question scope),
and reports:

- ``top1_agree``: the form's top-1 step is one the full form ranks first too (ties in the full form's score
  count: steps with the same key text tie, and either is the full form's answer);
- ``top5_overlap``: mean share of the full form's top-5 steps in the form's top-5;
- tokens per query and the measured embedding throughput (texts/s, this process's threads, batch 8) of the form,
  with ``incremental`` charged only the chunks not embedded before (its per-trajectory cache).

It also reports, over all of the run's retrievals in run order, how a replica gets the full form's vectors
(``reuse``): the share of queries equal to a stored key (the replica hands back the stored vector), the share
repeating an earlier query (its cache, unbounded here), and the share it must embed with and without the
stored keys.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch

from rapo_ray.agent.retriever import query_text as full_query

# Query forms compared with the full history (the run's own, ``rapo_ray.agent.retriever.query_text``).
QUERY_FORMS = ("full", "question_last_step", "last_step", "incremental")
_CHUNK_ENDS = ("</result>", "</retrieve>")


def history_chunks(history: str) -> list[str]:
    """A decoded history cut into its steps: a chunk ends after each tool result and each retrieved block (text
    after the last one is a chunk of its own when not empty)."""
    chunks, start, i = [], 0, 0
    while i < len(history):
        end = next((tag for tag in _CHUNK_ENDS if history.startswith(tag, i)), None)
        if end is None:
            i += 1
            continue
        i += len(end)
        chunks.append(history[start:i])
        start = i
    if start < len(history):
        chunks.append(history[start:])
    return chunks


def query_text(question: str, history: str, form: str, max_chars: int) -> str:
    """``full``: what a run embeds; ``question_last_step``: the question and the history's last step;
    ``last_step``: that step alone (the question before the first step). ``incremental`` is embedded per chunk
    (``embed_form``)."""
    if form in ("full", "full_int8"):
        return full_query(question, history, max_chars)
    last = (history_chunks(history) or [""])[-1]
    if form == "question_last_step":
        return (question + last)[-max_chars:]
    return (last or question)[-max_chars:]


def load_run(run: Path):
    from rapo_ray.config import load_config

    return load_config(run / "config.yaml", [])


def stored_keys(cfg) -> list[dict]:
    """Every row's key, question id and value of the run's buffer collection."""
    server = None
    uri = cfg.retrieval.milvus_uri
    if not uri:
        from rapo_ray.retrieval.store import MilvusLiteServer

        server = MilvusLiteServer(Path(cfg.run.artifacts_dir) / "milvus")
        uri = server.uri
    try:
        from rapo_ray.launch.launcher import starting_policy
        from rapo_ray.pipelines.buffer import buffer_collection

        collection = buffer_collection(cfg, str(starting_policy(cfg)))  # the run's (cached starting policy)
        return collection_rows(uri, collection, ["id", "key", "question_id", "value"], cfg.retrieval.milvus_token)
    finally:
        if server is not None:
            server.stop()


def collection_rows(uri: str, collection: str, fields: list[str], token: str = "") -> list[dict]:
    """Every row of a Milvus collection (``fields`` of each, ``id`` among them), in id order."""
    from pymilvus import MilvusClient

    client = MilvusClient(uri=uri, token=token or "")
    try:
        client.load_collection(collection)
        it = client.query_iterator(collection, batch_size=2000, filter="", output_fields=fields)
        rows = []
        while batch := it.next():
            rows.extend(batch)
        it.close()
    finally:
        client.close()
    return sorted(rows, key=lambda r: r["id"])


def run_queries(run: Path, tokenizer) -> list[dict]:
    """One entry per retrieval of the run: question id, history (text before the retrieved block), trajectory."""
    import pyarrow.parquet as pq

    out = []
    for f in sorted((run / "trajectories").glob("step-*.parquet")):
        for row in pq.read_table(f).to_pylist():
            for seg in row["segments"]:
                kind, s = seg["kind"], seg["start"]
                if kind == "retrieved":
                    out.append(
                        {
                            "traj": f"{f.stem}:{row['group_id']}:{row['slot']}",
                            "question_id": row["problem_id"],
                            "history": tokenizer.decode(row["response_ids"][:s], skip_special_tokens=False),
                        }
                    )
    return out


def int8_copy(embedder):
    """A copy of ``embedder`` whose MiniLM runs its linear layers in int8 (torch's dynamic quantization)."""
    import copy
    import warnings

    out = copy.copy(embedder)
    out._cache = type(embedder._cache)()
    with warnings.catch_warnings():  # torch marks its quantized tensors deprecated (still there in 2.13)
        warnings.simplefilter("ignore")
        out.model = torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(embedder.model), {torch.nn.Linear}, dtype=torch.qint8
        )
    return out


def reuse_shares(queries: list[str], keys: list[str]) -> dict:
    """Shares of ``queries`` (embedded texts, in run order) that equal a stored key, that repeat an earlier
    query, and that a replica embeds without and with the stored keys' vectors."""
    stored = set(keys)
    seen: set[str] = set()
    key_hits = repeats = embedded_with_keys = 0
    for q in queries:
        key_hits += q in stored
        repeats += q in seen
        embedded_with_keys += q not in stored and q not in seen
        seen.add(q)
    n = max(len(queries), 1)
    return {
        "queries": len(queries),
        "equal_a_stored_key": key_hits / n,
        "repeat_an_earlier_query": repeats / n,
        "embedded_cache_only": (len(queries) - repeats) / n,
        "embedded_cache_and_keys": embedded_with_keys / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path, help="a finished RAPO run directory")
    ap.add_argument("--tails", default="700,400,200", help="shorter tails of the full form to try (characters)")
    ap.add_argument(
        "--max-queries", type=int, default=800, help="a seeded sample of the run's retrievals (0: all of them)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the embedding-speed figures")
    ap.add_argument("--out", type=Path, default=None, help="JSON report")
    ap.add_argument(
        "--int8",
        action="store_true",
        help="also the full form embedded by MiniLM with int8 dynamically quantized linear layers (form full_int8)",
    )
    args = ap.parse_args()
    if not (args.run / "config.yaml").is_file():
        sys.exit(f"--run {args.run}: no config.yaml there (not a run directory)")
    torch.set_num_threads(args.threads)

    from rapo_ray.model.factory import load_tokenizer
    from rapo_ray.retrieval.embedder import Embedder
    from rapo_ray.retrieval.key_text import preprocess
    from rapo_ray.training.trainer import rl_task_pool

    cfg = load_run(args.run)
    checkpoints = sorted((args.run / "checkpoints").glob("step-*"))
    if not checkpoints:
        sys.exit(f"--run {args.run}: no checkpoints/step-* (the tokenizer is read from one)")
    tokenizer = load_tokenizer(checkpoints[-1])
    pool, _ = rl_task_pool(cfg)
    question_of = {t.id: t.question for ts in pool.values() for t in ts}
    rows = stored_keys(cfg)
    queries = run_queries(args.run, tokenizer)
    n_all = len(queries)
    max_chars = cfg.retrieval.query_max_chars
    embedded = [
        preprocess(full_query(question_of[q["question_id"]], q["history"], max_chars), max_chars) for q in queries
    ]
    reuse = reuse_shares(embedded, [preprocess(r["key"], max_chars) for r in rows])
    print(
        f"reuse over all {n_all} retrievals: {reuse['equal_a_stored_key']:.1%} equal a stored key, "
        f"{reuse['repeat_an_earlier_query']:.1%} repeat an earlier query; embedded "
        f"{reuse['embedded_cache_only']:.1%} (cache) -> {reuse['embedded_cache_and_keys']:.1%} (cache + stored keys)"
    )
    if args.max_queries and len(queries) > args.max_queries:  # whole trajectories, so incremental's cache is real
        per_traj = Counter(q["traj"] for q in queries)
        trajs = sorted(per_traj)
        random.Random(0).shuffle(trajs)
        keep, kept = set(), 0
        for t in trajs:
            if kept >= args.max_queries:
                break
            keep.add(t)
            kept += per_traj[t]
        queries = [q for q in queries if q["traj"] in keep]
    if not rows or not queries:
        sys.exit(f"{args.run}: {len(rows)} stored steps and {len(queries)} retrievals: nothing to compare")
    for q in queries:
        q["question"] = question_of[q["question_id"]]
    for r in rows:
        qtext = question_of.get(r["question_id"], "")
        if not r["key"].startswith(qtext):
            raise SystemExit(f"stored step {r['id']}: its key does not start with its question's text")
        r["question"], r["history"] = qtext, r["key"][len(qtext) :]
    print(f"{len(rows)} stored steps, {len(queries)} of the {n_all} retrievals of {args.run}")

    embedder = Embedder(pooling=cfg.retrieval.pooling, max_chars=10**9)
    forms = [(f, max_chars) for f in QUERY_FORMS] + [("full", int(c)) for c in args.tails.split(",") if c]
    embedders = {"full_int8": int8_copy(embedder)} if args.int8 else {}
    forms += [(f, max_chars) for f in embedders]
    scope = cfg.retrieval.question_scope

    # masks for the question scope (any / other / own), one row per query
    qids = np.array([r["question_id"] for r in rows])
    allowed = np.ones((len(queries), len(rows)), dtype=bool)
    if scope != "any":
        same = qids[None, :] == np.array([q["question_id"] for q in queries])[:, None]
        allowed = ~same if scope == "other" else same

    def embed_form(form: str, chars: int, items: list[dict], cache: dict | None = None) -> tuple[np.ndarray, int]:
        """Vectors for ``items`` under a form; the second value is how many tokens had to be embedded."""
        if form != "incremental":
            emb = embedders.get(form, embedder)
            texts = [query_text(it["question"], it["history"], form, chars) for it in items]
            ntok = sum(len(emb.tokenizer(t, truncation=True, max_length=emb.max_length)["input_ids"]) for t in texts)
            return emb.embed(texts), ntok
        cache = {} if cache is None else cache
        vecs, ntok = np.zeros((len(items), embedder.dim), dtype=np.float32), 0
        for i, it in enumerate(items):
            chunks = [it["question"]] + history_chunks(it["history"])
            new = [c for c in dict.fromkeys(chunks) if c not in cache]
            if new:
                for c, v in zip(new, embedder.embed(new)):
                    cache[c] = v
                ntok += sum(
                    len(embedder.tokenizer(c, truncation=True, max_length=embedder.max_length)["input_ids"])
                    for c in new
                )
            v = np.mean([cache[c] for c in chunks], axis=0)
            vecs[i] = v / max(float(np.linalg.norm(v)), 1e-12)
        return vecs, ntok

    results, ref = {}, None
    for form, chars in forms:
        name = form if (form != "full" or chars == max_chars) else f"tail_{chars}"
        t0 = time.perf_counter()
        keys, _ = embed_form(form, chars, rows)
        # queries in run order; incremental keeps one cache per trajectory (what a rollout would hold)
        if form == "incremental":
            by_traj: dict[str, dict] = defaultdict(dict)
            qv, qtok = np.zeros((len(queries), embedder.dim), dtype=np.float32), 0
            for i, q in enumerate(queries):
                v, n = embed_form(form, chars, [q], by_traj[q["traj"]])
                qv[i], qtok = v[0], qtok + n
        else:
            qv, qtok = embed_form(form, chars, queries)
        elapsed = time.perf_counter() - t0
        scores = qv @ keys.T
        scores[~allowed] = -np.inf
        top5 = np.argsort(-scores, axis=1, kind="stable")[:, :5]
        if ref is None:  # the full form comes first
            ref = {"scores": scores, "top5": top5}
        best_full = ref["scores"].max(axis=1)
        top1 = top5[:, 0]
        agree = np.isclose(ref["scores"][np.arange(len(queries)), top1], best_full, atol=1e-6)
        overlap = [len(set(a) & set(b)) / 5 for a, b in zip(top5, ref["top5"])]
        # embedding speed of this form's queries alone, batch 8 (a lockstep wave's size)
        sample = queries[: min(64, len(queries))]
        t1 = time.perf_counter()
        if form == "incremental":
            speed_cache: dict[str, dict] = defaultdict(dict)
            for q in sample:
                embed_form(form, chars, [q], speed_cache[q["traj"]])
        else:
            texts = [query_text(q["question"], q["history"], form, chars) for q in sample]
            for i in range(0, len(texts), 8):
                embedders.get(form, embedder).embed(texts[i : i + 8])
        per_query_ms = (time.perf_counter() - t1) * 1000 / len(sample)
        results[name] = {
            "top1_agree": float(agree.mean()),
            "top5_overlap": float(np.mean(overlap)),
            "tokens_per_query": qtok / len(queries),
            "embed_ms_per_query": per_query_ms,
            "seconds_total": elapsed,
        }
        r = results[name]
        print(
            f"{name:20s} top-1 agree {r['top1_agree']:.3f}  top-5 overlap {r['top5_overlap']:.3f}  "
            f"{r['tokens_per_query']:6.1f} tokens/query  {r['embed_ms_per_query']:6.1f} ms/query"
        )
    report = {
        "run": str(args.run),
        "stored_steps": len(rows),
        "retrievals": n_all,
        "retrievals_compared": len(queries),
        "question_scope": scope,
        "reuse": reuse,
        "threads": args.threads,
        "forms": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
