"""Colocated mode against the network sync on one job: the same steps, the same answers, and the sync's time.

    python benchmarks/colocated_check.py --steps 20                                        # the default job
    python benchmarks/colocated_check.py --config configs/smollm2_arith.yaml --steps 3 \\
        --set trainer.eval_size=50 --out benchmarks/results/colocated_smollm2.json

Runs ``jobs/train.py`` twice, one run after the other, with the same config and seed: ``resources.colocate=false``
(the learner ranks send their rows over gloo, rapo_ray/workers/sync.py) and ``resources.colocate=true`` (each
rollout worker in a learner rank's bundle, the rows through /dev/shm, rapo_ray/workers/colocated.py). The weights
reach the engines bit for bit either way, so every step metric that is not a time must be equal, and so must each
held-out answer. Reports the keys that differ (none expected), the median ``sync_s`` of each arm (the first step
left out: it maps the shared files) and the machine. Time it alone on the box. ``--arms colocated-keep-cache,
colocated`` compares the colocated runs with and without the engines freeing their KV cache during the update
(``rollout.free_cache_during_update``; the torch engine frees it, vLLM keeps it): what is freed, at what cost.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rapo_ray.core.devices import machine_record

REPO = Path(__file__).resolve().parents[1]
# each arm's overrides; a check compares two of them (--arms)
ARMS = {
    "network": ["resources.colocate=false"],
    "colocated": ["resources.colocate=true"],
    "colocated-keep-cache": ["resources.colocate=true", "rollout.free_cache_during_update=false"],
}


def is_measurement(key: str) -> bool:
    """Metrics that measure time, speed or memory (they differ between any two runs, or between the arms by
    design), not what was learned; a moving mean (``<key>_mean10``) is what its key is."""
    key = re.sub(r"_mean\d+$", "", key)
    return key == "time" or key.endswith("_s") or "per_s" in key or key.endswith("_mb")


def compare_steps(a: list[dict], b: list[dict]) -> dict:
    """Step by step, every key but the measurements: which keys differ and at which steps."""
    if len(a) != len(b):
        return {"steps": [len(a), len(b)], "differ": {"(step count)": [len(a), len(b)]}}
    differ: dict[str, list[int]] = {}
    keys: set[str] = set()
    for ra, rb in zip(a, b):
        for k in sorted((set(ra) | set(rb))):
            if is_measurement(k):
                continue
            keys.add(k)
            if ra.get(k) != rb.get(k):
                differ.setdefault(k, []).append(ra.get("step", -1))
    return {"steps": len(a), "keys_compared": sorted(keys), "differ": differ}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_arm(arm: str, args, out_dir: Path) -> Path:
    run_dir = out_dir / arm
    cmd = [sys.executable, str(REPO / "jobs" / "train.py")]
    if args.config:
        cmd += ["--config", args.config]
    cmd += [
        f"run.output_dir={out_dir}",
        f"run.name={arm}",
        f"trainer.total_steps={args.steps}",
        *ARMS[arm],
        *args.set,
    ]
    if args.artifacts:
        cmd.append(f"run.artifacts_dir={args.artifacts}")
    t0 = time.perf_counter()
    with open(out_dir / f"{arm}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    print(f"{arm}: exit {rc} in {time.perf_counter() - t0:.0f} s (log {out_dir / f'{arm}.log'})", flush=True)
    if rc != 0:
        raise SystemExit(f"the {arm} run failed (exit {rc}); see {out_dir / f'{arm}.log'}")
    return run_dir


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="", help="the job's config file (empty: the default job)")
    ap.add_argument("--steps", type=int, default=20, help="trainer.total_steps of both runs")
    ap.add_argument("--set", action="append", default=[], help="more KEY=VALUE overrides for both runs")
    ap.add_argument("--artifacts", default="", help="run.artifacts_dir (a cached warm start or cold start)")
    ap.add_argument("--work", default="/tmp/rapo_colocated_check", help="where the two runs go (emptied first)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "colocated_default.json"))
    ap.add_argument("--compare-only", action="store_true", help="compare the two runs already in --work")
    ap.add_argument(
        "--arms",
        default="network,colocated",
        help=f"the two arms, run in this order: {', '.join(ARMS)} (colocated frees the torch engine's KV cache "
        "during the update; colocated-keep-cache does not)",
    )
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if len(arms) != 2 or not set(arms) <= set(ARMS):
        ap.error(f"--arms {args.arms!r}: two of {', '.join(ARMS)}")
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: at least 2 (the first step's sync is left out of the timing)")
    out_dir = Path(args.work)
    if args.compare_only:
        dirs = {arm: out_dir / arm for arm in arms}
        missing = [str(d) for d in dirs.values() if not (d / "eval_after.json").is_file()]
        if missing:
            ap.error(f"--compare-only: no finished run in {missing}")
    else:
        if out_dir.exists():
            subprocess.run(["rm", "-rf", str(out_dir)], check=True)
        out_dir.mkdir(parents=True)
        dirs = {arm: run_arm(arm, args, out_dir) for arm in arms}
    steps = {arm: [r for r in read_jsonl(d / "metrics.jsonl") if "sync_s" in r] for arm, d in dirs.items()}
    evals = {arm: json.loads((d / "eval_after.json").read_text()) for arm, d in dirs.items()}
    result = {
        "benchmark": "colocated mode vs the network sync",
        "command": " ".join(sys.argv),
        "arms": arms,
        "steps": compare_steps(steps[arms[0]], steps[arms[1]]),
        "held_out_answers_equal": evals[arms[0]]["problems"] == evals[arms[1]]["problems"],
        "held_out_problems": len(evals[arms[0]]["problems"]),
        "held_out_after": {arm: {k: v for k, v in e.items() if k != "problems"} for arm, e in evals.items()},
        "sync_ms_median": {arm: 1000 * statistics.median(r["sync_s"] for r in s[1:]) for arm, s in steps.items()},
        "step_s_median": {arm: statistics.median(r["step_s"] for r in s) for arm, s in steps.items()},
        "rollout_s_median": {arm: statistics.median(r["rollout_s"] for r in s) for arm, s in steps.items()},
        "engine_cache_freed_mb_median": {
            arm: statistics.median(r.get("engine_cache_freed_mb", 0.0) for r in s) for arm, s in steps.items()
        },
        "machine": machine_record(),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
