"""The control plane at 100 / 300 / 1,000 rollout engines, simulated (issue #40).

    python benchmarks/control_plane.py [--engines 100,300,1000] [--hosts 20] [--nodes 4] [--steps 3]
        [--decode-s 2] [--relay-min-workers N] [--profile 25] [--out benchmarks/results/control_plane.json]
    python benchmarks/control_plane.py --parts join    # gloo group formation alone: eager mesh vs lazy

Part ``fleet``: stub engines packed many to a process (``EngineHost``, a threaded actor: one thread per engine, so
a 1,000-engine fleet is ``--hosts`` processes, not 1,000) on ``--nodes`` fake nodes of a ``ray.cluster_utils.Cluster``,
driven by the real ``RolloutFleet``, ``WeightSync`` and ``push_weights``. An engine's rollout sleeps ``--decode-s``
(the modelled decode; no core) and returns trajectories of a real one's size (``--group-size`` per group, response
lengths sampled in [32, 256] as ``rollout.engine=simulated`` does, a 128-token prompt). Per fleet size:
- ``start_s``: spawning the hosts and ready-pinging every engine;
- per step, one group per engine: ``wall_s``; ``driver_cpu_s``, the driver process's CPU seconds in the step (its
  scheduling, dispatch, collection and deserialization: the control plane's cost), and of them
  ``driver_main_thread_cpu_s``, the thread that runs ``run_step`` (the rest is Ray's own threads), and ``gc_s``,
  Python's garbage collector's (in any thread; ``gc_s_by_generation``); ``dispatch_s``, until every group was handed
  out; ``overhead_s`` = wall - decode_s; ``relays_cpu_s``, the CPU of the per-node relays when the fleet uses them
  (``rollout.relay_min_workers``, ``--relay-min-workers``; on a cluster they run on the engines' nodes);
- ``collection``: the driver CPU (and wall) to collect one round of rollout calls, one per engine with the real
  payload, by each way the fleet has collected them, on the same engines, twice in turn: ``wait_each`` (``ray.wait``
  for one ref over every call in flight, then ``ray.get``), ``callbacks_get`` (completions queued by a callback, one
  ``ray.get`` each), ``callbacks_future`` (queued with their futures, whose ``result()`` is the value: ``run_step``
  now); and pinging every engine with one ``ray.get`` per ref (``ping_get_each``) or one for all (``ping_get_all``:
  ``replace_dead`` now);
- ``kill``: a step in which the engines of 10% of the hosts die as soon as every group is out: groups re-queued,
  engines replaced, every group exactly once, the step's wall and driver CPU;
- ``sync``: the weight-sync group over the engines + 1 stub learner: forming it (``join_s``), a push of a
  ``--model-kb`` model, first (connections made) and second (its wall, and ``push_driver_cpu_s``: the driver's CPU,
  one receive call per engine); after the kill step, ``push_weights`` (ping, re-form, push) and the ping of every
  engine alone (``ping_all_s``);
- ``driver_rss_mb``; per step ``heap_objects``, the objects the collector walks (start-up's are frozen first, as the
  launcher does; ``--no-gc-freeze`` leaves them);
- with ``--profile TOP``: one more step under cProfile, its main thread's TOP functions by own and cumulative time.
Part ``join`` (no Ray): gloo group formation, members as threads of this process with a store connection and device
each, eager full mesh (what the sync group did) against lazy connections (what it does), at 8 / 32 / 128 members,
each bounded by ``--join-timeout``.
"""

from __future__ import annotations

import os

# Loopback only (as tests/conftest.py): Ray reads it when imported, so it is set before every import below.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pickle  # noqa: E402
import pstats  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from queue import SimpleQueue  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks.cluster_sim import local_cluster, scenario_dir  # noqa: E402
from rapo_ray.config import load_config  # noqa: E402
from rapo_ray.core.devices import machine_record  # noqa: E402
from rapo_ray.core.files import write_json_atomic  # noqa: E402
from rapo_ray.core.metrics import actor_stats, gc_clock  # noqa: E402
from rapo_ray.training.trainer import push_weights  # noqa: E402
from rapo_ray.types.batch import TrajectoryBatch  # noqa: E402
from rapo_ray.types.trajectory import GENERATED, ON_POLICY, Task, Trajectory  # noqa: E402
from rapo_ray.workers.rollout import RolloutFleet  # noqa: E402
from rapo_ray.workers.sync import SyncGroup, SyncMember, WeightSync, receive_state, send_state  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPT_TOKENS, MIN_TOKENS, MAX_TOKENS = 128, 32, 256


def fake_trajectory(group_id: str, task: Task, slot: int, n: int, version: int) -> Trajectory:
    """What an engine returns for one slot: a 128-token prompt and ``n`` generated tokens with their log-probs."""
    return Trajectory(
        group_id=group_id,
        slot=slot,
        slot_kind=ON_POLICY,
        problem_id=task.id,
        task_kind=task.kind,
        answers=task.answers,
        prompt_ids=[1] * PROMPT_TOKENS,
        question=task.question,
        response_ids=[7] * n,
        segments=[(GENERATED, 0, n)],
        loss_mask=[1] * n,
        logprobs=[-1.0] * n,
        token_entropies=[0.5] * n,
        finished=True,
        finish_reason="stop",
        policy_version=version,
    )


class EngineHost:
    """Many simulated engines in one process; every method takes the engine's worker id first."""

    def __init__(self, ids: list[int], decode_s: float):
        self.decode_s = decode_s
        self.version = dict.fromkeys(ids, 0)
        self.groups: dict[int, SyncGroup] = {}
        self.stores: dict[tuple, object] = {}
        self.lock = threading.Lock()

    def ready(self, wid: int) -> dict:
        node = ray.get_runtime_context().get_node_id()
        return {"worker_id": wid, "engine": "packed", "version": self.version[wid], "node_id": node}

    def rollout(self, wid: int, groups: list[tuple], group_size: int, seed: int, evaluation: bool = False) -> dict:
        rng = random.Random(seed)
        time.sleep(self.decode_s)
        trajs = [
            fake_trajectory(gid, task, slot, rng.randint(MIN_TOKENS, MAX_TOKENS), self.version[wid])
            for gid, task in groups
            for slot in range(group_size)
        ]
        timings = {"generate_s": self.decode_s, "tool_s": 0.0, "retrieve_s": 0.0, "slowest_chunk_s": self.decode_s}
        return {
            "batch": TrajectoryBatch(trajs),
            "worker_id": wid,
            "stats": actor_stats(timings, {"slowest_chunk_s": "max"}),
        }

    def rollout_serialized(self, wid: int, *args) -> bytes:
        return pickle.dumps(self.rollout(wid, *args), protocol=pickle.HIGHEST_PROTOCOL)

    def close(self, wid: int) -> bool:
        group = self.groups.pop(wid, None)
        if group is not None:
            group.abort()
        return True

    def join_weight_sync(self, wid: int, host: str, port: int, name: str, rank: int, world: int, timeout_s) -> bool:
        """As ``SyncMember.join_weight_sync``, over one store connection per host process (not per engine) where the
        group connects lazily (``SyncGroup`` opens one per member for an eager group)."""
        import torch.distributed as dist

        with self.lock:
            store = self.stores.get((host, port))
            if store is None:
                timeout = datetime.timedelta(seconds=timeout_s)
                store = self.stores[(host, port)] = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        previous = self.groups.pop(wid, None)
        self.groups[wid] = SyncGroup.join(previous, host, port, name, rank, world, timeout_s, store)
        return True

    def receive_weights(self, wid: int) -> int:
        version, _ = receive_state(self.groups[wid])
        self.version[wid] = version
        return version


class _Call:
    """``engine.method.remote(*args)`` -> ``host.method.remote(wid, *args)``."""

    def __init__(self, host, method: str, wid: int):
        self.host, self.method, self.wid = host, method, wid

    def remote(self, *args):
        return getattr(self.host, self.method).remote(self.wid, *args)


class PackedEngine:
    """A handle to one engine of an ``EngineHost``, with a rollout worker's remote methods."""

    def __init__(self, host, wid: int):
        self.host, self.wid = host, wid
        self.member_key = f"{host._actor_id.hex()}/{wid}"
        for method in ("ready", "rollout", "rollout_serialized", "close", "join_weight_sync", "receive_weights"):
            setattr(self, method, _Call(host, method, wid))


class PackedSpawner:
    """The fleet's spawner: engines in hosts of ``per_host``; killing an engine kills its host once all its engines
    are gone (scale-down and hung workers; the benchmark's faults kill hosts directly)."""

    def __init__(self, per_host: int, decode_s: float, resources: dict | None = None):
        self.per_host, self.decode_s = per_host, decode_s
        # spread over the fake nodes, as engines on a cluster are (Ray would pack them all on the first one)
        self.host_cls = ray.remote(num_cpus=0, resources=resources, max_restarts=0, scheduling_strategy="SPREAD")(
            EngineHost
        )
        self.hosts: list = []
        self.alive: dict = {}  # host -> its engines not killed yet

    def spawn(self, ids: list[int]) -> list:
        out = []
        for k in range(0, len(ids), self.per_host):
            chunk = ids[k : k + self.per_host]
            host = self.host_cls.options(max_concurrency=len(chunk) + 4).remote(chunk, self.decode_s)
            self.hosts.append(host)
            self.alive[host] = set(chunk)
            out += [PackedEngine(host, wid) for wid in chunk]
        return out

    def kill(self, engine: PackedEngine) -> None:
        alive = self.alive.get(engine.host, set())
        alive.discard(engine.wid)
        if not alive:
            ray.kill(engine.host, no_restart=True)

    def release(self, engine: PackedEngine) -> None:
        """(The fleet dropped the engine; its host goes when ``kill`` has taken all of its engines.)"""


class StubLearner(SyncMember):
    """Learner rank 0 of the sync group: sends a ``kb`` model (one float32 tensor) the way the real ranks do."""

    def __init__(self, kb: int):
        self.weights = torch.randn(max(1, kb * 256 // 64), 64)

    def send_weights(self, version: int, bucket_bytes: int, dtype: str, senders: int) -> dict:
        t0 = time.perf_counter()
        entries = [("w", tuple(self.weights.shape), dtype, ())]
        local = {"w": self.weights.to(getattr(torch, dtype))}
        stats = send_state(self._sync_group, version, entries, local.__getitem__, senders, bucket_bytes)
        return {**stats, "learner_s": time.perf_counter() - t0}


def tasks(n: int) -> list[tuple]:
    return [(f"g{i}", Task(f"q{i}", f"What is {i} + 1?", (str(i + 1),), "math")) for i in range(n)]


def relays_cpu_s(fleet: RolloutFleet) -> float:
    """The CPU seconds the fleet's relay processes have used so far (0 without relays)."""
    return sum(ray.get([r.__ray_call__.remote(lambda relay: time.process_time()) for r in fleet.relays.values()]))


def timed_step(fleet: RolloutFleet, groups: list[tuple], group_size: int, seed: int, on_all_out=None) -> dict:
    """One ``run_step``: wall, driver CPU, time to hand out every group of the first round, its stats, and the CPU of
    the relays (``relays_cpu_s``: on a cluster they run on the engines' nodes, not the driver's)."""
    first_round = min(len(groups), len(fleet.workers))
    dispatched = []

    def on_dispatch(wid, take):
        dispatched.append(time.perf_counter())
        if len(dispatched) == first_round and on_all_out:
            on_all_out()

    relays0 = relays_cpu_s(fleet)
    cpu0, main0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
    with gc_clock() as gc_s:
        batch, stats = fleet.run_step(groups, group_size, seed=seed, on_dispatch=on_dispatch)
    wall, cpu, main_cpu = time.perf_counter() - t0, time.process_time() - cpu0, time.thread_time() - main0
    relays_s = relays_cpu_s(fleet) - relays0  # (a relay started in this step counts from its start)
    ids = batch.group_ids()
    counts = {g: 0 for g, _ in groups}
    for g in ids:
        counts[g] += 1
    return {
        "wall_s": wall,
        "driver_cpu_s": cpu,
        "driver_main_thread_cpu_s": main_cpu,
        "dispatch_s": dispatched[first_round - 1] - t0,
        "gc_s": gc_s[0],
        "gc_collections": gc_s[1],
        "gc_s_by_generation": gc_s[2],
        "heap_objects": len(gc.get_objects()),
        "trajectories": len(batch),
        "each_group_once": all(c == group_size for c in counts.values()),
        "requeued_groups": stats["requeued_groups"],
        "replaced_workers": stats["replaced_workers"],
        "relays": len(fleet.relays),
        "lost_relays": stats["lost_relays"],
        "relays_cpu_s": relays_s,
    }


def profiled_step(fleet: RolloutFleet, groups: list[tuple], group_size: int, seed: int, top: int) -> dict:
    """One ``run_step`` under cProfile, timed by the main thread's CPU clock (waiting is not counted): the driver's
    main thread's functions by their own CPU seconds (cProfile sees no other thread: the CPU Ray's own threads spend,
    deserializing results among it, is ``other_threads_cpu_s``)."""
    prof = cProfile.Profile(time.thread_time)
    cpu0, main0 = time.process_time(), time.thread_time()
    prof.enable()
    fleet.run_step(groups, group_size, seed=seed)
    prof.disable()
    cpu, main_cpu = time.process_time() - cpu0, time.thread_time() - main0
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{Path(path).name}:{line}:{name}", "calls": calls, "own_s": own, "cum_s": cumulative})
    rows.sort(key=lambda r: -r["own_s"])
    return {
        "driver_cpu_s": cpu,
        "main_thread_cpu_s": main_cpu,
        "other_threads_cpu_s": cpu - main_cpu,
        "profiled_s": stats.total_tt,
        "by_own_time": rows[:top],
        "by_cumulative_time": sorted(rows, key=lambda r: -r["cum_s"])[:top],
    }


def collection_patterns(fleet: RolloutFleet, groups: list[tuple], group_size: int, reps: int = 2) -> dict:
    """Driver CPU and wall seconds per way of collecting one round of calls (see the module's docstring)."""
    handles = fleet.handles()

    def dispatch() -> list:
        return [h.rollout.remote([g], group_size, i, False) for i, (h, g) in enumerate(zip(handles, groups))]

    def wait_each(refs: list) -> None:
        pending = refs
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            ray.get(ready)

    def callbacks(refs: list, use_future: bool) -> None:
        finished: SimpleQueue = SimpleQueue()
        for ref in refs:
            ref.future().add_done_callback(lambda fut, ref=ref: finished.put((ref, fut)))
        for _ in refs:
            ref, fut = finished.get()
            fut.result() if use_future else ray.get(ref)

    patterns = {
        "wait_each": lambda: wait_each(dispatch()),
        "callbacks_get": lambda: callbacks(dispatch(), use_future=False),
        "callbacks_future": lambda: callbacks(dispatch(), use_future=True),
        "ping_get_each": lambda: [ray.get(r) for r in [h.ready.remote() for h in handles]],
        "ping_get_all": lambda: ray.get([h.ready.remote() for h in handles]),
    }
    out: dict = {name: {"driver_cpu_s": [], "wall_s": []} for name in patterns}
    for _ in range(reps):
        for name, run in patterns.items():
            cpu0, t0 = time.process_time(), time.perf_counter()
            run()
            out[name]["wall_s"].append(time.perf_counter() - t0)
            out[name]["driver_cpu_s"].append(time.process_time() - cpu0)
    return out


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def fleet_size(args, n: int, resources: dict | None = None) -> dict:
    """Every measurement of one fleet size (see the module's docstring); ``resources``: what each host and the stub
    learner ask for (the fake nodes' ``sim_node``)."""
    per_host = math.ceil(n / args.hosts)
    cfg = load_config(
        overrides=[
            f"rollout.num_workers={n}",
            f"rollout.max_workers={n}",
            "rollout.min_workers=1",
            f"resources.placement_timeout_s={args.timeout}",
            *([f"rollout.relay_min_workers={args.relay_min_workers}"] if args.relay_min_workers is not None else []),
        ]
    )
    spawner = PackedSpawner(per_host, args.decode_s, resources)
    t0 = time.perf_counter()
    fleet = RolloutFleet("", cfg, None, spawner=spawner)
    if args.gc_freeze:
        gc.freeze()  # as the launcher does once its topology is up: collections skip what start-up made
    out = {"engines": n, "hosts": len(spawner.hosts), "per_host": per_host, "start_s": time.perf_counter() - t0}
    out["relay_min_workers"] = cfg.rollout.relay_min_workers
    out["uses_relays"] = fleet.uses_relays()
    learner = ray.remote(num_cpus=0, resources=resources)(StubLearner).remote(args.model_kb)
    sync = WeightSync(bucket_mb=32, timeout_s=args.timeout)
    groups = tasks(n)
    try:
        t0 = time.perf_counter()
        sync.form_group([learner], fleet.handles())
        join_s = time.perf_counter() - t0
        pushes, push_cpu = [], []
        for v in (1, 2):
            cpu0 = time.process_time()
            pushes.append(sync.push([learner], fleet.handles(), v) / 1000)
            push_cpu.append(time.process_time() - cpu0)
        out["sync"] = {"members": n + 1, "join_s": join_s, "first_push_s": pushes[0], "push_s": pushes[1]}
        out["sync"]["push_driver_cpu_s"] = push_cpu[1]  # the driver's calls: one receive per engine
        print(n, "engines: start", round(out["start_s"], 2), "s; sync", json.dumps(out["sync"]), flush=True)
        out["first_step"] = timed_step(fleet, groups, args.group_size, seed=0)  # (the driver's first imports)
        steps = [timed_step(fleet, groups, args.group_size, seed=s) for s in range(1, args.steps + 1)]
        out["steps"] = steps
        for key in ("wall_s", "driver_cpu_s", "driver_main_thread_cpu_s", "dispatch_s", "gc_s", "relays_cpu_s"):
            out[f"median_{key}"] = statistics.median(s[key] for s in steps)
        out["median_overhead_s"] = out["median_wall_s"] - args.decode_s
        print(n, "engines: steps", json.dumps({k: round(v, 3) for k, v in out.items() if "median" in k}), flush=True)
        if args.profile:
            out["profile"] = profiled_step(fleet, groups, args.group_size, seed=args.steps + 2, top=args.profile)
            print(n, "engines: profile", json.dumps({k: v for k, v in out["profile"].items() if k.endswith("_s")}))
        out["collection"] = collection_patterns(fleet, groups, args.group_size)
        print(n, "engines: collection", json.dumps(out["collection"]), flush=True)
        victims = spawner.hosts[: max(1, round(len(spawner.hosts) * 0.1))]
        kill = timed_step(
            fleet, groups, args.group_size, seed=args.steps + 1, on_all_out=lambda: [ray.kill(h) for h in victims]
        )
        kill["killed_engines"] = sum(len(spawner.alive[h]) for h in victims)
        out["kill"] = kill
        t0 = time.perf_counter()
        replaced = push_weights(sync, fleet, [learner], 3)
        out["sync"]["push_after_kill_s"] = time.perf_counter() - t0
        out["sync"]["replaced_at_push"] = replaced
        t0 = time.perf_counter()
        fleet.replace_dead("benchmark")
        out["ping_all_s"] = time.perf_counter() - t0
        out["driver_rss_mb"] = rss_mb()
        print(n, "engines: kill", json.dumps({k: v for k, v in kill.items()}), flush=True)
    finally:
        fleet.shutdown()
        ray.kill(learner)
        for host in spawner.hosts:
            ray.kill(host)
    return out


def fleet_part(args) -> dict:
    with scenario_dir("rapo_ctrl_") as tmp:
        _, cluster = local_cluster(tmp, auth=False)  # (Ray is imported already; everything binds to 127.0.0.1)
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=0, resources={"sim_node": 10_000}, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            return {str(n): fleet_size(args, n, {"sim_node": 1}) for n in args.engines}
        finally:
            ray.shutdown()
            cluster.shutdown()


_STORES: list = []  # every store part ``join`` made: members that timed out still use theirs (kept to the end)


def _join(members: int, lazy: bool, timeout_s: float) -> float | None:
    """Seconds for ``members`` gloo ranks to form a group, each a thread of this process with its own store
    connection and device (as a member process has); None if they had not within ``timeout_s`` (those threads are
    left to time out on their own)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    _STORES.append(master)
    pgs = [None] * members

    def join(rank):
        store = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timeout)
        _STORES.append(store)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=lazy)]
        opts._timeout = timeout
        try:
            pgs[rank] = dist.ProcessGroupGloo(dist.PrefixStore("g/", store), rank, members, opts)
        except RuntimeError:
            pass

    t0 = time.perf_counter()
    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in range(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, timeout_s - (time.perf_counter() - t0)))
    took = time.perf_counter() - t0
    return took if all(p is not None for p in pgs) else None


def join_part(args) -> dict:
    """Eager (every pair connects at formation: members (members - 1) / 2 connections, members - 1 sockets in every
    member) against lazy (none until a pair exchanges data). Each mode twice, alternating: a burst of new store
    connections on this box stalls some of them 5 s (a sandbox artefact, not gloo's), so single runs mislead. 192
    eager members in one process pass its 20,000 open-file limit (gloo aborts), hence 128 at most."""
    out = {}
    for members in (8, 32, 128):
        row = {"eager_connections": members * (members - 1) // 2, "lazy_s": [], "eager_s": []}
        for mode in ("lazy", "eager", "lazy", "eager"):
            row[f"{mode}_s"].append(_join(members, mode == "lazy", args.join_timeout))
        out[str(members)] = row
        print("join", members, json.dumps(row), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="join,fleet", help="join, fleet or both")
    ap.add_argument("--engines", default="100,300,1000", help="fleet sizes")
    ap.add_argument("--hosts", type=int, default=20, help="processes the engines are packed into")
    ap.add_argument("--nodes", type=int, default=4, help="fake nodes the hosts spread over")
    ap.add_argument(
        "--steps",
        type=int,
        default=3,
        help="measured steps per fleet size (after a first one; then one with 10%% killed)",
    )
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--decode-s", type=float, default=2.0, help="an engine's modelled rollout time per call")
    ap.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="leave the start-up heap to the garbage collector (the launcher freezes it; this measures the difference)",
    )
    ap.add_argument("--model-kb", type=int, default=64, help="the pushed model's size")
    ap.add_argument(
        "--relay-min-workers",
        type=int,
        default=None,
        help="rollout.relay_min_workers for the fleet (default: the config's; 0: one call per engine, no relays)",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="bound on starts and pushes (s)")
    ap.add_argument("--join-timeout", type=float, default=90.0, help="bound on one group formation in part join")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TOP",
        help="one more step per size under cProfile; its TOP functions by own and by cumulative time (0: none)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "control_plane.json")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"join", "fleet"}:
        sys.exit(f"--parts {args.parts!r}: give join, fleet or both")
    try:
        args.engines = [int(n) for n in args.engines.split(",")]
    except ValueError:
        sys.exit(f"--engines {args.engines!r}: give comma-separated integers")
    if min(args.engines) < 1 or args.hosts < 1 or args.nodes < 1:
        sys.exit("--engines, --hosts and --nodes must be >= 1")
    report = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "machine": machine_record()}
    if "join" in parts:
        report["join"] = join_part(args)
    if "fleet" in parts:
        report["fleet"] = fleet_part(args)
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
