"""Build the off-policy step-trace buffer (spec §2) with Ray Data:

    questions -> off-policy sampler: N trajectories per question -> keep the top K by reward
              -> split into steps (key = history so far, value = next step; answer steps excluded)
              -> embed (actor pool) -> upsert into Milvus (datasink)

The sampler is ``retrieval.buffer_source``: the paper's recipe samples the starting policy (``policy``: a real
model after its cold start, through the rollout engine and the real tools); the bundled model's tasks have a
scripted expert with a per-step error rate (``scripted-expert``), so its N samples differ in reward; GSM8K-format
data has human solutions whose calculator annotations become tool calls (``solutions``, one per question).

Idempotent: a step's primary key is a hash of its content, so re-running upserts the same rows. Resumable:
finished questions are recorded in ``<manifest>`` after their steps are written, and skipped next time.
The manifest also records the embedder version the vectors were made with and what the steps were built for
(``buffer_fingerprint``: the tokenizer that wrote their token ids, the task seed that maps question ids to
questions, the sampler and its settings). A buffer made by another version or for another setup is refused (its
keys would not match this version's queries, or its token ids would decode to other text under this run's
tokenizer), never silently extended or served. The default collection name is derived from the fingerprint
(``buffer_collection``), so a run with another model or sampler gets its own buffer instead of a refusal.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import ray

from rapo_ray.agent.loop import AgentLoop, LoopSettings
from rapo_ray.agent.retriever import StoredStep, steps_of
from rapo_ray.agent.turns import AgentTurns
from rapo_ray.config import Config, from_dict, to_dict
from rapo_ray.core.errors import DataError, StoreError
from rapo_ray.core.files import write_json_atomic
from rapo_ray.engines import make_engine
from rapo_ray.envs.loaders import gsm8k_solutions, gsm8k_trajectory_parts
from rapo_ray.envs.suite import build_tools
from rapo_ray.model.factory import context_length, load_model_and_tokenizer, load_tokenizer, set_torch_threads
from rapo_ray.pipelines.embed_step import EmbedStep
from rapo_ray.pipelines.sft import expert_trajectories
from rapo_ray.retrieval.backends import BACKEND_KEY, backend_fingerprint, make_encoder, prepare_backend
from rapo_ray.retrieval.embedder import EMBEDDER_VERSION
from rapo_ray.retrieval.key_text import DIM
from rapo_ray.retrieval.search_index import search_index_for
from rapo_ray.retrieval.store import KEY_CHARS, MilvusStepStore
from rapo_ray.types.trajectory import GENERATED, ON_POLICY, TOOL_RESULT, Task, Trajectory

_STEP_COLUMNS = ("key", "value", "value_ids", "reward", "question_id", "step_index", "source", "traj_id")
_TEXT_COLUMNS = ("key", "value", "value_ids", "question_id", "source", "traj_id")


# The build streams through two actors at once, a sampler's and an embedder's, each this many CPUs: what the cluster
# must have free beside anything else already placed (the launcher starts the learner ranks before it where it can).
BUILD_ACTOR_CPUS = 1
BUILD_CPUS = 2 * BUILD_ACTOR_CPUS


def buffer_source(cfg) -> str:
    """``retrieval.buffer_source`` with ``auto`` resolved: the scripted expert for the bundled model, the paper's
    recipe (samples of the starting policy) for a real one."""
    source = cfg.retrieval.buffer_source
    if source == "auto":
        return "scripted-expert" if cfg.model.bundled else "policy"
    return source


@dataclass
class BufferReport:
    questions: int
    trajectories: int
    steps: int
    tokens: int
    skipped_questions: int
    seconds: float
    reindexed: int = 0  # questions whose steps were taken from a sibling buffer (``sibling_buffer``), not sampled

    def table(self) -> str:
        return (
            f"{'setting':24} {'trajectories':>12} {'step traces':>12} {'tokens':>10}\n"
            f"{'written by this build':24} {self.trajectories:12d} {self.steps:12d} {self.tokens:10d}\n"
            f"{'paper (comp.+knowledge)':24} {50000:12d} {169489:12d} {15648438:10d}\n"
            f"{'paper (web)':24} {11000:12d} {38473:12d} {4518194:10d}"
        )


class StepSampler:
    """Ray Data callable: N samples per question, the top K by reward kept and split into steps. Subclasses say
    how the N samples are made (``trajectories``) and name their ``source`` (stored with every step)."""

    source = ""

    def __init__(self, model_dir: str, cfg_dict: dict, seed: int):
        self.cfg = from_dict(cfg_dict)
        self.tok = load_tokenizer(model_dir)
        self.tools = build_tools(self.cfg.tasks, self.cfg.rollout, search_index_for(self.cfg.tasks))
        self.seed = seed

    def trajectories(self, tasks: list[Task], samples: int) -> list[Trajectory]:
        raise NotImplementedError

    def __call__(self, batch: dict) -> dict:
        rc = self.cfg.retrieval
        tasks = [
            Task(i, q, tuple(json.loads(a)), k)
            for i, q, a, k in zip(batch["id"], batch["question"], batch["answers"], batch["kind"])
        ]
        by_q: dict[str, list[Trajectory]] = {}
        for t in self.trajectories(tasks, rc.buffer_samples_per_question):
            by_q.setdefault(t.problem_id, []).append(t)
        out: dict[str, list] = {k: [] for k in _STEP_COLUMNS}
        for qid, ts in by_q.items():
            ts.sort(key=lambda t: (-t.reward, t.slot))
            for t in ts[: rc.buffer_keep_top_k]:
                for s in steps_of(self.tok, t, source=self.source):
                    row = {**asdict(s), "value_ids": json.dumps(s.value_ids), "traj_id": f"{qid}#{t.slot}"}
                    for col in _STEP_COLUMNS:
                        out[col].append(row[col])
        return {k: np.array(v, dtype=object) if k in _TEXT_COLUMNS else np.array(v) for k, v in out.items()}


class ExpertSampler(StepSampler):
    """The bundled tasks' scripted expert through the real loop and tools, wrong at each step with
    ``retrieval.buffer_error_rate``."""

    source = "scripted-expert"

    def __init__(self, model_dir: str, cfg_dict: dict, seed: int):
        set_torch_threads(1)
        super().__init__(model_dir, cfg_dict, seed)

    def trajectories(self, tasks: list[Task], samples: int) -> list[Trajectory]:
        return expert_trajectories(
            self.cfg,
            self.tok,
            self.tools,
            tasks,
            seed=self.seed + len(tasks),
            error_rate=self.cfg.retrieval.buffer_error_rate,
            samples=samples,
        )


class PolicySampler(StepSampler):
    """The paper's recipe: the starting policy itself samples N trajectories per question at the training
    temperature, on the rollout engine (``rollout.engine``) with the real tools."""

    source = "policy"

    def __init__(self, model_dir: str, cfg_dict: dict, seed: int):
        super().__init__(model_dir, cfg_dict, seed)
        cfg = self.cfg
        set_torch_threads(cfg.rollout.threads_per_worker)
        max_context = context_length(model_dir)
        engine = make_engine(
            cfg.rollout, model_dir, load_model_and_tokenizer, cfg.model.dtype, max_model_len=max_context, seed=seed
        )
        settings = LoopSettings.from_config(cfg)
        settings.max_context, settings.seed = max_context, seed  # seeded: a rebuild draws the same samples
        self.loop = AgentLoop(engine, self.tok, self.tools, settings)

    def trajectories(self, tasks: list[Task], samples: int) -> list[Trajectory]:
        return self.loop.run_groups(tasks, group_size=samples)[0]


class SolutionSampler(StepSampler):
    """The data's human solutions: each GSM8K rationale written in the tool protocol as the cold start writes it
    (an annotation ``<<48/2=24>>`` becomes ``<python>print(48/2)</python>`` and the sandbox's real result), one
    trajectory per question, rewarded 1. A rationale whose annotated values the sandbox does not reproduce gives
    none."""

    source = "solutions"

    def __init__(self, model_dir: str, cfg_dict: dict, seed: int):
        set_torch_threads(1)
        super().__init__(model_dir, cfg_dict, seed)
        self.turns = AgentTurns(None, self.tok, None, LoopSettings.from_config(self.cfg))
        self.rationales = {
            example.id: rationale
            for path in self.cfg.tasks.data_files
            for example, rationale in gsm8k_solutions(path, limit=None)
        }

    def trajectories(self, tasks: list[Task], samples: int) -> list[Trajectory]:
        out = []
        for task in tasks:
            if task.id not in self.rationales:
                raise DataError(
                    f"retrieval.buffer_source=solutions: question {task.id} has no solution in tasks.data_files"
                )
            parts, matches = gsm8k_trajectory_parts(
                self.rationales[task.id], task.answers[0], lambda code: self.tools.call("python", code)
            )
            if not all(matches):
                continue
            t = Trajectory(task.id, 0, ON_POLICY, task.id, task.kind, task.answers, self.turns.task_prompt_ids(task))
            t.question = task.question
            for is_policy_step, text in parts:
                t.append(
                    GENERATED if is_policy_step else TOOL_RESULT, self.tok(text, add_special_tokens=False)["input_ids"]
                )
            t.reward, t.correct, t.format_ok, t.finished = 1.0, True, True, True
            out.append(t)
        return out


SAMPLERS = {"scripted-expert": ExpertSampler, "policy": PolicySampler, "solutions": SolutionSampler}


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
    its files), the generator seed that maps ids like ``multihop-train-7`` to questions, the sampler (for the
    policy: which checkpoint, at which temperature) and the settings of the key embedding. Two runs share a buffer
    only when these are equal."""
    digest = hashlib.sha1()
    files = [Path(model_dir) / name for name in _TOKENIZER_FILES if (Path(model_dir) / name).is_file()]
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    rc, ro = cfg.retrieval, cfg.rollout
    source = buffer_source(cfg)
    if source == "policy":  # the starting policy's folder is named by its content (cold-start-<hash>)
        sampler = {"sampler.model": Path(model_dir).name, "rollout.temperature": ro.temperature}
    elif source == "solutions":
        sampler = {"tasks.data_files": [str(f) for f in cfg.tasks.data_files]}
    else:
        sampler = {"retrieval.buffer_error_rate": rc.buffer_error_rate}
    return {
        "tokenizer": digest.hexdigest()[:16] if files else str(Path(model_dir).resolve()),
        "tasks.seed": cfg.tasks.seed,
        "trainer.sft_seed": cfg.trainer.sft_seed,  # the samplers' seed
        "retrieval.buffer_source": source,
        **sampler,
        "retrieval.buffer_samples_per_question": rc.buffer_samples_per_question,
        "retrieval.buffer_keep_top_k": rc.buffer_keep_top_k,
        "retrieval.pooling": rc.pooling,
        "retrieval.query_max_chars": rc.query_max_chars,
        **backend_fingerprint(rc.embedder),
        "rollout.max_response_tokens": ro.max_response_tokens,
        "rollout.max_step_tokens": ro.max_step_tokens,
        "rollout.max_tool_calls": ro.max_tool_calls,
    }


def buffer_collection(cfg, model_dir: str) -> str:
    """``retrieval.collection``, or where it is left empty, ``step_traces_<hash of the buffer's fingerprint>``:
    switching the model, the tasks or the sampler then builds (or finds) its own buffer."""
    if cfg.retrieval.collection:
        return cfg.retrieval.collection
    fingerprint = json.dumps(buffer_fingerprint(cfg, model_dir), sort_keys=True)
    return f"step_traces_{hashlib.sha1(fingerprint.encode()).hexdigest()[:12]}"


def with_buffer_collection(cfg: Config, model_dir: str) -> Config:
    """``cfg`` with ``retrieval.collection`` resolved (``buffer_collection``), for the services that read it."""
    return replace(cfg, retrieval=replace(cfg.retrieval, collection=buffer_collection(cfg, model_dir)))


def buffer_questions(cfg, pool: dict[str, list[Task]]) -> list[Task]:
    """The questions whose samples fill the buffer: the first ``retrieval.buffer_questions`` RL questions of each
    family (all of them when 0, as in the paper)."""
    limit = cfg.retrieval.buffer_questions or None
    return [t for tasks in pool.values() for t in tasks[:limit]]


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


def sibling_buffer(manifest: Path, fingerprint: dict) -> tuple[str, set[str]] | None:
    """Another buffer in ``manifest``'s folder made of the same sampled steps, embedded by another backend: the same
    fingerprint but for ``retrieval.embedder`` (its collection, its finished questions), or None. Switching the
    backend then re-embeds those steps' keys instead of sampling again, so the two buffers hold the same steps."""
    ours = {k: v for k, v in fingerprint.items() if k != BACKEND_KEY}
    best = None
    for path in sorted(manifest.parent.glob("manifest-*.json")):
        if path == manifest:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # not ours to judge here; its own run reports it
        built_for = data.get("built_for") if isinstance(data, dict) else None
        if not isinstance(built_for, dict) or not isinstance(data.get("questions"), list):
            continue
        if {k: v for k, v in built_for.items() if k != BACKEND_KEY} == ours and built_for != fingerprint:
            found = (path.name[len("manifest-") : -len(".json")], set(data["questions"]))
            best = found if best is None or len(found[1]) > len(best[1]) else best
    return best


def _reindex(cfg, uri: str, sibling: str, question_ids: list[str], store: MilvusStepStore) -> list[StoredStep]:
    """Copy ``question_ids``' steps from collection ``sibling`` into ``store``, their stored keys embedded by this
    run's backend."""
    source = MilvusStepStore(uri, sibling, DIM, token=cfg.retrieval.milvus_token, create=False)
    try:
        steps = source.steps(question_ids)
    finally:
        source.close()
    rc = cfg.retrieval
    encoder = make_encoder(
        rc.embedder, prepare_backend(rc.embedder, cfg.run.artifacts_dir, rc.pooling), rc.pooling, rc.query_max_chars
    )
    for i in range(0, len(steps), 256):
        part = steps[i : i + 256]
        store.upsert(part, encoder.embed([s.key for s in part]))
    return steps


def _write_manifest(manifest: Path, done: set[str], fingerprint: dict) -> None:
    # atomic: a crash leaves the previous manifest
    write_json_atomic(
        manifest, {"embedder_version": EMBEDDER_VERSION, "built_for": fingerprint, "questions": sorted(done)}
    )


def build_buffer(cfg, model_dir: str, uri: str, tasks: list, manifest: Path, log=print) -> BufferReport:
    """Sample, filter, split, embed and upsert the buffer for ``tasks`` (loop ``Task``s) into the collection
    ``retrieval.collection`` (resolve an empty one with ``with_buffer_collection`` first)."""
    t0 = time.perf_counter()
    collection = cfg.retrieval.collection
    if not collection:
        raise StoreError("retrieval.collection is empty; resolve it with with_buffer_collection(cfg, model_dir)")
    fingerprint = buffer_fingerprint(cfg, model_dir)
    done = read_manifest(manifest, collection, fingerprint)
    todo = [t for t in tasks if t.id not in done]
    store = MilvusStepStore(uri, collection, DIM, token=cfg.retrieval.milvus_token)
    report = BufferReport(len(tasks), 0, 0, 0, len(tasks) - len(todo), 0.0)
    # a sibling's stored keys keep their last KEY_CHARS characters: enough only where the encoder reads no more
    if todo and cfg.retrieval.query_max_chars <= KEY_CHARS:
        todo = _take_from_sibling(cfg, uri, todo, store, manifest, fingerprint, done, report, log)
    if todo:
        log(
            f"step-trace buffer: sampling {len(todo)} questions x {cfg.retrieval.buffer_samples_per_question} "
            f"({buffer_source(cfg)})"
        )
        trajectories: set[str] = set()
        for batch in _sampled_steps(cfg, model_dir, todo).iter_batches(batch_size=512, batch_format="numpy"):
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
        f"step-trace buffer: {total} steps in {collection!r} ({report.steps} written now, "
        f"{report.skipped_questions} questions already done) in {report.seconds:.0f} s"
    )
    if total == 0:  # a run goes on without retrieval (a weak starting policy may call no tool), but says so
        log(
            f"step-trace buffer {collection!r} is EMPTY: no {buffer_source(cfg)} sample of its {len(tasks)} "
            "questions gave a step, so hybrid slots will retrieve nothing"
        )
    return report


def _take_from_sibling(cfg, uri, todo: list, store, manifest: Path, fingerprint: dict, done: set, report, log) -> list:
    """Copy the steps of ``todo``'s questions that a sibling buffer (same samples, another embedder) finished,
    re-embedding their keys; returns the questions still to sample."""
    sibling = sibling_buffer(manifest, fingerprint)
    if sibling is None:
        return todo
    name, finished = sibling
    copied = [t.id for t in todo if t.id in finished]
    if not copied:
        return todo
    steps = _reindex(cfg, uri, name, copied, store)
    report.steps += len(steps)
    report.tokens += sum(len(s.value_ids) for s in steps)
    report.reindexed = len(copied)
    done.update(copied)
    _write_manifest(manifest, done, fingerprint)
    log(
        f"step-trace buffer: {len(steps)} steps of {len(copied)} questions taken from {name!r} (the same "
        f"sampled steps, keys embedded by {cfg.retrieval.embedder}; nothing sampled for them)"
    )
    return [t for t in todo if t.id not in finished]


def _sampled_steps(cfg, model_dir: str, todo: list) -> ray.data.Dataset:
    """The Ray Data pipeline of a build: ``todo``'s questions -> the sampler (policy rollouts or the scripted
    expert) -> split into steps -> embedded keys; one actor each."""
    source = buffer_source(cfg)
    items = [{"id": t.id, "question": t.question, "answers": json.dumps(list(t.answers)), "kind": t.kind} for t in todo]
    # Ray Data's memory advice targets pools of many workers; this pool is one sampler sized like a rollout
    # worker, and the advice repeated every 30 s would fill the user's console for the whole build
    detectors = ray.data.DataContext.get_current().issue_detectors_config
    detectors.high_memory_detector_config.detection_time_interval_s = -1
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items) // 64))
    ds = ds.map_batches(
        SAMPLERS[source],
        fn_constructor_args=(model_dir, to_dict(cfg), cfg.trainer.sft_seed),
        batch_size=cfg.retrieval.buffer_sampler_batch if source == "policy" else 32,
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=BUILD_ACTOR_CPUS,
        batch_format="numpy",
    )
    return ds.map_batches(
        EmbedStep,
        fn_constructor_args=(
            cfg.retrieval.embedder,
            prepare_backend(cfg.retrieval.embedder, cfg.run.artifacts_dir, cfg.retrieval.pooling),
            cfg.retrieval.pooling,
            cfg.retrieval.query_max_chars,
        ),
        batch_size=256,
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=BUILD_ACTOR_CPUS,
        batch_format="numpy",
    )
