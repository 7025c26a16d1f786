"""Exact inner-product search over an in-memory copy of a Milvus step collection.

Milvus stays the buffer's store of record (the builder writes it, inserts go to it, other processes read it);
a retrieval replica with ``retrieval.search_on=replica`` loads the collection's vectors and payloads once at
start-up and answers searches with one matrix product, keeping its copy current with its own inserts. Why: on a
CPU a milvus-lite search is far slower than one product over the whole buffer's vectors, which is also exact
(recall 1 by construction). The copy costs one 384-float vector plus the payload text per step: fine up to a few
million steps; beyond that, search in Milvus (``search_on=milvus``: HNSW on a Milvus server).

The copy also answers "is this query a stored key?" (``key_vectors``): a query whose embedded text equals a
stored step's key gets that step's vector instead of being embedded again. In a hybrid rollout that happens
whenever the policy's history so far is, token for token, an off-policy trajectory's (a warm-started policy often
writes the expert's first steps exactly; docs/RESULTS.md, Performance).
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable, Sequence

import numpy as np

from rapo_ray.agent.retriever import RetrievedStep
from rapo_ray.retrieval.lexical import Bm25Index
from rapo_ray.retrieval.store import KEY_CHARS

_FIELDS = ["id", "vector", "key", "value", "value_ids", "reward", "question_id"]


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class ReplicaIndex:
    keys_required = False  # whether every added row must carry its key text (a subclass that ranks by it)

    def __init__(self, dim: int, key_text: Callable[[str], str] | None = None):
        """``key_text``: what the embedder embeds of a text (``Embedder.embedded_text``); given, stored keys are
        indexed by it so that ``key_vectors`` can answer queries equal to a key. The stored vectors must come from
        that same embedder and settings (the launcher checks the buffer manifest's fingerprint for this)."""
        self.dim = dim
        self.key_text = key_text
        self._row_of_key: dict[bytes, int] = {}  # digest of a stored key's embedded text -> its row
        self._vectors = np.zeros((0, dim), dtype=np.float32)
        self._n = 0
        self._row_of: dict[str, int] = {}
        self._payload: list[tuple[str, str, float, str]] = []  # value, value_ids JSON, reward, question_id
        self._rows_of_question: dict[str, set[int]] = {}  # for question_scope=own: no scan over every row
        self._max_id = ""  # rows are kept in id order (ties rank by row): a smaller new id renumbers them

    @classmethod
    def from_store(cls, store, batch_size: int = 2000, key_text: Callable[[str], str] | None = None) -> "ReplicaIndex":
        """Copy every row of ``store``'s collection (a ``MilvusStepStore``) into memory."""
        index = cls(store.dim, key_text)
        it = store.client.query_iterator(store.collection, batch_size=batch_size, filter="", output_fields=_FIELDS)
        try:
            while rows := it.next():
                index.add_rows(rows)  # rows come in no fixed order; ``add`` keeps them in id order
        finally:
            it.close()
        return index

    def _order_rows_by_id(self) -> np.ndarray:
        """Renumber rows in id order. A search breaks score ties by row order, and Milvus's iterator returns rows
        in no fixed order: without this, two replicas (or two runs) loading one collection, or a replica that
        inserted steps and the one restarted after it, could hand different steps of equal score to the same query
        (RESULTS, The default run)."""
        order = sorted(self._row_of, key=lambda i: i)
        new_of_old = np.empty(self._n, dtype=np.int64)
        for new, i in enumerate(order):
            new_of_old[self._row_of[i]] = new
        old_rows = np.argsort(new_of_old)
        self._vectors[: self._n] = self._vectors[old_rows]
        self._payload = [self._payload[r] for r in old_rows]
        self._row_of = {i: int(new_of_old[r]) for i, r in self._row_of.items()}
        self._rows_of_question = {q: {int(new_of_old[r]) for r in rows} for q, rows in self._rows_of_question.items()}
        self._row_of_key = {k: int(new_of_old[r]) for k, r in self._row_of_key.items()}
        return old_rows  # row i is now what row old_rows[i] was

    def add_rows(self, rows: Sequence[dict]) -> None:
        """Add collection rows (``store.step_rows`` output, or rows read back from Milvus)."""
        self.add(
            [r["id"] for r in rows],
            np.asarray([r["vector"] for r in rows], dtype=np.float32).reshape(len(rows), -1),
            [(r["value"], r["value_ids"], float(r["reward"]), r["question_id"]) for r in rows],
            [r.get("key") for r in rows],
        )

    def __len__(self) -> int:
        return self._n

    def add(
        self,
        ids: Sequence[str],
        vectors: np.ndarray,
        payloads: Sequence[tuple[str, str, float, str]],
        keys: Sequence[str | None] | None = None,
    ) -> None:
        """Insert or replace rows by id (the same upsert semantics as the collection). ``keys``: the rows' key
        texts as stored (None: unknown), for ``key_vectors``."""
        keys = [None] * len(ids) if keys is None else keys
        if self.keys_required and any(k is None for k in keys):
            raise ValueError(f"{type(self).__name__} ranks by key text: every added row needs its key")
        if not (len(ids) == len(vectors) == len(payloads) == len(keys)):
            raise ValueError(f"{len(ids)} ids, {len(vectors)} vectors, {len(payloads)} payloads and {len(keys)} keys")
        if len(ids) and vectors.shape[1] != self.dim:
            raise ValueError(f"vectors have dim {vectors.shape[1]}, the index has {self.dim}")
        out_of_order = False
        for i, v, p, key in zip(ids, vectors, payloads, keys):
            row = self._row_of.get(i)
            if row is None:
                out_of_order |= self._n > 0 and i < self._max_id
                self._max_id = max(self._max_id, i)
                row = self._row_of[i] = self._n
                self._n += 1
                self._payload.append(p)
                if self._n > len(self._vectors):
                    grown = np.zeros((max(2 * len(self._vectors), 1024), self.dim), dtype=np.float32)
                    grown[:row] = self._vectors[:row]
                    self._vectors = grown
            else:
                self._rows_of_question[self._payload[row][3]].discard(row)
                self._payload[row] = p
            self._rows_of_question.setdefault(p[3], set()).add(row)
            self._vectors[row] = v
            # a key of KEY_CHARS characters may have been cut by the store: its vector is of the uncut text
            if self.key_text is not None and key is not None and len(key) < KEY_CHARS:
                self._row_of_key[_digest(self.key_text(key))] = row
            self._added(row, key)
        if out_of_order:
            self._order_rows_by_id()

    def _added(self, row: int, key: str | None) -> None:
        """Row ``row`` was just set (appended or replaced) with key text ``key``: a hook for subclasses."""

    def key_vectors(self, texts: Sequence[str]) -> list[np.ndarray | None]:
        """Per text, the stored vector of a key whose embedded text equals the text's, else None (always None
        without ``key_text``)."""
        if self.key_text is None:
            return [None] * len(texts)
        rows = [self._row_of_key.get(_digest(self.key_text(t))) for t in texts]
        return [None if r is None else self._vectors[r].copy() for r in rows]

    def search(
        self, vectors: np.ndarray, top_k: int = 3, question_filter: Sequence[tuple[str, str] | None] | None = None
    ) -> list[list[RetrievedStep]]:
        """Top-k rows by inner product per query vector, best first (``rank``)."""
        if len(vectors) == 0:
            return []
        if self._n == 0:
            return [[] for _ in vectors]
        return self.rank(np.asarray(vectors, dtype=np.float32) @ self._vectors[: self._n].T, top_k, question_filter)

    def rank(
        self, scores: np.ndarray, top_k: int = 3, question_filter: Sequence[tuple[str, str] | None] | None = None
    ) -> list[list[RetrievedStep]]:
        """Per query, the ``top_k`` rows of highest ``scores`` [Q, N] (ties: the lower row, i.e. the smaller id),
        best first. ``question_filter[i]`` for query i: None (any row), ("other", qid) (skip rows of question qid)
        or ("own", qid) (only rows of question qid)."""
        out = []
        for q, row_scores in enumerate(scores):
            scope, qid = question_filter[q] if question_filter and question_filter[q] else ("any", None)
            if scope == "own":
                rows = np.fromiter(sorted(self._rows_of_question.get(qid, ())), dtype=np.int64)
                hits = rows[np.argsort(-row_scores[rows], kind="stable")][:top_k].tolist()
            else:
                excluded = qid if scope == "other" else None
                want = top_k + (64 if excluded else 0)
                while True:
                    take = min(want, self._n)
                    cand = np.argpartition(-row_scores, take - 1)[:take] if take < self._n else np.arange(self._n)
                    cand = cand[np.argsort(-row_scores[cand], kind="stable")]
                    hits = [int(r) for r in cand if not (excluded and self._payload[r][3] == excluded)][:top_k]
                    if len(hits) == top_k or take == self._n:
                        break
                    want *= 4  # many of the best rows belonged to the excluded question
            out.append(
                [
                    RetrievedStep(
                        self._payload[r][0],
                        json.loads(self._payload[r][1]),
                        float(row_scores[r]),
                        self._payload[r][2],
                        self._payload[r][3],
                    )
                    for r in hits
                ]
            )
        return out


class LexicalReplicaIndex(ReplicaIndex):
    """A ``ReplicaIndex`` ranked by BM25 over the rows' key texts (``retrieval.embedder=bm25``) instead of by their
    vectors. Built from the keys Milvus stores, so a restarted replica ranks exactly as the one before it."""

    keys_required = True

    def __init__(self, dim: int, key_text: Callable[[str], str]):
        """``key_text``: the cut both keys and queries get before their terms are counted (``preprocess``)."""
        super().__init__(dim)  # no key_vectors shortcut: a BM25 query is never embedded
        self.cut = key_text
        self.bm25 = Bm25Index()

    def _order_rows_by_id(self) -> np.ndarray:
        old_rows = super()._order_rows_by_id()
        self.bm25.reorder(old_rows)
        return old_rows

    def _added(self, row: int, key: str | None) -> None:
        self.bm25.set(row, self.cut(key))

    def search_texts(
        self, texts: Sequence[str], top_k: int = 3, question_filter: Sequence[tuple[str, str] | None] | None = None
    ) -> list[list[RetrievedStep]]:
        """Top-k rows by BM25 score per query text, best first (``rank``)."""
        if len(texts) == 0:
            return []
        if self._n == 0:
            return [[] for _ in texts]
        return self.rank(self.bm25.scores([self.cut(t) for t in texts]), top_k, question_filter)
