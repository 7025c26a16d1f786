"""Weight-sync size ladder: the learner ranks -> 1, 2, 4 rollout engines, against a plain loopback copy.

    python benchmarks/bench_sync.py                                   # bundled, 30m, qwen2.5-0.5b; 1/2/4 workers
    python benchmarks/bench_sync.py --sizes bundled --pushes 30
    python benchmarks/bench_sync.py --sizes bundled,30m --workers 2 --modes network,colocated  # resources.colocate

For each ``model.size`` (randomly initialised, built under ``--artifacts``): two FSDP learner ranks and a fleet
of rollout workers (torch engine; ``--engine vllm`` for the default job's) on a local Ray, as the trainer has
them. Per worker count: one push to form the group, then ``--pushes`` timed pushes (``WeightSync.push``: the driver's wall time from the call to every engine
having loaded the weights), and the bound: the same bytes (model bytes x workers, what sync rank 0 sends) from one
process to another through one loopback TCP socket, measured right after. Each learner rank sends its own FSDP
rows (rapo_ray/workers/sync.py); ``pack`` is learner rank 0's time copying its rows into the staging buffers, ``send`` its
time waiting for the sends to end. Writes JSON (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]


def _receive(port: int, nbytes: int, rounds: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = bytearray(1 << 22)
        view = memoryview(buf)
        for _ in range(rounds):
            got = 0
            while got < nbytes:
                got += s.recv_into(view, min(len(buf), nbytes - got))
            s.sendall(b"k")


def loopback_bound_ms(nbytes: int, rounds: int = 3) -> float:
    """Median ms to move ``nbytes`` from this process to another over one loopback TCP socket (receiver reads into
    a reused 4 MiB buffer; the sender's buffer is ready beforehand)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        proc = mp.get_context("spawn").Process(target=_receive, args=(srv.getsockname()[1], nbytes, rounds))
        proc.start()
        conn, _ = srv.accept()
        data = memoryview(bytearray(nbytes))
        times = []
        with conn:
            for _ in range(rounds):
                t0 = time.perf_counter()
                conn.sendall(data)
                conn.recv(1)
                times.append((time.perf_counter() - t0) * 1000)
        proc.join()
    return statistics.median(times)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def load_model_shapes(model_dir):
    """The model's parameters on the meta device (shapes only, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return list(model.parameters())


def ladder_rung(
    size: str,
    workers: list[int],
    pushes: int,
    artifacts: str,
    dtype: str,
    bucket_mb: float,
    engine: str,
    mode: str = "network",
) -> list:
    """``mode``: network (``WeightSync``, the learner ranks' rows over gloo) or colocated (``ColocatedSync``, the
    rows through /dev/shm; one worker per learner rank, so only the count 2 is measured)."""
    import ray

    from rapo_ray.config import load_config
    from rapo_ray.launch.launcher import init_ray
    from rapo_ray.model.factory import ensure_bundled_model
    from rapo_ray.workers.learner import LearnerGroup
    from rapo_ray.workers.rollout import ColocatedSpawner, RolloutFleet
    from rapo_ray.workers.sync import ColocatedSync, WeightSync

    colocated = mode == "colocated"
    if colocated:
        workers = [n for n in workers if n == 2]  # = learner.world_size
    if not workers:
        return []
    cfg = load_config(
        overrides=[
            f"model.size={size}",
            f"run.artifacts_dir={artifacts}",
            "algo.kl_coef=0",  # no reference copy: the ladder measures the sync, not the learner's memory
            f"rollout.engine={engine}",
            f"rollout.num_workers={2 if colocated else 1}",
            f"rollout.min_workers={2 if colocated else 1}",
            f"rollout.max_workers={max(workers)}",
            "resources.cpus_per_rollout_worker=0.25",
            "resources.cpus_per_learner=0.25",
            f"resources.colocate={str(colocated).lower()}",
            f"sync.bucket_mb={bucket_mb}",
        ]
    )
    t0 = time.perf_counter()
    model_dir = ensure_bundled_model(cfg)
    print(f"[{size}] model at {model_dir} ({time.perf_counter() - t0:.0f} s)", flush=True)
    started = init_ray(cfg)
    rows = []
    try:
        learners = LearnerGroup(cfg, model_dir)
        wire = cfg.sync.wire_dtype(dtype)
        if colocated:
            sync = ColocatedSync(cfg.sync.timeout_s, wire)
            spawner = ColocatedSpawner(cfg, str(model_dir), None, learners.pg, cfg.rollout.num_workers)
        else:
            sync, spawner = WeightSync(bucket_mb, cfg.sync.timeout_s, wire), None
        fleet = RolloutFleet(model_dir, cfg, retrieval_app=None, spawner=spawner)
        try:
            for n in workers:
                # each engine holds the model and, during a push, a received copy; the learners' shards and their
                # staging buffers come on top: a count that cannot fit is skipped, not run into the OOM killer
                model_gb = sum(p.numel() for p in load_model_shapes(model_dir)) * 4 / 2**30
                need_gb = model_gb * (2 * n + 2)
                free_gb = psutil.virtual_memory().available / 2**30 + model_gb * 2 * len(fleet.workers)
                if need_gb > free_gb:
                    rows.append(
                        {
                            "size": size,
                            "mode": mode,
                            "workers": n,
                            "skipped": f"needs ~{need_gb:.0f} GB, {free_gb:.0f} GB free",
                        }
                    )
                    print(f"[{size}] {n} worker(s): skipped, {rows[-1]['skipped']}", flush=True)
                    continue
                fleet.scale(n)
                version = 1
                sync.push(learners.workers, fleet.handles(), version)  # forms the group for these members
                times, breakdown, engine_side = [], [], []
                for _ in range(pushes):
                    version += 1
                    times.append(sync.push(learners.workers, fleet.handles(), version))
                    breakdown.append(sync.last)
                    # the first worker's own clock: receiving the buckets vs loading them into its engine
                    engine_side.append(ray.get(fleet.handles()[0].__ray_call__.remote(lambda w: w.last_receive)))
                model_bytes = sync.last["bytes"]
                bound = loopback_bound_ms(model_bytes * n)

                def median_ms(rows, key):  # (a stage the mode does not have: None)
                    return 1000 * statistics.median(r[key] for r in rows) if key in rows[0] else None

                row = {
                    "size": size,
                    "mode": mode,
                    "engine": engine,
                    "workers": n,
                    "wire_dtype": sync.dtype,
                    "model_bytes": model_bytes,
                    "bytes_moved": model_bytes * n,
                    "buckets": sync.last.get("buckets", 1),
                    "pushes": pushes,
                    "median_ms": statistics.median(times),
                    "p95_ms": percentile(times, 0.95),
                    "prepare_ms_median": median_ms(breakdown, "prepare_s"),
                    "header_ms_median": median_ms(breakdown, "header_s"),
                    "pack_ms_median": median_ms(breakdown, "pack_s"),
                    "send_ms_median": median_ms(breakdown, "send_s"),
                    "slowest_sender_ms_median": median_ms(breakdown, "slowest_sender_s"),
                    "engine_receive_ms_median": median_ms(engine_side, "receive_s"),
                    "engine_load_ms_median": median_ms(engine_side, "load_s"),
                    "engine_wait_ms_median": median_ms(engine_side, "wait_s"),
                    "engine_copy_ms_median": median_ms(engine_side, "copy_s"),
                    "bound_ms": bound,
                }
                row["x_bound"] = row["median_ms"] / bound
                rows.append(row)
                print(
                    f"[{size} {mode}] {n} worker(s): median {row['median_ms']:.1f} ms, p95 {row['p95_ms']:.1f} ms, "
                    f"{row['bytes_moved'] / 1e6:.1f} MB moved, bound {bound:.1f} ms ({row['x_bound']:.2f}x)",
                    flush=True,
                )
        finally:
            fleet.shutdown()
            learners.shutdown()
            sync.close()
    finally:
        if started:
            ray.shutdown()
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="bundled,30m,qwen2.5-0.5b", help="model.size presets, comma-separated")
    ap.add_argument("--workers", default="1,2,4", help="rollout worker counts, comma-separated")
    ap.add_argument("--pushes", type=int, default=12, help="timed pushes per worker count (after one to warm up)")
    ap.add_argument("--dtype", default="float32", help="model.dtype of the engines (the wire dtype follows it)")
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    ap.add_argument("--engine", default="torch", help="rollout.engine of the workers (vllm: the default job's)")
    ap.add_argument("--artifacts", default="/tmp/rapo_bench_sync", help="where the ladder's models are built")
    ap.add_argument(
        "--modes",
        default="network",
        help="network (the gloo sync), colocated (shared memory, resources.colocate; 2 workers only), or both",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sync.json"))
    args = ap.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    rows = []
    for size in args.sizes.split(","):
        for mode in args.modes.split(","):
            if mode not in ("network", "colocated"):
                ap.error(f"--modes: {mode!r} is not network or colocated")
            rows += ladder_rung(
                size, workers, args.pushes, args.artifacts, args.dtype, args.bucket_mb, args.engine, mode
            )
    print(
        f"\n{'size':>13} {'mode':>9} {'workers':>7} {'MB moved':>9} {'median ms':>9} {'p95 ms':>7} {'bound ms':>8} "
        f"{'x bound':>7}"
    )
    for r in rows:
        if "skipped" in r:
            print(f"{r['size']:>13} {r.get('mode', ''):>9} {r['workers']:>7}  skipped: {r['skipped']}")
            continue
        print(
            f"{r['size']:>13} {r['mode']:>9} {r['workers']:>7} {r['bytes_moved'] / 1e6:>9.1f} {r['median_ms']:>9.1f} "
            f"{r['p95_ms']:>7.1f} {r['bound_ms']:>8.1f} {r['x_bound']:>7.2f}"
        )
    from rapo_ray.core.devices import machine_record

    result = {"benchmark": "weight sync ladder", "rows": rows, "argv": vars(args), "machine": machine_record()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
