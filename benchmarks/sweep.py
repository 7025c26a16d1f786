"""Sweep one config field over a few values: the same short training job per value, one after the other, and the
medians of its per-step timings side by side.

    python benchmarks/sweep.py retrieval.batch_wait_ms=0,2,5,10,25 --steps 15 --artifacts /tmp/art
    python benchmarks/sweep.py rollout.num_workers=1,2 --steps 10 algo.name=grpo

Each value runs `jobs/train.py` with the field set, the given overrides, and held-out evaluation only at the
end (trainer.eval_every=0). Step 1 is left out of the medians (it pays for first-call warm-ups). Writes
--out (JSON) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rapo_ray.training.reporting import read_metrics

REPO = Path(__file__).resolve().parents[1]
KEYS = ("step_s", "rollout_s", "retrieve_s", "generate_s", "tool_s", "old_logprob_s", "update_s", "sync_s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("field", help="section.key=v1,v2,... (the values to try, in order)")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--artifacts", default=str(REPO / "artifacts"), help="warm start and buffer (built once)")
    ap.add_argument("--runs", default="/tmp/rapo_sweep", help="where the runs go")
    ap.add_argument("--out", default="", help="JSON results (default: benchmarks/results/sweep-<field>.json)")
    ap.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = ap.parse_args(argv)
    if "=" not in args.field:
        ap.error(f"field {args.field!r}: expected section.key=v1,v2,...")
    key, values = args.field.split("=", 1)
    values = [v for v in values.split(",") if v]
    if not values:
        ap.error(f"field {args.field!r}: no values")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for v in values:
        name = f"sweep-{key.replace('.', '_')}-{v}-{stamp}"
        cmd = [
            sys.executable,
            str(REPO / "jobs" / "train.py"),
            f"run.artifacts_dir={args.artifacts}",
            f"run.output_dir={args.runs}",
            f"run.name={name}",
            f"trainer.total_steps={args.steps}",
            "trainer.eval_every=0",
            "run.progress=false",
            *args.overrides,
            f"{key}={v}",
        ]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.time() - t0
        if proc.returncode != 0:
            print(proc.stdout[-2000:] + proc.stderr[-2000:], file=sys.stderr)
            print(f"{key}={v}: the run failed (rc {proc.returncode})", file=sys.stderr)
            return 1
        steps = [m for m in read_metrics(Path(args.runs) / name, steps_only=True) if m["step"] > 1]
        row = {"value": v, "wall_s": round(wall, 1), "steps": len(steps)}
        for k in KEYS:
            xs = [m[k] for m in steps if k in m]
            row[k] = round(statistics.median(xs), 3) if xs else None
        rows.append(row)
        print(f"{key}={v}: " + ", ".join(f"{k} {row[k]}" for k in KEYS if row[k] is not None), flush=True)
    out = Path(args.out or REPO / "benchmarks" / "results" / f"sweep-{key}.json")
    out.write_text(json.dumps({"field": key, "steps": args.steps, "overrides": args.overrides, "rows": rows}, indent=1))
    cols = [k for k in KEYS if any(r[k] is not None for r in rows)]
    print(f"\n| {key} | " + " | ".join(f"median {k}" for k in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for r in rows:
        print(f"| {r['value']} | " + " | ".join(f"{r[k]:.3f}" for k in cols) + " |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
