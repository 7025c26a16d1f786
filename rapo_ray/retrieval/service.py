"""The retrieval service: a Ray Serve deployment over the Milvus step store, batched with ``@serve.batch``.

- DeploymentHandle API (what rollout workers use, through ``rapo_ray.retrieval.client``):
  ``handle.retrieve.remote(queries, top_k, question_ids)``
- HTTP: ``POST /retrieve {"queries": [...], "top_k": k}`` -> ``{"results": [[{value, score, reward, meta}]]}``
Concurrent callers' queries are embedded and searched together; the batch size and wait come from config.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Sequence

import numpy as np
from ray import serve

from rapo_ray.agent.retriever import RetrievedStep, StoredStep
from rapo_ray.retrieval.backends import is_lexical, make_encoder, replica_index
from rapo_ray.retrieval.store import MilvusStepStore, step_rows


def _as_dict(hit: RetrievedStep) -> dict:
    d = asdict(hit)
    return {
        "value": d["value"],
        "value_ids": d["value_ids"],
        "score": d["score"],
        "reward": d["reward"],
        "meta": {"question_id": d["question_id"], "noise": d["noise"]},
    }


@serve.deployment(name="StepRetriever", ray_actor_options={"num_cpus": 0})
class StepRetrieverService:
    def __init__(
        self,
        uri: str,
        collection: str,
        token: str = "",
        pooling: str = "last",
        max_chars: int = 1300,
        top_k: int = 3,
        max_batch_size: int = 256,
        batch_wait_ms: float = 5.0,
        batching: bool = True,
        search_on: str = "replica",
        num_gpus: float = 0.0,
        embed_cache_size: int = 0,
        embedder: str = "minilm",
        embedder_files: str = "",
    ):
        if search_on not in ("replica", "milvus"):
            raise ValueError(f"retrieval.search_on={search_on!r}; valid: replica, milvus")
        self.lexical = is_lexical(embedder)
        if self.lexical and search_on != "replica":
            raise ValueError(
                f"retrieval.embedder={embedder} ranks in the replica's memory: set retrieval.search_on=replica"
            )
        device = "cpu"
        if not self.lexical:  # a network: torch, on one thread (a BM25 replica never imports torch)
            import torch

            from rapo_ray.core.devices import pick_device

            torch.set_num_threads(1)
            device = pick_device(num_gpus, "retrieval.num_gpus")
        self.embedder = make_encoder(
            embedder, embedder_files, pooling, max_chars, device=device, cache_size=embed_cache_size
        )
        self.store = MilvusStepStore(uri, collection, self.embedder.dim, token=token, create=True)
        # Searches go to an in-memory copy (exact, milliseconds) or to Milvus's HNSW index. The copy also hands
        # back the stored vector of a query that equals a stored key, instead of embedding it again. BM25 ranks
        # the copy's key texts.
        self.index = replica_index(embedder, self.store, self.embedder) if search_on == "replica" else None
        self.key_hits = 0
        self.top_k = top_k
        self.batching = batching
        self._batched.set_max_batch_size(max_batch_size)
        self._batched.set_batch_wait_timeout_s(batch_wait_ms / 1000.0)

    def _search(self, items: Sequence[tuple[list[str], int, list | None]]) -> list[list[list[dict]]]:
        flat, owners = [], []
        for k, (queries, _, _) in enumerate(items):
            flat.extend(queries)
            owners.extend([k] * len(queries))
        if not flat:
            return [[] for _ in items]
        top = max(t for _, t, _ in items)
        filters = []
        for queries, _, scope in items:
            filters.extend([tuple(f) if f else None for f in scope] if scope else [None] * len(queries))
        scope = filters if any(filters) else None
        if self.lexical:
            hits = self.index.search_texts(flat, top, question_filter=scope)
        else:
            hits = (self.index or self.store).search(self._vectors(flat), top, question_filter=scope)
        out: list[list[list[dict]]] = [[] for _ in items]
        for owner, row in zip(owners, hits):
            out[owner].append([_as_dict(h) for h in row[: items[owner][1]]])
        return out

    def _vectors(self, texts: list[str]) -> np.ndarray:
        """[N, dim] query vectors: a stored key's vector where the query equals one, else the embedder's."""
        known = self.index.key_vectors(texts) if self.index is not None else [None] * len(texts)
        todo = [i for i, v in enumerate(known) if v is None]
        out = np.zeros((len(texts), self.embedder.dim), dtype=np.float32)
        for i, v in enumerate(known):
            if v is not None:
                out[i] = v
        if todo:
            out[todo] = self.embedder.embed([texts[i] for i in todo])
        self.key_hits += len(texts) - len(todo)
        return out

    def embed_stats(self) -> dict:
        """How this replica's query vectors were made so far: from a stored key, from its cache, embedded."""
        e = self.embedder
        return {"key_hits": self.key_hits, "cache_hits": e.cache_hits, "embedded": e.cache_misses}

    @serve.batch(max_batch_size=256, batch_wait_timeout_s=0.1)
    async def _batched(self, items: list[tuple[list[str], int, list | None]]) -> list[list[list[dict]]]:
        return self._search(items)

    async def retrieve(
        self, queries: list[str], top_k: int | None = None, question_filter: list | None = None
    ) -> list[list[dict]]:
        """Top-k stored steps per query; ``question_filter[i]``: None, ("other", question id) or ("own", question id)."""
        if question_filter is not None and len(question_filter) != len(queries):
            raise ValueError(f"question_filter has {len(question_filter)} entries for {len(queries)} queries")
        item = (list(queries), int(top_k or self.top_k), list(question_filter) if question_filter else None)
        if self.batching:
            return await self._batched(item)
        return self._search([item])[0]

    def count(self) -> int:
        return self.store.count()

    def insert(self, steps: list[dict]) -> int:
        """Embed and upsert steps (``StoredStep`` fields) into the buffer: RAPO's optional insertion of
        successful on-policy steps during training. Idempotent: a step already stored is not added twice."""
        stored = [StoredStep(**s) for s in steps]
        if not stored:
            return 0
        rows = step_rows(stored, self.embedder.embed([r.key for r in stored]))
        n = self.store.upsert_rows(rows)
        self.store.flush()
        if self.index is not None:
            self.index.add_rows(rows)
        return n

    def sample(self, n: int, seed: int = 0) -> list[dict]:
        return [_as_dict(h) for h in self.store.random_steps(n, seed)]

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        try:
            body = await request.json()
        except Exception:
            return JSONResponse({"error": "body must be JSON"}, status_code=400)
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("queries"), list)
            or not all(isinstance(q, str) for q in body["queries"])
        ):
            return JSONResponse({"error": "'queries' must be a list of strings"}, status_code=400)
        top_k = body.get("top_k", self.top_k)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not (1 <= top_k <= 100):
            return JSONResponse({"error": "'top_k' must be an integer in [1, 100]"}, status_code=400)
        if len(body["queries"]) > 1024:
            return JSONResponse({"error": "at most 1024 queries per request"}, status_code=400)
        return JSONResponse({"results": await self.retrieve(body["queries"], top_k)})

    def check_health(self):
        self.store.count()  # raises if Milvus went away; Serve restarts the replica


def replica_actor_options(rcfg) -> dict:
    """A replica's Ray actor options for ``RetrievalConfig`` ``rcfg``. A lexical search takes about a millisecond,
    so the replica runs it on its own event loop instead of a second thread (Ray Serve's throughput-optimized
    setting), saving a thread hop per request; an embedder's forward pass (tens to hundreds of milliseconds on a
    CPU) would stall the replica's control loop there."""
    options = {"num_cpus": 0, "num_gpus": rcfg.num_gpus}
    if is_lexical(rcfg.embedder):
        options["runtime_env"] = {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}
    return options


def build_app(rcfg, uri: str, batching: bool = True, embedder_files: str = "", actor_options: dict | None = None):
    """The Serve application for ``RetrievalConfig`` ``rcfg`` over the store at ``uri``; ``embedder_files``: what
    ``prepare_backend`` returned for ``rcfg.embedder``; ``actor_options``: the replicas' Ray actor options instead of
    ``replica_actor_options(rcfg)`` (a benchmark compares them)."""
    return StepRetrieverService.options(
        autoscaling_config={
            "min_replicas": rcfg.min_replicas,
            "max_replicas": rcfg.max_replicas,
            "target_ongoing_requests": rcfg.target_ongoing_requests,
        },
        max_ongoing_requests=max(rcfg.max_batch_size, 64),
        ray_actor_options=replica_actor_options(rcfg) if actor_options is None else actor_options,
    ).bind(
        uri,
        rcfg.collection,
        rcfg.milvus_token,
        rcfg.pooling,
        rcfg.query_max_chars,
        rcfg.top_k,
        rcfg.max_batch_size,
        rcfg.batch_wait_ms,
        batching,
        rcfg.search_on,
        rcfg.num_gpus,
        rcfg.embed_cache_size,
        rcfg.embedder,
        embedder_files,
    )
