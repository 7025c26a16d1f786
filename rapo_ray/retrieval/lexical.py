"""Lexical step retrieval: BM25 over the words and numbers of a step's history, no neural network.

A retrieval query and a stored key are the same kind of text (an agent's history up to a step), cut the same way as
for MiniLM (``preprocess``: after the chat's first user turn, the last ``max_chars`` characters). Both are split
into lower-case runs of letters and digits (``terms``): single characters stay, because GSM8K's numbers are often one
digit. Scores are Lucene's BM25 (without the constant factor k1 + 1), the variant ``bm25s`` computes by default:

    score(q, d) = sum over query terms t (repeats count again) of
                  idf(t) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avg |d|))
    idf(t)      = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

The index lives in the retrieval replica's memory (``Bm25Index``, beside the payloads ``ReplicaIndex`` keeps) and is
rebuilt from the keys stored in Milvus when a replica starts, so a restarted replica answers exactly as before. Milvus
still needs a vector per row: ``HashedTermEncoder`` gives one (the key's term counts hashed into 384 signed buckets),
which keeps the collection's schema and lets ``search_on=milvus`` at least rank by shared terms; the BM25 ranking
itself needs the replica.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from typing import Sequence

import numpy as np
from scipy import sparse

from rapo_ray.retrieval.key_text import DIM, preprocess

TERM = re.compile(r"[^\W_]+")  # runs of letters and digits (any script); "_" and punctuation split


def terms(text: str) -> list[str]:
    """The BM25 terms of an already cut text: lower-case runs of letters and digits, in order."""
    return TERM.findall(text.lower())


class HashedTermEncoder:
    """Texts -> [N, 384] float32 unit vectors of their term counts, hashed (feature hashing with a sign bit). Only
    the Milvus vector field of a ``bm25`` buffer; the retrieval ranking is ``Bm25Index``'s."""

    def __init__(self, max_chars: int = 1300, dim: int = DIM):
        self.max_chars, self.dim = max_chars, dim
        self.cache_hits = self.cache_misses = 0  # the replica's embed_stats reads these; nothing is cached

    def embedded_text(self, text: str) -> str:
        return preprocess(text, self.max_chars)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for term, count in Counter(terms(self.embedded_text(text))).items():
                h = int.from_bytes(hashlib.blake2b(term.encode(), digest_size=8).digest(), "little")
                out[row, h % self.dim] += (1.0 if (h >> 63) else -1.0) * np.sqrt(count)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        self.cache_misses += len(texts)
        return out / np.where(norms > 0, norms, 1.0)

    __call__ = embed


class Bm25Index:
    """BM25 scores of queries against a growing set of documents (rows 0..N-1, each replaceable).

    Term statistics (document frequencies, average length) change with every added document, so the weighted
    term-document matrix is rebuilt lazily at the first search after a change: O(stored terms), milliseconds for
    the buffers here (thousands of steps). Terms are numbered in sorted order at each rebuild, so the same documents
    give bit-identical scores whatever order they were added in (a restarted replica must rank ties as before)."""

    def __init__(self, k1: float = 1.5, b: float = 0.75):
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.k1, self.b = k1, b
        self._docs: list[Counter] = []  # row -> term counts
        self._matrix: sparse.csr_matrix | None = None  # [V, N] BM25 term weights; None: stale
        self._vocab: dict[str, int] = {}  # term -> row of _matrix, in sorted term order
        self._idf = np.zeros(0, dtype=np.float64)

    def __len__(self) -> int:
        return len(self._docs)

    def set(self, row: int, text: str) -> None:
        """Document ``row`` becomes ``text`` (rows are appended in order: ``row`` is at most ``len(self)``)."""
        if not 0 <= row <= len(self._docs):
            raise IndexError(f"row {row} of a BM25 index with {len(self._docs)} documents")
        counts = Counter(terms(text))
        if row == len(self._docs):
            self._docs.append(counts)
        else:
            self._docs[row] = counts
        self._matrix = None

    def reorder(self, old_rows: Sequence[int]) -> None:
        """Row i becomes what row ``old_rows[i]`` was (``ReplicaIndex`` renumbers its rows by id)."""
        self._docs = [self._docs[r] for r in old_rows]
        self._matrix = None

    def _build(self) -> None:
        n = len(self._docs)
        self._vocab = {t: j for j, t in enumerate(sorted(set().union(*self._docs)))}
        lengths = np.array([sum(d.values()) for d in self._docs], dtype=np.float64)
        avg = lengths.mean() if n and lengths.mean() > 0 else 1.0
        rows, cols, tfs = [], [], []
        for doc, counts in enumerate(self._docs):
            for term in sorted(counts):
                rows.append(self._vocab[term])
                cols.append(doc)
                tfs.append(counts[term])
        tf = np.asarray(tfs, dtype=np.float64)
        norm = self.k1 * (1.0 - self.b + self.b * lengths[np.asarray(cols, dtype=np.int64)] / avg)
        self._matrix = sparse.csr_matrix((tf / (tf + norm), (rows, cols)), shape=(len(self._vocab), n))
        df = np.bincount(np.asarray(rows, dtype=np.int64), minlength=len(self._vocab))
        self._idf = np.log1p((n - df + 0.5) / (df + 0.5))

    def scores(self, texts: Sequence[str]) -> np.ndarray:
        """[Q, N] float32: each query's BM25 score against every document (0 for a query with no known term)."""
        if self._matrix is None:
            self._build()
        weights, qrows, qcols = [], [], []
        for i, text in enumerate(texts):
            for t in sorted(terms(text)):
                j = self._vocab.get(t)
                if j is not None:  # a repeated term counts again (summed by the sparse constructor)
                    weights.append(self._idf[j])
                    qrows.append(i)
                    qcols.append(j)
        queries = sparse.csr_matrix((weights, (qrows, qcols)), shape=(len(texts), len(self._vocab)))
        return np.asarray((queries @ self._matrix).toarray(), dtype=np.float32)  # [Q, V] @ [V, N]


__all__ = ["Bm25Index", "HashedTermEncoder", "terms"]
