"""What every retrieval backend searches by: the key text cut from an agent's history, and the width of the vector
each stored step carries in Milvus. Kept free of torch, so that a BM25 retrieval replica (``retrieval.embedder=bm25``)
imports no neural-network library at all.

The cut follows the RAPO authors' index code (spec §2): keep the text after the first "\\nuser\\n" (for
chat-rendered histories), then its last ``max_chars`` characters.
"""

from __future__ import annotations

DIM = 384  # MiniLM's width; the BM25 backend's hashed term vectors use it too, so every collection has one schema


def preprocess(text: str, max_chars: int = 1300) -> str:
    """The key text of a history (or of a query, cut the same way)."""
    marker = text.find("\nuser\n")
    if marker >= 0:
        text = text[marker + len("\nuser\n") :]
    return text[-max_chars:]


__all__ = ["DIM", "preprocess"]
