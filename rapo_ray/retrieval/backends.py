"""Step-retrieval backends (``retrieval.embedder``): what turns a history into something searchable.

- ``minilm``: all-MiniLM-L6-v2 in torch, fp32 (``Embedder``); the paper's kind of retriever.
- ``minilm-onnx-int8``: the same network through ONNX Runtime with int8 weights (``OnnxEmbedder``), exported once
  under ``run.artifacts_dir``.
- ``bm25``: no network; BM25 over the history's words and numbers, ranked in the retrieval replica's memory
  (``LexicalReplicaIndex``). Milvus keeps a hashed term vector per step (``HashedTermEncoder``).

A buffer's keys are encoded by one backend and must be searched with the same one: every backend but ``minilm``
(whose buffers predate this choice) is part of the buffer's fingerprint, so another backend builds its own buffer.

The torch-backed encoders are imported only where one is built: a ``bm25`` retrieval replica imports this module
and never loads torch (half the replica's start-up CPU and ~200 MB of its memory; docs/RESULTS.md, Performance).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rapo_ray.core.errors import ConfigError
from rapo_ray.retrieval.lexical import HashedTermEncoder
from rapo_ray.retrieval.replica_index import LexicalReplicaIndex, ReplicaIndex

if TYPE_CHECKING:
    from rapo_ray.retrieval.embedder import Embedder

BACKENDS = ("minilm", "minilm-onnx-int8", "bm25")
LEXICAL = ("bm25",)
BM25_VERSION = 1  # bump when terms() or the scoring changes


def is_lexical(backend: str) -> bool:
    """Whether ``backend`` ranks in the replica by text (BM25) rather than by vectors."""
    return backend in LEXICAL


BACKEND_KEY = "retrieval.embedder"  # the buffer fingerprint's entry for the backend


def backend_fingerprint(backend: str) -> dict:
    """The buffer-fingerprint entry for ``backend`` (empty for ``minilm``: its buffers' names stay as they were)."""
    if backend == "minilm":
        return {}
    if check_backend(backend) == "minilm-onnx-int8":
        from rapo_ray.retrieval.onnx_embedder import EXPORT_VERSION as version
    else:
        version = BM25_VERSION
    return {BACKEND_KEY: f"{backend}/v{version}"}


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"retrieval.embedder={backend!r}; valid: {', '.join(BACKENDS)}")
    return backend


def prepare_backend(backend: str, artifacts_dir: str | Path, pooling: str) -> str:
    """Files ``backend`` needs, built once under ``artifacts_dir`` (the ONNX model); "" when it needs none."""
    if check_backend(backend) == "minilm-onnx-int8":
        from rapo_ray.retrieval.onnx_embedder import onnx_minilm

        return str(onnx_minilm(artifacts_dir, pooling))
    return ""


def make_encoder(
    backend: str, files: str, pooling: str, max_chars: int, device: str = "cpu", cache_size: int = 0
) -> Embedder | HashedTermEncoder:
    """The encoder of keys and queries for ``backend`` (``files``: what ``prepare_backend`` returned)."""
    if is_lexical(check_backend(backend)):
        return HashedTermEncoder(max_chars=max_chars)
    if backend == "minilm":
        from rapo_ray.retrieval.embedder import Embedder

        return Embedder(pooling=pooling, max_chars=max_chars, device=device, cache_size=cache_size)
    if not files:
        raise ConfigError("retrieval.embedder=minilm-onnx-int8 needs its model file: call prepare_backend first")
    from rapo_ray.retrieval.onnx_embedder import OnnxEmbedder

    return OnnxEmbedder(files, pooling=pooling, max_chars=max_chars, cache_size=cache_size)


def replica_index(backend: str, store, encoder) -> ReplicaIndex:
    """The in-memory copy of ``store``'s collection that a retrieval replica searches: ranked by BM25 over the keys
    for a lexical backend, by the stored vectors otherwise."""
    kind = LexicalReplicaIndex if is_lexical(backend) else ReplicaIndex
    return kind.from_store(store, key_text=encoder.embedded_text)


__all__ = [
    "BACKENDS",
    "backend_fingerprint",
    "check_backend",
    "is_lexical",
    "make_encoder",
    "prepare_backend",
    "replica_index",
]
