"""The learner's two passes (old log-probs, then the PPO update) replayed on finished runs' own steps, once per way of
dealing rows to ranks and micro-batches (``learner.balanced_micro_batches`` / ``length_sorted_micro_batches``) and per
way of computing logits (``learner.logits_only_at_targets``: ``targets``, the LM head only where a pass reads
log-probs; ``all``, at every padded position): seconds and padded tokens per step, so a GRPO run and a RAPO run can be
compared on their real rows with nothing else running.

    python benchmarks/bench_learner_update.py --run RUNS/grpo-s0 --run RUNS/rapo-s0 --model-dir MODEL \\
        --orders balanced,row-order --logits targets --steps 2-30 --out benchmarks/results/learner_update.json

Each run is replayed with its own ``config.yaml`` on one ``LearnerGroup`` (the run's learner ranks, FSDP, gloo),
starting from ``--model-dir`` (the runs' starting model). For every saved step (``trajectories/step-*.parquet``) and
every variant (order x logits) in turn (variants alternate within a step, so a drifting box weighs on each alike): the
old-policy pass over the step's rows, then the update with the advantages and shaping the run computed. The weights
move with every update, which changes no shape and so no cost. Padded tokens are the sum over micro-batches of rows x
longest row, as the learner group reports them; the slowest rank's are what a step waits for (ranks meet at every
collective). Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import ray

from rapo_ray.config import load_config
from rapo_ray.core.devices import machine_record
from rapo_ray.core.files import write_json_atomic
from rapo_ray.launch.launcher import init_ray
from rapo_ray.types.batch import TrajectoryBatch
from rapo_ray.types.trajectory import Trajectory
from rapo_ray.workers.learner import LearnerGroup

ORDER_FLAGS = {  # types.batch.MICRO_BATCH_ORDERS -> (balanced_micro_batches, length_sorted_micro_batches)
    "balanced": (True, False),
    "row-order": (False, False),
    "length-sorted": (False, True),
}
LOGITS_FLAGS = {"targets": True, "all": False}  # -> learner.logits_only_at_targets
COLUMNS = ["prompt_ids", "response_ids", "loss_mask", "logprobs", "slot_kind"]
SIGNAL = ("advantage", "shaping")  # the algorithm's outputs the loss reads, where the step's file has them


def step_batch(parquet: Path) -> tuple[TrajectoryBatch, dict[str, list[float]]]:
    """A saved step as the learner sees it: trajectories with their tokens, and the per-row outputs of its algorithm
    that the loss reads (``advantage``, and ``shaping`` for RAPO), to put into ``batch.learner`` once it is built."""
    table = pq.read_table(parquet)
    rows = table.select(COLUMNS + [c for c in SIGNAL if c in table.column_names]).to_pylist()
    trajs = []
    for i, r in enumerate(rows):
        t = Trajectory(f"g{i}", i, r["slot_kind"], f"p{i}", "qa", (), prompt_ids=list(r["prompt_ids"]))
        t.response_ids, t.loss_mask, t.logprobs = list(r["response_ids"]), list(r["loss_mask"]), list(r["logprobs"])
        trajs.append(t)
    return TrajectoryBatch(trajs), {c: [float(r[c]) for r in rows] for c in SIGNAL if c in table.column_names}


def parse_steps(text: str) -> range:
    """``FIRST-LAST`` or ``STEP`` -> the steps, both ends included; ValueError for anything else."""
    first, sep, last = text.partition("-")
    steps = range(int(first), int(last if sep else first) + 1)
    if not steps or steps.start < 1:
        raise ValueError(f"{text!r} is not FIRST-LAST with 1 <= FIRST <= LAST")
    return steps


def variant_name(order: str, logits: str, logits_modes: list[str]) -> str:
    """A variant's name in the report: the order, with ``/logits`` when more than one logits mode is compared."""
    return f"{order}/{logits}" if len(logits_modes) > 1 else order


def _set_logits_mode(worker, only_at_targets: bool) -> None:  # runs inside a LearnerWorker (``__ray_call__``)
    worker.cfg.learner.logits_only_at_targets = only_at_targets


def replay(
    run_dir: Path, model_dir: Path, orders: list[str], steps: range, logits_modes: list[str] = ("targets",)
) -> dict:
    cfg = load_config(run_dir / "config.yaml")
    files = [run_dir / "trajectories" / f"step-{s:06d}.parquet" for s in steps]
    files = [f for f in files if f.exists()]
    if not files:
        raise SystemExit(f"{run_dir}: no trajectories/step-*.parquet for steps {steps.start}-{steps.stop - 1}")
    group = LearnerGroup(cfg, model_dir)
    variants = [(o, m) for m in logits_modes for o in orders]
    per_variant: dict[str, dict[str, list[float]]] = {variant_name(o, m, logits_modes): {} for o, m in variants}
    try:
        for k, f in enumerate(files):
            batch, signal = step_batch(f)
            lengths = [len(t.prompt_ids) + len(t.response_ids) for t in batch]
            for order, mode in variants if k % 2 == 0 else variants[::-1]:
                balanced, length_sorted = ORDER_FLAGS[order]
                learner = replace(
                    cfg.learner,
                    balanced_micro_batches=balanced,
                    length_sorted_micro_batches=length_sorted,
                    logits_only_at_targets=LOGITS_FLAGS[mode],
                )
                group.cfg = replace(cfg, learner=learner)
                ray.get([w.__ray_call__.remote(_set_logits_mode, LOGITS_FLAGS[mode]) for w in group.workers])
                t0 = time.perf_counter()
                old = group.forward_old(batch)
                batch.learner = batch.learner.with_signal(signal)
                t1 = time.perf_counter()
                stats = group.update(batch, step=int(f.stem.split("-")[1]))
                t2 = time.perf_counter()
                rec = per_variant[variant_name(order, mode, logits_modes)]
                for key, value in (
                    ("old_logprob_s", t1 - t0),
                    ("update_s", t2 - t1),
                    ("old_padded_tokens", old["padded_tokens"]),
                    ("old_slowest_rank_tokens", old["slowest_rank_padded_tokens"]),
                    ("update_padded_tokens", stats["padded_tokens"]),
                    ("update_slowest_rank_tokens", stats["slowest_rank_padded_tokens"]),
                    ("real_tokens", sum(lengths)),
                    ("loss_tokens", sum(int(t.loss_mask.sum()) for t in batch)),
                ):
                    rec.setdefault(key, []).append(value)
    finally:
        group.shutdown()
    return {
        "run": str(run_dir),
        "algo": cfg.algo.name,
        "steps": len(files),
        "orders": {
            name: {f"median_{k}" if k.endswith("_s") else f"mean_{k}": _summary(k, v) for k, v in rec.items()}
            for name, rec in per_variant.items()
        },
    }


def _summary(key: str, values: list[float]) -> float:
    return statistics.median(values) if key.endswith("_s") else statistics.fmean(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help="a finished run's folder (repeat for several)")
    ap.add_argument("--model-dir", required=True, help="the HF folder the runs started from")
    ap.add_argument("--orders", default="balanced,row-order", help=f"comma-separated, of {list(ORDER_FLAGS)}")
    ap.add_argument(
        "--logits", default="targets", help=f"comma-separated, of {list(LOGITS_FLAGS)} (learner.logits_only_at_targets)"
    )
    ap.add_argument("--steps", default="2-30", help="saved steps to replay, FIRST-LAST (step 1 warms caches)")
    ap.add_argument("--out", default="benchmarks/results/learner_update.json")
    args = ap.parse_args()
    orders = [o for o in args.orders.split(",") if o]
    bad = [o for o in orders if o not in ORDER_FLAGS]
    if bad or not orders:
        ap.error(f"--orders {args.orders!r}: each must be one of {list(ORDER_FLAGS)}")
    logits_modes = [m for m in args.logits.split(",") if m]
    if not logits_modes or any(m not in LOGITS_FLAGS for m in logits_modes):
        ap.error(f"--logits {args.logits!r}: each must be one of {list(LOGITS_FLAGS)}")
    for run in args.run:
        if not Path(run, "config.yaml").is_file():
            ap.error(f"--run {run}: no config.yaml there (a run folder holds config.yaml and trajectories/)")
    try:
        steps = parse_steps(args.steps)
    except ValueError as exc:
        ap.error(f"--steps {args.steps!r}: {exc}")
    if not Path(args.model_dir, "config.json").is_file():
        ap.error(f"--model-dir {args.model_dir}: not an HF model folder (no config.json)")
    init_ray(load_config(Path(args.run[0]) / "config.yaml"))
    try:
        results = [replay(Path(r), Path(args.model_dir), orders, steps, logits_modes) for r in args.run]
    finally:
        ray.shutdown()
    print(
        f"{'run':24} {'variant':18} {'real tokens':>11} | {'old s':>6} {'padded':>7} {'slowest':>7} | "
        f"{'update s':>8} {'padded':>7} {'slowest':>7}"
    )
    for res in results:
        for order, s in res["orders"].items():
            print(
                f"{Path(res['run']).name:24} {order:18} {s['mean_real_tokens']:11.0f} | "
                f"{s['median_old_logprob_s']:6.3f} {s['mean_old_padded_tokens']:7.0f} "
                f"{s['mean_old_slowest_rank_tokens']:7.0f} | {s['median_update_s']:8.3f} "
                f"{s['mean_update_padded_tokens']:7.0f} {s['mean_update_slowest_rank_tokens']:7.0f}"
            )
    report = {"machine": machine_record(), "args": vars(args), "results": results}
    write_json_atomic(Path(args.out), report)
    print(f"wrote {args.out}")
    print(json.dumps({r["run"]: {o: round(s["median_update_s"], 3) for o, s in r["orders"].items()} for r in results}))


if __name__ == "__main__":
    main()
