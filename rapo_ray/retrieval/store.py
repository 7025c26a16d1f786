"""The step-trace buffer in Milvus: one collection per buffer, HNSW (M 32, efConstruction 200, ef 128), IP.

Default: embedded milvus-lite in a local folder (one process per folder; a second opener fails on its
lock). When several processes need the same buffer (Serve replicas, the builder and the service),
``MilvusLiteServer`` runs ``milvus-lite server`` on 127.0.0.1 as a managed child process and everyone
connects by URI; a Milvus server or a managed service is the same code with another URI and a token.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from rapo_ray.agent.retriever import RetrievedStep, StoredStep
from rapo_ray.core.errors import StoreError
from rapo_ray.core.net import free_port

log = logging.getLogger("rapo_ray.retrieval")

HNSW = {"M": 32, "efConstruction": 200}
SEARCH_EF = 128
MAX_TEXT = 16384
KEY_CHARS = MAX_TEXT // 4  # a stored key keeps its last KEY_CHARS characters


def step_id(step: StoredStep) -> str:
    """Deterministic primary key: re-inserting the same step is an upsert, never a duplicate."""
    h = hashlib.sha1(json.dumps([step.question_id, step.key, step.value, step.source]).encode()).hexdigest()
    return h[:32]


# pymilvus pings the server every 10 s, calls or not; a gRPC server (milvus-lite's included) by default takes one ping
# per 5 minutes without data and answers more with a GOAWAY, which gRPC logs as an error on the job's console. The
# driver calls the store once per step or less, so: keep-alive pings only during calls, and no more often than that.
GRPC_OPTIONS = {"grpc.keepalive_time_ms": 300_000, "grpc.keepalive_permit_without_calls": False}


class _NoClientTimestampWarning(logging.Filter):
    """milvus-lite answers a query iterator without an MVCC timestamp, so pymilvus warns at every iterator (a
    replica's copy of the buffer when it starts, a sibling buffer's steps) that it reads as of the client's clock
    instead. That is what a read of rows written before it needs, and the line reached the job's console. Its other
    warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to get mvccTs" not in record.getMessage()


logging.getLogger("pymilvus.client.iterator.query_iterator").addFilter(_NoClientTimestampWarning())


def _connect(uri: str, token: str = "", timeout_s: float = 10.0):
    from pymilvus import MilvusClient

    if uri.startswith(("http://", "https://", "tcp://")):
        host_port = uri.split("://", 1)[1].split("/", 1)[0]
        host, _, port = host_port.partition(":")
        try:
            with socket.create_connection((host, int(port or 19530)), timeout=timeout_s):
                pass
        except OSError as exc:
            raise StoreError(f"Milvus at {uri} is unreachable: {exc}") from None
    else:
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
    try:
        return MilvusClient(uri=uri, token=token, timeout=timeout_s, grpc_options=GRPC_OPTIONS)
    except Exception as exc:
        raise StoreError(f"cannot connect to Milvus at {uri}: {type(exc).__name__}: {exc}") from None


def _hnsw_index_params(client):
    idx = client.prepare_index_params()
    idx.add_index(field_name="vector", index_type="HNSW", metric_type="IP", params=dict(HNSW))
    return idx


def load_collection(client, collection: str, uri: str) -> None:
    """Load ``collection`` for search. A milvus-lite server killed while it wrote an HNSW index file (the index is
    built after a flush, in the background) leaves that file short, and every later load fails reading it. The
    index is derived data: it is dropped and built again from the stored vectors, with a warning; the rows are
    untouched. Any other load error is raised."""
    try:
        client.load_collection(collection)
        return
    except Exception as exc:  # noqa: BLE001 - pymilvus raises MilvusException; only an unreadable index is handled
        if "read_index" not in str(exc) and ".idx" not in str(exc):
            raise
        log.warning(
            "collection %r at %s: its vector index file is unreadable (a server killed while writing it); "
            "building the index again from the stored rows",
            collection,
            uri,
        )
    try:
        client.release_collection(collection)
    except Exception:  # noqa: BLE001 - a collection that failed to load may count as released already
        pass
    client.drop_index(collection, "vector")
    client.create_index(collection, _hnsw_index_params(client))
    client.load_collection(collection)


def step_rows(steps: Sequence[StoredStep], vectors: np.ndarray) -> list[dict]:
    """Collection rows for ``steps`` and their key vectors (texts cut to the schema's limits)."""
    return [
        {
            "id": step_id(s),
            "vector": v.astype(np.float32).tolist(),
            "key": s.key[-KEY_CHARS:],
            "value": s.value[: MAX_TEXT // 4],
            "value_ids": json.dumps(list(s.value_ids))[: MAX_TEXT - 1],
            "reward": float(s.reward),
            "source": s.source[:255],
            "question_id": s.question_id[:255],
            "step_index": int(s.step_index),
        }
        for s, v in zip(steps, vectors)
    ]


class MilvusStepStore:
    """Insert/search step traces. ``dim`` must match the collection's vector field."""

    def __init__(self, uri: str, collection: str, dim: int, token: str = "", create: bool = True):
        self.uri, self.collection, self.dim = uri, collection, dim
        self.client = _connect(uri, token)
        if self.client.has_collection(collection):
            existing = self._collection_dim()
            if existing != dim:
                raise StoreError(
                    f"collection {collection!r} at {uri} has vector dim {existing}, but the embedder gives {dim}"
                )
        elif create:
            self._create()
        else:
            raise StoreError(f"collection {collection!r} does not exist at {uri}")
        load_collection(self.client, collection, uri)  # a reopened collection starts released

    def _collection_dim(self) -> int:
        for f in self.client.describe_collection(self.collection)["fields"]:
            if f["name"] == "vector":
                return int(f["params"]["dim"])
        raise StoreError(f"collection {self.collection!r} has no 'vector' field")

    def _create(self):
        from pymilvus import DataType, MilvusClient

        schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=self.dim)
        schema.add_field("key", DataType.VARCHAR, max_length=MAX_TEXT)
        schema.add_field("value", DataType.VARCHAR, max_length=MAX_TEXT)
        schema.add_field("value_ids", DataType.VARCHAR, max_length=MAX_TEXT)  # JSON list of token ids
        schema.add_field("reward", DataType.FLOAT)
        schema.add_field("source", DataType.VARCHAR, max_length=256)
        schema.add_field("question_id", DataType.VARCHAR, max_length=256)
        schema.add_field("step_index", DataType.INT64)
        self.client.create_collection(self.collection, schema=schema, index_params=_hnsw_index_params(self.client))

    def upsert(self, steps: Sequence[StoredStep], vectors: np.ndarray) -> int:
        if len(steps) != len(vectors):
            raise ValueError(f"{len(steps)} steps but {len(vectors)} vectors")
        if len(steps) == 0:
            return 0
        if vectors.shape[1] != self.dim:
            raise StoreError(f"vectors have dim {vectors.shape[1]}, collection {self.collection!r} has {self.dim}")
        return self.upsert_rows(step_rows(steps, vectors))

    def upsert_rows(self, rows: list[dict]) -> int:
        """Upsert rows built by ``step_rows`` (a replica that keeps a ``ReplicaIndex`` adds the same rows to it)."""
        self.client.upsert(self.collection, rows)
        return len(rows)

    def search(
        self, vectors: np.ndarray, top_k: int = 3, question_filter: Sequence[tuple[str, str] | None] | None = None
    ) -> list[list[RetrievedStep]]:
        """HNSW search; ``question_filter`` as in ``ReplicaIndex.search`` ("own" runs one filtered search per query)."""
        if len(vectors) == 0:
            return []
        filters = list(question_filter) if question_filter else [None] * len(vectors)
        plain = [i for i, f in enumerate(filters) if not f or f[0] != "own"]
        out: list[list[RetrievedStep]] = [[] for _ in vectors]
        if plain:
            excluding = any(filters[i] for i in plain)
            res = self._search([vectors[i] for i in plain], top_k + (8 if excluding else 0))
            for i, hits in zip(plain, res):
                skip = filters[i][1] if filters[i] else None
                out[i] = [h for h in hits if skip is None or h.question_id != skip][:top_k]
        for i, f in enumerate(filters):
            if f and f[0] == "own":
                out[i] = self._search([vectors[i]], top_k, expr=f"question_id == {json.dumps(f[1])}")[0]
        return out

    def _search(self, vectors, limit: int, expr: str = "") -> list[list[RetrievedStep]]:
        res = self.client.search(
            self.collection,
            data=[np.asarray(v, dtype=np.float32).tolist() for v in vectors],
            limit=limit,
            filter=expr,
            output_fields=["value", "value_ids", "reward", "question_id"],
            search_params={"metric_type": "IP", "params": {"ef": max(SEARCH_EF, limit)}},
        )
        return [
            [
                RetrievedStep(
                    h["entity"]["value"],
                    json.loads(h["entity"]["value_ids"]),
                    float(h["distance"]),
                    float(h["entity"]["reward"]),
                    h["entity"]["question_id"],
                )
                for h in hits
            ]
            for hits in res
        ]

    def steps(self, question_ids: Sequence[str]) -> list[StoredStep]:
        """Every stored step of ``question_ids``, as ``StoredStep`` (the key as stored: its last KEY_CHARS)."""
        out: list[StoredStep] = []
        fields = ["key", "value", "value_ids", "reward", "question_id", "step_index", "source"]
        ids = list(question_ids)
        for i in range(0, len(ids), 256):
            expr = f"question_id in {json.dumps(ids[i : i + 256])}"
            it = self.client.query_iterator(self.collection, batch_size=1000, filter=expr, output_fields=fields)
            try:
                while rows := it.next():
                    out.extend(
                        StoredStep(
                            r["key"],
                            r["value"],
                            json.loads(r["value_ids"]),
                            float(r["reward"]),
                            r["question_id"],
                            int(r["step_index"]),
                            r["source"],
                        )
                        for r in rows
                    )
            finally:
                it.close()
        return sorted(out, key=lambda s: (s.question_id, s.step_index, step_id(s)))

    def count(self) -> int:
        return int(self.client.get_collection_stats(self.collection)["row_count"])

    def flush(self) -> None:
        """Seal what was written so it is searched through the index: milvus-lite searches unflushed (growing)
        segments several times slower."""
        self.client.flush(self.collection)

    def random_steps(self, n: int, seed: int = 0) -> list[RetrievedStep]:
        """A sample of stored steps (the noisy-retrieval study replaces hits with these)."""
        rows = self.client.query(
            self.collection,
            filter="step_index >= 0",
            output_fields=["value", "value_ids", "reward", "question_id"],
            limit=max(n * 4, 64),
        )
        rng = np.random.default_rng(seed)
        pick = rng.choice(len(rows), size=min(n, len(rows)), replace=False) if rows else []
        return [
            RetrievedStep(
                rows[j]["value"],
                json.loads(rows[j]["value_ids"]),
                0.0,
                float(rows[j]["reward"]),
                rows[j]["question_id"],
                True,
            )
            for j in pick
        ]

    def close(self):
        try:
            self.client.close()
        except Exception:
            pass


def _dies_with_this_thread(argv: list[str]) -> list[str]:
    """On Linux, wrap ``argv`` so the server gets SIGTERM when the thread that starts it ends, even by SIGKILL of the
    process: a killed run must not leave a server holding its data directory's lock. The signal follows the
    creating thread, not the process, so the caller starts it from a thread that lives as long as the server (the
    supervisor below). Off Linux, ``argv`` unchanged."""
    if not sys.platform.startswith("linux"):
        return argv
    launcher = (
        "import ctypes, os, signal, sys\n"
        "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
        "if os.getppid() != int(sys.argv[1]): sys.exit(1)  # the parent is already gone\n"
        "os.execv(sys.argv[2], sys.argv[2:])\n"
    )
    return [sys.executable, "-c", launcher, str(os.getpid()), *argv]


class MilvusLiteServer:
    """``milvus-lite server --data-dir DIR --host 127.0.0.1 --port P`` as a managed child process.

    A supervisor thread starts it and waits on it: a server that dies while the run still needs it (killed, out of
    memory) is started again on the same port and data directory, up to ``max_restarts`` times, so replicas and
    the buffer's writers reconnect to the same URI. ``restarts`` counts them."""

    def __init__(self, data_dir: str | Path, port: int | None = None, start_timeout_s: float = 60.0, max_restarts=5):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.start_timeout_s, self.max_restarts, self.restarts = start_timeout_s, max_restarts, 0
        exe = shutil.which("milvus-lite") or str(Path(sys.executable).with_name("milvus-lite"))
        if not Path(exe).exists():
            raise StoreError("the milvus-lite executable was not found (pip install milvus-lite)")
        self._argv = [exe, "server", "--data-dir", str(self.data_dir), "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = self.data_dir / "milvus-lite-server.log"
        self.proc: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._supervise, name="milvus-lite-supervisor", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _supervise(self) -> None:
        try:
            self._start()
        except Exception as exc:  # noqa: BLE001 - raised in __init__
            self._error = exc
            return
        finally:
            self._started.set()
        while True:
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            if self.restarts >= self.max_restarts:
                log.error("milvus-lite server on port %d exited with code %s; not restarted again", self.port, code)
                return
            log.warning("milvus-lite server on port %d exited with code %s; starting it again", self.port, code)
            try:
                self._start()
            except Exception as exc:  # noqa: BLE001 - nothing to raise to: the run's callers see Milvus errors
                log.error("milvus-lite server could not be started again: %s", exc)
                return
            self.restarts += 1  # counted once it listens again

    def _start(self) -> None:
        with open(self.log_path, "ab") as out:
            log_start = out.tell()
            self.proc = subprocess.Popen(
                _dies_with_this_thread(self._argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.time() + self.start_timeout_s
        while time.time() < deadline and not self._stopping.is_set():
            if self.proc.poll() is not None:
                with open(self.log_path, "rb") as f:
                    f.seek(log_start)
                    if b"DataDirLockedError" in f.read():
                        raise StoreError(
                            f"another milvus-lite server holds the data directory {self.data_dir} (a run still going, "
                            f"or one that was killed and left its server behind): stop that server, or point "
                            f"run.artifacts_dir elsewhere"
                        )
                raise StoreError(f"milvus-lite server exited with code {self.proc.returncode}; see {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.2)
        self._terminate()
        if self._stopping.is_set():  # stop() came while it was starting
            return
        raise StoreError(
            f"milvus-lite server did not listen on 127.0.0.1:{self.port} within {self.start_timeout_s:.0f} s"
        )

    def _terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop(self) -> None:
        self._stopping.set()
        self._terminate()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=15)


class MilvusDocumentIndex:
    """The search tool's corpus as a Milvus collection (id, vector, text): dense search with the same
    embedder and index settings as the step buffer. Implements ``DocumentIndex.search(query, k)``."""

    def __init__(self, uri: str, collection: str, embedder, token: str = ""):
        from pymilvus import DataType, MilvusClient

        self.uri, self.collection, self.embedder = uri, collection, embedder
        self.client = _connect(uri, token)
        if not self.client.has_collection(collection):
            schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
            schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=64)
            schema.add_field("vector", DataType.FLOAT_VECTOR, dim=embedder.dim)
            schema.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT)
            self.client.create_collection(collection, schema=schema, index_params=_hnsw_index_params(self.client))
        load_collection(self.client, collection, uri)

    def add(self, documents: Sequence[str], batch_size: int = 256) -> int:
        """Upsert documents (keyed by content hash: adding the same text twice keeps one row)."""
        for start in range(0, len(documents), batch_size):
            docs = [d[: MAX_TEXT // 4] for d in documents[start : start + batch_size]]
            vectors = self.embedder.embed(docs)
            self.client.upsert(
                self.collection,
                [
                    {
                        "id": hashlib.sha1(d.encode()).hexdigest()[:32],
                        "vector": v.astype(np.float32).tolist(),
                        "text": d,
                    }
                    for d, v in zip(docs, vectors)
                ],
            )
        return len(documents)

    def count(self) -> int:
        return int(self.client.get_collection_stats(self.collection)["row_count"])

    def search(self, query: str, k: int = 3) -> list[tuple[str, float]]:
        vec = self.embedder.embed([query])[0]
        res = self.client.search(
            self.collection,
            data=[vec.astype(np.float32).tolist()],
            limit=k,
            output_fields=["text"],
            search_params={"metric_type": "IP", "params": {"ef": max(SEARCH_EF, k)}},
        )
        return [(h["entity"]["text"], float(h["distance"])) for h in res[0]]

    def close(self):
        try:
            self.client.close()
        except Exception:
            pass
