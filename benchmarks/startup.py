"""A training job's start-up and end, by stage: what a user waits for before the first step and after the last.

    .venv/bin/python benchmarks/startup.py                      # the tiny RAPO job, 3 runs
    .venv/bin/python benchmarks/startup.py --runs 5 algo.name=grpo
    .venv/bin/python benchmarks/startup.py --compare /tmp/old   # A/B: a checkout of another commit, runs alternating

Each run is ``python jobs/train.py`` in its own process, as a user starts it: the suite's tiny warm-started config
(``TINY_OVERRIDES`` + ``TINY_WARM_OVERRIDES``, one retrieval replica) for one step, with every cache built once
beforehand in ``--artifacts`` (the warm start, the step-trace buffer, the held-out result before training), so what
is timed is the start-up itself. Per run: the process's wall seconds, the stages from its ``summary.json``
(``startup_s``: the launcher's timer) and the seconds from the summary's writing to the process's exit (shutting
down Serve, the actors and Ray). Medians over runs. With ``--compare DIR`` the runs alternate between this checkout
and DIR's (its own ``jobs/train.py`` and ``rapo_ray`` on PYTHONPATH; a commit from before the start-up timer has no
stages, only wall and end). Results: --out (JSON, with the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rapo_ray.config import TINY_OVERRIDES, TINY_WARM_OVERRIDES
from rapo_ray.core.devices import machine_record

REPO = Path(__file__).resolve().parents[1]
JOB = (*TINY_OVERRIDES, *TINY_WARM_OVERRIDES, "serve.min_replicas=1", "serve.max_replicas=1")


def run_job(repo: Path, artifacts: Path, runs_dir: Path, name: str, extra: list[str]) -> dict:
    """One ``jobs/train.py`` process of ``repo`` for one step; its wall seconds, start-up stages and end."""
    overrides = [*JOB, f"run.artifacts_dir={artifacts}", f"run.output_dir={runs_dir}", f"run.name={name}"]
    overrides += ["trainer.total_steps=1", "trainer.eval_every=0", "checkpoint.every=0", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, str(repo / "jobs" / "train.py"), *overrides], capture_output=True, text=True, env=env, cwd=repo
    )
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run {name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    summary_path = runs_dir / name / "summary.json"
    summary = json.loads(summary_path.read_text())
    stages = summary.get("startup_s", {})  # (none before the start-up timer)
    return {
        "wall_s": round(wall, 2),
        "startup_s": stages,
        "startup_total_s": round(sum(stages.values()), 2),
        "step_s": summary["mean_step_s"],
        "end_s": round(t0 + wall - summary_path.stat().st_mtime, 2),  # the summary's writing to the exit
    }


def medians(runs: list[dict]) -> dict:
    """Per-key medians over runs (the stages too), rounded to 0.01 s."""
    out = {k: round(statistics.median(r[k] for r in runs), 2) for k in ("wall_s", "startup_total_s", "step_s", "end_s")}
    out["startup_s"] = {s: round(statistics.median(r["startup_s"][s] for r in runs), 2) for s in runs[0]["startup_s"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="timed runs, after an untimed one that builds the caches")
    ap.add_argument("--artifacts", default="/tmp/rapo_startup_bench", help="the warm start, buffer and caches")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "startup.json"), help="JSON report")
    ap.add_argument("--compare", default="", help="another checkout (a folder) to alternate with, run for run")
    ap.add_argument("overrides", nargs="*", help="section.key=value on top of the tiny job")
    args = ap.parse_args(argv)
    if args.runs < 1:
        raise SystemExit(f"--runs {args.runs}: must be >= 1")
    repos = {"this": REPO}
    if args.compare:
        other = Path(args.compare).resolve()
        if not (other / "jobs" / "train.py").is_file():
            raise SystemExit(f"--compare {args.compare}: not a checkout of this project (no jobs/train.py)")
        repos["compare"] = other
    artifacts = Path(args.artifacts)
    runs_dir = artifacts / "runs" / time.strftime("%Y%m%d-%H%M%S")
    print("building the caches (one untimed run per checkout) ...")
    for name, repo in repos.items():
        run_job(repo, artifacts, runs_dir, f"{name}-warm-up", args.overrides)
    runs: dict[str, list[dict]] = {name: [] for name in repos}
    for i in range(args.runs):
        for name, repo in repos.items():
            r = run_job(repo, artifacts, runs_dir, f"{name}-{i}", args.overrides)
            runs[name].append(r)
            print(
                f"{name} run {i}: wall {r['wall_s']:.1f} s, start-up {r['startup_total_s']:.1f} s, end {r['end_s']:.1f} s"
            )
    report = {
        "command": "benchmarks/startup.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "overrides": args.overrides,
        "repos": {name: str(repo) for name, repo in repos.items()},
        "runs": runs,
        "median": {name: medians(r) for name, r in runs.items()},
        "machine": machine_record(),
    }
    for name, m in report["median"].items():
        print(f"{name}: median wall {m['wall_s']:.1f} s, start-up {m['startup_total_s']:.1f} s, end {m['end_s']:.1f} s")
        if m["startup_s"]:
            print("  start-up stages: " + ", ".join(f"{s} {v:.1f} s" for s, v in m["startup_s"].items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
