"""The step-trace buffer build's last stage: each step's key encoded by the configured backend (``retrieval.embedder``).

A module of its own so that the Ray Data actor running it imports only what its backend needs: for ``bm25`` no
torch (about half that actor's start-up CPU and ~200 MB), as for a BM25 retrieval replica (retrieval/backends.py).
"""

from __future__ import annotations

from rapo_ray.retrieval.backends import is_lexical, make_encoder


class EmbedStep:
    """Ray Data callable (actor pool): adds the key's vector (``retrieval.embedder``'s encoder)."""

    def __init__(self, backend: str, files: str, pooling: str, max_chars: int):
        if not is_lexical(backend):  # a network: one torch thread in this actor
            from rapo_ray.model.factory import set_torch_threads

            set_torch_threads(1)
        self.embedder = make_encoder(backend, files, pooling, max_chars)

    def __call__(self, batch: dict) -> dict:
        batch["vector"] = self.embedder.embed(list(batch["key"]))
        return batch


__all__ = ["EmbedStep"]
