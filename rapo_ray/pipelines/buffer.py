"""Build the off-policy step-trace buffer (spec §2) with Ray Data:

    questions -> off-policy agent samples N trajectories per question -> keep the top K by reward
              -> split into steps (key = history so far, value = next step; answer steps excluded)
              -> embed (actor pool) -> upsert into Milvus (datasink)

Idempotent: a step's primary key is a hash of its content, so re-running upserts the same rows. Resumable:
finished questions are recorded in ``<manifest>`` after their steps are written, and skipped next time.
The manifest also records the embedder version the vectors were made with and what the steps were built for
(``buffer_fingerprint``: the tokenizer that wrote their token ids, the task seed that maps question ids to
questions, the sampler's settings). A buffer made by another version or for another setup is refused (its
keys would not match this version's queries, or its token ids would decode to other text under this run's
tokenizer), never silently extended or served.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray

from rapo_ray.agent.retriever import StoredStep, steps_of
from rapo_ray.config import from_dict, to_dict
from rapo_ray.core.errors import StoreError
from rapo_ray.envs.suite import build_tools
from rapo_ray.model.factory import load_tokenizer, set_torch_threads
from rapo_ray.pipelines.sft import expert_trajectories
from rapo_ray.retrieval.embedder import DIM, EMBEDDER_VERSION, Embedder
from rapo_ray.retrieval.search_index import search_index_for
from rapo_ray.retrieval.store import MilvusStepStore
from rapo_ray.types.trajectory import Task


@dataclass
class BufferReport:
    questions: int
    trajectories: int
    steps: int
    tokens: int
    skipped_questions: int
    seconds: float

    def table(self) -> str:
        return (
            f"{'setting':24} {'trajectories':>12} {'step traces':>12} {'tokens':>10}\n"
            f"{'this buffer':24} {self.trajectories:12d} {self.steps:12d} {self.tokens:10d}\n"
            f"{'paper (comp.+knowledge)':24} {50000:12d} {169489:12d} {15648438:10d}\n"
            f"{'paper (web)':24} {11000:12d} {38473:12d} {4518194:10d}"
        )


class ExpertSampler:
    """Ray Data callable: N expert samples per question through the real loop and tools, top-K kept."""

    def __init__(self, model_dir: str, cfg_dict: dict, error_rate: float, seed: int):
        set_torch_threads(1)
        self.cfg = from_dict(cfg_dict)
        self.tok = load_tokenizer(model_dir)
        self.tools = build_tools(self.cfg.tasks, self.cfg.rollout, search_index_for(self.cfg.tasks))
        self.error_rate, self.seed = error_rate, seed

    def __call__(self, batch: dict) -> dict:
        rc = self.cfg.retrieval
        tasks = [
            Task(i, q, tuple(json.loads(a)), k)
            for i, q, a, k in zip(batch["id"], batch["question"], batch["answers"], batch["kind"])
        ]
        trajs = expert_trajectories(
            self.cfg,
            self.tok,
            self.tools,
            tasks,
            seed=self.seed + len(tasks),
            error_rate=self.error_rate,
            samples=rc.buffer_samples_per_question,
        )
        out = {k: [] for k in ("key", "value", "value_ids", "reward", "question_id", "step_index", "source", "traj_id")}
        by_q: dict[str, list] = {}
        for t in trajs:
            by_q.setdefault(t.problem_id, []).append(t)
        for qid, ts in by_q.items():
            ts.sort(key=lambda t: (-t.reward, t.slot))
            for t in ts[: rc.buffer_keep_top_k]:
                for s in steps_of(self.tok, t, source="scripted-expert"):
                    out["key"].append(s.key)
                    out["value"].append(s.value)
                    out["value_ids"].append(json.dumps(s.value_ids))
                    out["reward"].append(s.reward)
                    out["question_id"].append(s.question_id)
                    out["step_index"].append(s.step_index)
                    out["source"].append(s.source)
                    out["traj_id"].append(f"{qid}#{t.slot}")
        return {
            k: np.array(v, dtype=object)
            if k in ("key", "value", "value_ids", "question_id", "source", "traj_id")
            else np.array(v)
            for k, v in out.items()
        }


class EmbedStep:
    """Ray Data callable (actor pool): adds the key embedding."""

    def __init__(self, pooling: str, max_chars: int):
        set_torch_threads(1)
        self.embedder = Embedder(pooling=pooling, max_chars=max_chars)

    def __call__(self, batch: dict) -> dict:
        batch["vector"] = self.embedder.embed(list(batch["key"]))
        return batch


def _rows_to_steps(batch: dict) -> tuple[list[StoredStep], np.ndarray]:
    steps = [
        StoredStep(k, v, json.loads(ids), float(r), q, int(i), s)
        for k, v, ids, r, q, i, s in zip(
            batch["key"],
            batch["value"],
            batch["value_ids"],
            batch["reward"],
            batch["question_id"],
            batch["step_index"],
            batch["source"],
        )
    ]
    return steps, np.stack(list(batch["vector"])).astype(np.float32)


def manifest_path(cfg) -> Path:
    """Where the buffer of ``retrieval.collection`` records its finished questions (its folder is created)."""
    path = Path(cfg.run.artifacts_dir) / "milvus" / f"manifest-{cfg.retrieval.collection}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def buffer_fingerprint(cfg, model_dir: str) -> dict:
    """What decides the steps stored under a question id: the tokenizer that wrote their ``value_ids`` (a hash of
    its files), the generator seed that maps ids like ``multihop-train-7`` to questions, and the settings of the
    expert sampler and of the key embedding. Two runs share a buffer only when these are equal."""
    digest = hashlib.sha1()
    files = [Path(model_dir) / name for name in _TOKENIZER_FILES if (Path(model_dir) / name).is_file()]
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    rc, ro = cfg.retrieval, cfg.rollout
    return {
        "tokenizer": digest.hexdigest()[:16] if files else str(Path(model_dir).resolve()),
        "tasks.seed": cfg.tasks.seed,
        "trainer.sft_seed": cfg.trainer.sft_seed,
        "retrieval.buffer_error_rate": rc.buffer_error_rate,
        "retrieval.buffer_samples_per_question": rc.buffer_samples_per_question,
        "retrieval.buffer_keep_top_k": rc.buffer_keep_top_k,
        "retrieval.pooling": rc.pooling,
        "retrieval.query_max_chars": rc.query_max_chars,
        "rollout.max_response_tokens": ro.max_response_tokens,
        "rollout.max_step_tokens": ro.max_step_tokens,
        "rollout.max_tool_calls": ro.max_tool_calls,
    }


def read_manifest(manifest: Path, collection: str, fingerprint: dict | None = None) -> set[str]:
    """Question ids already in the buffer; raises StoreError for a manifest that is not valid, whose buffer was
    embedded by another embedder version, or (``fingerprint`` given) that was built for another setup."""
    if not manifest.is_file():
        return set()
    try:
        data = json.loads(manifest.read_text())
    except json.JSONDecodeError as exc:
        raise StoreError(
            f"buffer manifest {manifest} is not valid JSON ({exc}); it records which questions collection "
            f"{collection!r} already holds: restore it, or move it and the collection away to rebuild"
        ) from exc
    version = data.get("embedder_version") if isinstance(data, dict) else 1  # version 1 wrote a bare list
    if version != EMBEDDER_VERSION:
        raise StoreError(
            f"step buffer {collection!r} (manifest {manifest}) was embedded by embedder version {version}, "
            f"this code embeds queries with version {EMBEDDER_VERSION} (see rapo_ray/retrieval/embedder.py), so "
            f"its keys would not match; build a new buffer: set retrieval.collection to a new name, or move "
            f"{manifest.parent} away"
        )
    if not isinstance(data.get("questions"), list):
        raise StoreError(f"buffer manifest {manifest} has no 'questions' list; it is not a step-buffer manifest")
    built_for = data.get("built_for")
    if fingerprint is not None and built_for != fingerprint:
        if not isinstance(built_for, dict):
            what = "does not record what it was built for (written before rapo_ray checked it)"
        else:
            what = "was built for another setup: " + ", ".join(
                f"{k} {built_for.get(k)!r} here {v!r}" for k, v in fingerprint.items() if built_for.get(k) != v
            )
        raise StoreError(
            f"step buffer {collection!r} (manifest {manifest}) {what}; its steps would be served to this run as if "
            f"they were its own (another tokenizer decodes their token ids to other text); build a new buffer: set "
            f"retrieval.collection to a new name, or move {manifest.parent} away"
        )
    return set(data["questions"])


def _write_manifest(manifest: Path, done: set[str], fingerprint: dict) -> None:
    tmp = manifest.with_suffix(".tmp")  # atomic: a crash leaves the previous manifest
    tmp.write_text(
        json.dumps({"embedder_version": EMBEDDER_VERSION, "built_for": fingerprint, "questions": sorted(done)})
    )
    tmp.replace(manifest)


def build_buffer(cfg, model_dir: str, uri: str, tasks: list, manifest: Path, log=print) -> BufferReport:
    """Sample, filter, split, embed and upsert the buffer for ``tasks`` (loop ``Task``s)."""
    t0 = time.perf_counter()
    fingerprint = buffer_fingerprint(cfg, model_dir)
    done = read_manifest(manifest, cfg.retrieval.collection, fingerprint)
    todo = [t for t in tasks if t.id not in done]
    store = MilvusStepStore(uri, cfg.retrieval.collection, DIM, token=cfg.retrieval.milvus_token)
    report = BufferReport(len(tasks), 0, 0, 0, len(tasks) - len(todo), 0.0)
    if todo:
        items = [
            {"id": t.id, "question": t.question, "answers": json.dumps(list(t.answers)), "kind": t.kind} for t in todo
        ]
        ds = ray.data.from_items(items, override_num_blocks=max(1, len(items) // 64))
        ds = ds.map_batches(
            ExpertSampler,
            fn_constructor_args=(model_dir, to_dict(cfg), cfg.retrieval.buffer_error_rate, cfg.trainer.sft_seed),
            batch_size=32,
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=1,
            batch_format="numpy",
        )
        ds = ds.map_batches(
            EmbedStep,
            fn_constructor_args=(cfg.retrieval.pooling, cfg.retrieval.query_max_chars),
            batch_size=256,
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=1,
            batch_format="numpy",
        )
        trajectories: set[str] = set()
        for batch in ds.iter_batches(batch_size=512, batch_format="numpy"):
            steps, vectors = _rows_to_steps(batch)
            store.upsert(steps, vectors)  # the datasink: idempotent upsert by content hash
            report.steps += len(steps)
            report.tokens += sum(len(s.value_ids) for s in steps)
            trajectories.update(batch["traj_id"].tolist())
            done.update(s.question_id for s in steps)
            _write_manifest(manifest, done, fingerprint)
        report.trajectories = len(trajectories)
    store.flush()  # also seals a buffer built by an older version without a flush
    report.seconds = time.perf_counter() - t0
    total = store.count()
    store.close()
    log(
        f"step-trace buffer: {total} steps in {cfg.retrieval.collection!r} ({report.steps} written now, "
        f"{report.skipped_questions} questions already done) in {report.seconds:.0f} s"
    )
    return report
