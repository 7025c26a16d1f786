"""The search tool's index over the bundled fact corpus, built where a run's tools are assembled and passed
to ``rapo_ray.envs.suite.build_tools``: lexical (in memory) or a Milvus collection (``tasks.search_*``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from rapo_ray.envs import tasks as bundled
from rapo_ray.envs.tools import LexicalIndex
from rapo_ray.retrieval.embedder import Embedder
from rapo_ray.retrieval.store import MilvusDocumentIndex


def search_index_for(tasks_cfg, milvus_token: str = ""):
    """The search tool's index over the bundled fact corpus: lexical, or a Milvus collection (tasks.search_*)."""
    documents = bundled.make_world(tasks_cfg.seed).documents()
    if tasks_cfg.search_backend == "lexical":
        return LexicalIndex(documents)
    uri = tasks_cfg.search_milvus_uri or str(Path(tempfile.mkdtemp(prefix="rapo_search_")) / "corpus.db")  # per process
    index = MilvusDocumentIndex(uri, tasks_cfg.search_collection, Embedder(pooling="mean"), token=milvus_token)
    if index.count() < len(documents):
        index.add(documents)  # idempotent: keyed by content
    return index
