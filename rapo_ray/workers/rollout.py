"""The rollout fleet: ``RolloutWorker`` actors (engine + agent loop + tools + retrieval handle) and the
``RolloutFleet`` that feeds them prompt groups, grows and shrinks, and replaces dead workers.

Exactly-once accounting: every group of a step has an id; the fleet hands out chunks of groups, records
which worker holds which chunk, and when a worker dies re-queues exactly the groups of its unfinished
chunk. Results are keyed by group id, so a group can never be counted twice.

A large fleet (``rollout.relay_min_workers``) makes its calls through one ``RolloutRelay`` per node: one call per
node per round instead of one per worker, with the same per-worker outcomes.
"""

from __future__ import annotations

import math
import pickle
import time
import zlib
from collections import deque
from dataclasses import dataclass
from queue import SimpleQueue

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rapo_ray.agent.loop import AgentLoop, LoopSettings
from rapo_ray.algos.registry import algorithm_of
from rapo_ray.algos.rollout import ON_POLICY_ROLLOUT
from rapo_ray.config import from_dict, to_dict
from rapo_ray.core.devices import pick_device, set_deterministic
from rapo_ray.core.errors import WORKER_DIED, brief
from rapo_ray.core.metrics import actor_stats, merge_actor_stats
from rapo_ray.engines import make_engine
from rapo_ray.envs.suite import build_tools
from rapo_ray.model.factory import context_length, load_model_and_tokenizer, load_tokenizer, set_torch_threads
from rapo_ray.retrieval.client import HANDLE_OPTIONS, HandleStepRetriever
from rapo_ray.retrieval.search_index import search_index_for
from rapo_ray.types.batch import TrajectoryBatch
from rapo_ray.workers.colocated import SegmentImporter, SharedSegment
from rapo_ray.workers.relay import RolloutRelay
from rapo_ray.workers.sync import SyncMember, receive_state


class RolloutWorker(SyncMember):
    def __init__(self, worker_id: int, model_dir: str, cfg_dict: dict, retrieval_app: str | None = None):
        self.cfg = cfg = from_dict(cfg_dict)
        set_torch_threads(cfg.rollout.threads_per_worker)
        self.worker_id = worker_id
        set_deterministic(cfg.run.deterministic)
        self.tok = load_tokenizer(model_dir)
        max_context = context_length(model_dir)  # the checkpoint's own window (a real model's, not the bundled default)
        self.engine = make_engine(
            cfg.rollout,
            model_dir,
            load_model_and_tokenizer,
            dtype=cfg.model.dtype,
            max_model_len=max_context,
            seed=cfg.trainer.seed + worker_id,
            device=pick_device(cfg.resources.gpus_per_rollout_worker, "resources.gpus_per_rollout_worker"),
        )
        self.tools = build_tools(cfg.tasks, cfg.rollout, search_index_for(cfg.tasks))
        retriever = None
        if retrieval_app:
            import logging

            from ray import serve

            logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the handle's INFO lines stay out of the console

            handle = serve.get_deployment_handle("StepRetriever", app_name=retrieval_app).options(**HANDLE_OPTIONS)
            retriever = HandleStepRetriever(
                handle,
                cfg.retrieval.noise_prob,
                cfg.retrieval.question_scope,
                seed=cfg.trainer.seed + 1000 + worker_id,
                max_chars=cfg.retrieval.query_max_chars,
                timeout_s=cfg.retrieval.timeout_s,
            )
        self.train_rollout = algorithm_of(cfg.algo).rollout(cfg.algo)
        self.train_settings = LoopSettings.from_config(cfg)
        self.eval_settings = LoopSettings.from_config(cfg, evaluation=True)
        self.train_settings.max_context = self.eval_settings.max_context = max_context
        self.loop_cls = AgentLoop  # imported lazily above (actor-side imports)
        self.retriever = retriever
        self.last_receive: dict = {}
        self._importer = SegmentImporter()  # the colocated handoff's mapped buffers (resources.colocate)

    def ready(self) -> dict:
        return {
            "worker_id": self.worker_id,
            "engine": self.engine.name,
            "version": self.engine.version,
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def rollout(self, groups: list[tuple], group_size: int, seed: int, evaluation: bool = False) -> dict:
        """``groups``: (group_id, Task) pairs. Training rollouts follow the algorithm's rollout policy, evaluation
        ones sample on-policy. Returns the trajectories as a ``TrajectoryBatch`` and timing stats."""
        import copy

        settings = copy.copy(self.eval_settings if evaluation else self.train_settings)
        settings.seed = seed
        loop = self.loop_cls(
            self.engine,
            self.tok,
            self.tools,
            settings,
            retriever=None if evaluation else self.retriever,
            rollout=ON_POLICY_ROLLOUT if evaluation else self.train_rollout,
        )
        t0, cpu0 = time.perf_counter(), time.process_time()
        trajs, stats = loop.run_groups([t for _, t in groups], group_size, group_ids=[g for g, _ in groups])
        timings = {"generate_s": stats.generate_s, "tool_s": stats.tool_s, "retrieve_s": stats.retrieve_s}
        # this worker's CPU (the in-process engine and the agent loop, every thread; not the sandboxed tool calls)
        timings["cpu_s"] = time.process_time() - cpu0
        return {
            "batch": TrajectoryBatch(trajs),
            "worker_id": self.worker_id,
            "stats": actor_stats({**timings, "slowest_chunk_s": time.perf_counter() - t0}, {"slowest_chunk_s": "max"}),
        }

    def rollout_serialized(self, groups: list[tuple], group_size: int, seed: int, evaluation: bool = False) -> bytes:
        """``rollout``'s answer, pickled here: a relay forwards bytes as they are, where it would otherwise unpickle
        and pickle again every trajectory it passes on (the fleet unpickles them once)."""
        return pickle.dumps(self.rollout(groups, group_size, seed, evaluation), protocol=pickle.HIGHEST_PROTOCOL)

    # ------------------------------------------------------------ weights

    def receive_weights(self) -> int:
        """Receive one push from the learner and load it into the engine once complete; returns its version."""
        if self._sync_group is None:
            raise RuntimeError(f"rollout worker {self.worker_id} is in no weight-sync group")
        t0 = time.perf_counter()
        try:
            version, state_dict = receive_state(self._sync_group)
        except BaseException:
            self._sync_group = None  # aborted; the driver forms a new group
            raise
        t1 = time.perf_counter()
        self.engine.load_weights(state_dict, version)
        self.last_receive = {  # bench_sync reports it
            "receive_s": t1 - t0,
            "load_s": time.perf_counter() - t1,
            **self._sync_group.last_receive,
        }
        return version

    def import_weights(self, segments: list[SharedSegment]) -> int:
        """Colocated mode: read the learner ranks' shared buffers (one ``SharedSegment`` each) and load the
        weights; returns their version."""
        t0 = time.perf_counter()
        version, state_dict = self._importer.state_dict(segments)
        t1 = time.perf_counter()
        self.engine.load_weights(state_dict, version)
        self.last_receive = {"receive_s": t1 - t0, "load_s": time.perf_counter() - t1}
        return version

    def release_memory(self) -> int:
        """The engine's rebuildable memory (its KV cache) freed while the learners run; returns the bytes."""
        return self.engine.release_memory()

    def state_dict(self) -> dict:
        model = getattr(self.engine, "model", None)
        if model is None:
            raise RuntimeError("state_dict needs the torch engine")
        return {k: v.clone() for k, v in model.state_dict().items()}

    def close(self) -> bool:
        self.tools.close()
        self.engine.close()
        return True


# Starts in a row in which some new rollout worker died before it answered, before the fleet gives up.
START_ATTEMPTS = 3


@dataclass
class FleetEvent:
    time: float
    kind: str  # "start" | "scale_up" | "scale_down" | "replaced" | "requeued"
    detail: str


class ActorSpawner:
    """Starts each rollout worker as an actor of its own (the fleet's default ``spawner``)."""

    def __init__(self, cfg, model_dir: str, retrieval_app: str | None):
        rc = cfg.resources
        self.actor_cls = ray.remote(
            num_cpus=rc.cpus_per_rollout_worker,
            num_gpus=rc.gpus_per_rollout_worker,
            resources=dict(rc.rollout_custom_resources) or None,
            max_restarts=0,
            max_concurrency=1,
        )(RolloutWorker)
        self.args = (model_dir, to_dict(cfg), retrieval_app)

    def spawn(self, ids: list[int]) -> list:
        return [self.actor_cls.remote(wid, *self.args) for wid in ids]

    def kill(self, handle) -> None:
        ray.kill(handle)

    def release(self, handle) -> None:
        """The fleet no longer counts ``handle`` (dead, or scaled away): nothing to free for a plain actor."""


class ColocatedSpawner(ActorSpawner):
    """Colocated mode (``resources.colocate``): each worker goes into a free one of the learners' first ``bundles``
    placement-group bundles (those sized for a worker too, ``learner_bundles``), beside that bundle's learner rank
    (its GPU share, on one machine); a dead worker's replacement takes the bundle it left."""

    def __init__(self, cfg, model_dir: str, retrieval_app: str | None, placement_group, bundles: int):
        super().__init__(cfg, model_dir, retrieval_app)
        self.num_gpus = cfg.resources.colocated_shares()[1]  # (its share of the bundle's GPU)
        self.strategy = lambda i: PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=i)
        self.bundle_of: dict[str, int] = {}  # actor id -> its bundle
        self.bundles = bundles

    def spawn(self, ids: list[int]) -> list:
        free = sorted(set(range(self.bundles)) - set(self.bundle_of.values()))
        if len(ids) > len(free):
            raise RuntimeError(
                f"colocated mode: {len(ids)} more rollout worker(s) asked for, {len(free)} of the learners' "
                f"{self.bundles} worker bundles free (resources.colocate: rollout.num_workers workers, each beside "
                "its own learner rank)"
            )
        handles = []
        for wid, bundle in zip(ids, free):
            options = {"num_gpus": self.num_gpus, "scheduling_strategy": self.strategy(bundle)}
            handle = self.actor_cls.options(**options).remote(wid, *self.args)
            self.bundle_of[handle._actor_id.hex()] = bundle
            handles.append(handle)
        return handles

    def release(self, handle) -> None:
        self.bundle_of.pop(handle._actor_id.hex(), None)


class RolloutFleet:
    """Owns the rollout workers; ``run_step`` distributes a step's groups and collects every one exactly once.

    ``spawner``: what starts (``spawn(ids) -> handles``), kills (``kill(handle)``) and lets go of
    (``release(handle)``, when the fleet drops a worker) workers; default ``ActorSpawner``. Any handle with the
    worker's remote methods (``ready``, ``rollout``, ``close``, the sync member's) can stand in: the control-plane
    benchmark packs many simulated engines into one process this way."""

    def __init__(self, model_dir: str, cfg, retrieval_app: str | None, on_new_workers=None, spawner=None):
        self.cfg = cfg
        self.spawner = spawner or ActorSpawner(cfg, str(model_dir), retrieval_app)
        self.workers: dict[int, ray.actor.ActorHandle] = {}
        self.node_of: dict[int, str | None] = {}  # worker id -> the node its ``ready`` reported
        self.relays: dict[str | None, ray.actor.ActorHandle] = {}  # node -> its relay (made at first use)
        self._next_id = 0
        self.events: list[FleetEvent] = []
        self.start_timeout_s = cfg.resources.placement_timeout_s
        # called with the handles of workers that joined (scale-up, replacement) before they take work: the
        # trainer sends them the current weights (they start from the model folder)
        self.on_new_workers = on_new_workers
        self.scale(cfg.rollout.num_workers)

    # ------------------------------------------------------------ membership

    def _start(self, n: int, bring_up: bool = True) -> list[int]:
        """Start ``n`` workers; with ``bring_up``, hand them to ``on_new_workers`` (the current weights). A worker
        that dies while it starts (Ray's memory monitor, its node lost) is started again, up to
        ``START_ATTEMPTS`` times in a row; then the fleet gives up with an error that says why."""
        node_of: dict[int, str | None] = {}  # the started workers' nodes, as their ``ready`` answered
        for attempt in range(1, START_ATTEMPTS + 1):
            ids = list(range(self._next_id, self._next_id + n))
            self._next_id += n
            self.workers.update(zip(ids, self.spawner.spawn(ids)))
            answers, died = self._await_ready(ids)
            node_of.update((wid, answer.get("node_id")) for wid, answer in answers.items())
            for wid, exc in died.items():
                self.spawner.release(self.workers.pop(wid))
                self.events.append(
                    FleetEvent(time.time(), "replaced", f"worker {wid} died while starting ({brief(exc)})")
                )
            if not died:
                break
            if attempt == START_ATTEMPTS:
                last = next(iter(died.values()))
                raise RuntimeError(
                    f"rollout workers died while starting, {START_ATTEMPTS} times in a row (the last: "
                    f"{type(last).__name__}); an OutOfMemoryError means the node lacks the memory for another worker"
                ) from last
            n = len(died)
        self.node_of.update(node_of)
        joined: dict[str | None, dict[int, object]] = {}
        for wid, node in node_of.items():
            joined.setdefault(node, {})[wid] = self.workers[wid]
        # an async actor may run calls out of order: the new workers are attached before any fan-out names them
        for node, handles in joined.items():
            if node in self.relays:
                try:
                    ray.get(self.relays[node].attach.remote(handles))
                except WORKER_DIED:  # the next fan-out to the node starts a new relay, holding every worker
                    self.relays.pop(node)
        if bring_up and self.on_new_workers is not None:
            self.on_new_workers([self.workers[w] for w in node_of])
        return list(node_of)

    def _await_ready(self, ids: list[int]) -> tuple[dict[int, dict], dict[int, BaseException]]:
        """Each new worker's ``ready`` answer, and the ones that died instead (worker id -> the error)."""
        refs = [self.workers[w].ready.remote() for w in ids]
        try:
            try:
                return dict(zip(ids, ray.get(refs, timeout=self.start_timeout_s))), {}  # the usual case: one call
            except WORKER_DIED:
                pass
            answers, died = {}, {}
            for wid, ref in zip(ids, refs):
                try:
                    answers[wid] = ray.get(ref, timeout=self.start_timeout_s)
                except WORKER_DIED as exc:
                    died[wid] = exc
            return answers, died
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"{len(ids)} rollout worker(s) did not start within {self.start_timeout_s:.0f} s: the cluster cannot "
                f"place actors needing {self.cfg.resources.cpus_per_rollout_worker:g} CPU / "
                f"{self.cfg.resources.gpus_per_rollout_worker:g} GPU each"
            ) from None

    def _forget(self, wid: int):
        """Take a worker out of the fleet (and out of its node's relay); returns its handle, or None."""
        node = self.node_of.pop(wid, None)
        if node in self.relays:
            self.relays[node].detach.remote([wid])
        handle = self.workers.pop(wid, None)
        if handle is not None:
            self.spawner.release(handle)
        return handle

    def scale(self, n: int) -> None:
        n = max(self.cfg.rollout.min_workers, min(self.cfg.rollout.max_workers, n))
        cur = len(self.workers)
        if n > cur:
            ids = self._start(n - cur)
            self.events.append(FleetEvent(time.time(), "scale_up" if cur else "start", f"+{len(ids)} -> {n}"))
        elif n < cur:
            self._stop([self._forget(wid) for wid in sorted(self.workers)[n - cur :]])
            self.events.append(FleetEvent(time.time(), "scale_down", f"-{cur - n} -> {n}"))

    def replace_dead(self, during: str, timeout_s: float = 30.0, bring_up: bool = True) -> int:
        """Ping every worker; replace each one that is dead, or that does not answer within ``timeout_s`` (killed
        first: an idle worker answers in milliseconds). The new ones get the current weights
        (``on_new_workers``) before they take work, unless ``bring_up`` is False (the caller pushes to the whole
        fleet next). For phases outside ``run_step`` (weight sync), which must not fail the run for a worker that
        died while idle. Returns how many were replaced."""
        pings = {self.workers[w].ready.remote(): w for w in sorted(self.workers)}
        if not pings:
            return 0
        answered, silent = ray.wait(list(pings), num_returns=len(pings), timeout=timeout_s)
        dead = []
        try:
            ray.get(answered)  # one call in the usual case (every worker alive): 1,000 single gets took 0.9 s
        except WORKER_DIED:
            for ref in answered:
                try:
                    ray.get(ref)
                except WORKER_DIED:
                    dead.append((pings[ref], "found dead"))
        for ref in silent:
            self.spawner.kill(self.workers[pings[ref]])
            dead.append((pings[ref], f"did not answer in {timeout_s:.0f} s"))
        for wid, why in dead:
            self._forget(wid)
            self.events.append(FleetEvent(time.time(), "replaced", f"worker {wid} {why} during {during}"))
        if dead:
            self._start(len(dead), bring_up)
        return len(dead)

    def release_memory(self) -> int:
        """Every worker's engine frees its KV cache (``RolloutWorker.release_memory``); returns the bytes freed in
        all. A worker found dead here is left to the weight push that follows, which replaces it."""
        refs = [w.release_memory.remote() for w in self.handles()]
        freed = 0
        for ref in refs:
            try:
                freed += ray.get(ref)
            except WORKER_DIED:
                pass
        return freed

    def autoscale(self, backlog_groups: int, groups_per_worker: int = 2) -> int:
        """Backlog policy: one worker per ``groups_per_worker`` queued groups, within [min, max]."""
        want = math.ceil(backlog_groups / max(groups_per_worker, 1)) if backlog_groups else self.cfg.rollout.min_workers
        self.scale(want)
        return len(self.workers)

    # ------------------------------------------------------------ relays

    def uses_relays(self) -> bool:
        """Whether this many workers are called through per-node relays (``rollout.relay_min_workers``)."""
        least = self.cfg.rollout.relay_min_workers
        return least > 0 and len(self.workers) >= least

    def _relay(self, node: str | None):
        """The relay of ``node``, started (on that node, holding its workers) at first use."""
        relay = self.relays.get(node)
        if relay is None:
            placement = NodeAffinitySchedulingStrategy(node, soft=True) if node else None
            relay_cls = ray.remote(num_cpus=0, max_restarts=0, scheduling_strategy=placement)(RolloutRelay)
            relay = self.relays[node] = relay_cls.remote(node)
            ray.get(relay.attach.remote({wid: self.workers[wid] for wid, n in self.node_of.items() if n == node}))
        return relay

    # ------------------------------------------------------------ work

    def _send(self, assignments: list[tuple], group_size: int, evaluation: bool, via_relays: bool, inflight, finished):
        """Make the rollout calls of ``assignments`` ((worker id, groups, seed) each): one per worker, or one per
        node through its relay. ``inflight`` maps each call to (through a relay, its node, [(worker id, groups)])."""
        calls = []
        if via_relays:
            by_node: dict[str | None, list[tuple]] = {}
            for a in assignments:
                by_node.setdefault(self.node_of.get(a[0]), []).append(a)
            for node, part in by_node.items():
                args = {wid: (take, group_size, gseed, evaluation) for wid, take, gseed in part}
                calls.append((self._relay(node).fan_out.remote("rollout_serialized", args), node, part))
        else:
            for wid, take, gseed in assignments:
                calls.append(
                    (self.workers[wid].rollout.remote(take, group_size, gseed, evaluation), None, [(wid, take, gseed)])
                )
        for ref, node, part in calls:
            inflight[ref] = (via_relays, node, [(wid, take) for wid, take, _ in part])
            ref.future().add_done_callback(lambda fut, ref=ref: finished.put((ref, fut)))

    def run_step(
        self, groups: list[tuple], group_size: int, seed: int, evaluation: bool = False, on_dispatch=None
    ) -> tuple[TrajectoryBatch, dict]:
        """Roll out every group once. A dead worker's unfinished groups go back to the queue and the worker
        is replaced. Returns the step's batch, ordered by (group, slot), and per-step stats: the workers'
        ``generate_s``/``tool_s``/``retrieve_s`` summed, ``slowest_chunk_s`` (max), ``requeued_groups``,
        ``replaced_workers`` and ``lost_relays``.

        The driver's cost is O(1) per finished call, whatever the fleet's size: each call's completion is queued
        by a callback (no ``ray.wait`` over every call in flight) together with its future, whose ``result()`` is the
        value already fetched (no ``ray.get`` per call), idle workers wait in a deque, and the workers that died in
        one round are replaced together (one start, not one per worker). With relays (``uses_relays``) a call
        covers a node's workers of the round. A relay that dies (its node lost) has its groups re-queued, and the
        rest of the step calls the workers directly."""
        queue = deque(groups)
        done: dict[str, TrajectoryBatch] = {}
        inflight: dict[ray.ObjectRef, tuple[bool, str | None, list[tuple[int, list[tuple]]]]] = {}
        finished: SimpleQueue = SimpleQueue()  # (ref, future) of calls that returned or failed, in completion order
        idle = deque(sorted(self.workers))
        worker_stats: list[dict] = []
        lost = {"requeued_groups": 0, "replaced_workers": 0, "lost_relays": 0}
        chunk = max(1, math.ceil(len(groups) / max(len(self.workers), 1)))
        via_relays = self.uses_relays()

        def requeue(take: list[tuple]) -> None:
            queue.extendleft(reversed(take))
            lost["requeued_groups"] += len(take)

        while queue or inflight:
            assignments = self._assign(queue, idle, chunk, seed)
            self._send(assignments, group_size, evaluation, via_relays, inflight, finished)
            if on_dispatch:
                for wid, take, _ in assignments:
                    on_dispatch(wid, take)
            if not inflight:
                raise RuntimeError(f"rollout: {len(queue)} groups queued and no rollout worker to run them")
            calls = [finished.get()]
            while not finished.empty():
                calls.append(finished.get())
            died = []
            for ref, fut in calls:
                through_relay, node, part = inflight.pop(ref)
                values, dead = self._outcomes(fut, through_relay, part)
                if values is None:  # the relay itself died: its workers may live; their groups run again
                    self.relays.pop(node, None)
                    via_relays = False
                    lost["lost_relays"] += 1
                    for wid, take in part:
                        requeue(take)
                        idle.append(wid)
                    self._event("requeued", f"relay of node {node} died; {len(part)} workers' groups re-queued")
                    continue
                for wid, take in part:
                    if wid in dead:
                        requeue(take)
                        self._forget(wid)
                        died.append(wid)
                        self._event("requeued", f"worker {wid} died ({dead[wid]}); {len(take)} groups re-queued")
                        continue
                    idle.append(wid)
                    keep_groups(values[wid]["batch"], done)
                    worker_stats.append(values[wid]["stats"])
            if died:
                idle.extend(self._start(len(died)))
                lost["replaced_workers"] += len(died)
                for wid in died:
                    self._event("replaced", f"worker {wid} replaced")
        missing = [g for g, _ in groups if g not in done]
        if missing:
            raise RuntimeError(f"rollout lost groups {missing[:5]}")
        stats = {"generate_s": 0.0, "tool_s": 0.0, "retrieve_s": 0.0, **merge_actor_stats(worker_stats), **lost}
        return TrajectoryBatch.concat([done[g] for g, _ in groups]), stats

    def _event(self, kind: str, what: str) -> None:
        self.events.append(FleetEvent(time.time(), kind, what))

    def _assign(self, queue: deque, idle: deque, chunk: int, seed: int) -> list[tuple]:
        """(worker id, groups, seed) for each idle worker while groups are queued: ``chunk`` groups each, seeded by
        the step's seed and the groups' ids (so a re-queued group's draws do not depend on which worker runs it)."""
        assignments = []
        while queue and idle:
            wid = idle.popleft()
            if wid not in self.workers:  # replaced meanwhile
                continue
            take = [queue.popleft() for _ in range(min(chunk, len(queue)))]
            gseed = (seed * 1_000_003 + sum(zlib.crc32(str(g).encode()) for g, _ in take)) % (2**31)
            assignments.append((wid, take, gseed))
        return assignments

    @staticmethod
    def _outcomes(fut, through_relay: bool, part: list[tuple]) -> tuple[dict | None, dict]:
        """A finished call's per-worker outcomes: (values by worker id, why each dead worker died). A worker's own
        error (not its death) is raised: it is a bug or bad input, and re-running its groups would repeat it.
        ``(None, {})`` when the relay making the call died."""
        if not through_relay:
            wid = part[0][0]
            try:
                return {wid: fut.result()}, {}
            except WORKER_DIED as exc:
                return {}, {wid: type(exc).__name__}
        try:
            answer = fut.result()
        except WORKER_DIED:
            return None, {}
        for exc in answer["errors"].values():
            raise exc
        return {wid: pickle.loads(value) for wid, value in answer["values"].items()}, answer["died"]

    def handles(self) -> list:
        return [self.workers[w] for w in sorted(self.workers)]

    def _stop(self, handles: list) -> None:
        """Close the workers' engines and tools (all at once, 30 s at most), then kill them."""
        if not handles:
            return
        ray.wait([w.close.remote() for w in handles], num_returns=len(handles), timeout=30)
        for w in handles:
            self.spawner.kill(w)

    def shutdown(self):
        self._stop(list(self.workers.values()))
        self.workers.clear()
        self.node_of.clear()
        for relay in self.relays.values():
            ray.kill(relay)
        self.relays.clear()


def keep_groups(chunk_batch: TrajectoryBatch, done: dict[str, TrajectoryBatch]) -> None:
    """A worker's chunk into ``done``, one batch per group ordered by slot; the first result of a group wins (a
    re-queued group that also finished elsewhere is never counted twice)."""
    by_group: dict[str, list[int]] = {}
    for i, gid in enumerate(chunk_batch.group_ids()):
        by_group.setdefault(gid, []).append(i)
    for gid, idx in by_group.items():
        idx.sort(key=lambda i: chunk_batch.trajectories[i].slot)
        done.setdefault(gid, chunk_batch.select(idx))
