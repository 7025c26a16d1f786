"""Where a run's step goes: per-phase wall and CPU medians from the metrics.jsonl of one or more run folders, the
engine's achieved generation speed, and what a synchronous run's step would become with the next rollout made during
the update (``algo.max_staleness=1``) on hardware where the two do not share cores.

    python benchmarks/step_phases.py runs/grpo-k0 runs/grpo-k1 [--skip 1] [--out step_phases.json]

Per run, medians over the steps after the first ``--skip`` (step 1 warms the engine and the learners up):
- wall: step_s, rollout_s, old_logprob_s, update_s, sync_s; with max_staleness >= 1 also ahead_rollout_s (the
  rollout made during the update) and learner_wait_s (the driver waiting for the update after it);
- CPU seconds from the actors' own process clocks: rollout_cpu_s (the fleet), update/cpu_s (all learner ranks, the
  old-policy pass included) and update/old_pass_cpu_s (that pass);
- the engine: generated tokens / generate_s, and the trajectories of a step.
The projection, for a run with max_staleness 0: max(rollout, old-policy pass + update) + sync, the step when the
rollout of step t+1 fully overlaps the learners' work on step t and neither slows the other. Rolling out ahead keeps
or skips the pass as the synchronous run did (rapo_ray/algos/old_pass.py), so a run that skipped it projects with
its old_logprob_s (building the learner batch only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from rapo_ray.core.devices import machine_record
from rapo_ray.core.errors import DataError
from rapo_ray.training.reporting import read_metrics

WALL = ("step_s", "rollout_s", "old_logprob_s", "update_s", "sync_s", "ahead_rollout_s", "learner_wait_s")
CPU = ("rollout_cpu_s", "update/cpu_s", "update/old_pass_cpu_s")


def read_steps(run_dir: Path) -> list[dict]:
    """The per-step rows of a run's metrics.jsonl (the held-out rows, without "reward", left out)."""
    try:
        steps = read_metrics(run_dir, steps_only=True)
    except DataError as exc:
        raise SystemExit(str(exc)) from None
    if not steps:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'}: no training steps in it")
    return steps


def staleness_of(run_dir: Path) -> int:
    """algo.max_staleness from the run's saved config.yaml (0 when the run has none)."""
    cfg = run_dir / "config.yaml"
    if not cfg.is_file():
        return 0
    try:
        saved = yaml.safe_load(cfg.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SystemExit(f"{cfg}: not readable YAML ({exc})") from None
    return int((saved.get("algo") or {}).get("max_staleness", 0))


def phases(steps: list[dict], skip: int, max_staleness: int) -> dict:
    """Medians over ``steps[skip:]`` of the wall and CPU phases, the engine's tokens/s, and the k=1 projection.

    steps: metrics.jsonl step rows, each with step_s, rollout_s, old_logprob_s, update_s, sync_s and (when logged)
    the CPU and generation fields; skip: leading steps left out (must leave at least one)."""
    if skip < 0 or skip >= len(steps):
        raise SystemExit(f"--skip {skip}: the run has {len(steps)} steps; keep at least one")
    kept = steps[skip:]

    def median(key: str) -> float | None:
        values = [s[key] for s in kept if key in s]
        return statistics.median(values) if values else None

    out = {"steps": len(kept), "max_staleness": max_staleness}
    out["wall"] = {k: v for k in WALL if (v := median(k)) is not None}
    out["cpu"] = {k: v for k in CPU if (v := median(k)) is not None}
    rates = [s["generated_tokens"] / s["generate_s"] for s in kept if s.get("generate_s", 0) > 0]
    out["engine_tokens_per_s"] = statistics.median(rates) if rates else None
    out["trajectories"] = median("trajectories")
    skipped = any(s.get("update/old_pass_skipped", 0) for s in kept)
    out["old_pass_skipped"] = skipped
    w = out["wall"]
    if max_staleness == 0 and all(k in w for k in ("rollout_s", "old_logprob_s", "update_s")):
        out["projected_k1_step_s"] = max(w["rollout_s"], w["old_logprob_s"] + w["update_s"]) + w.get("sync_s", 0.0)
    return out


def table(report: dict) -> str:
    cols = WALL
    lines = [
        "| run | k | steps | "
        + " | ".join(cols)
        + " | rollout CPU | learner CPU (old pass) | engine tok/s | k=1 projected |",
        "|" + "---|" * (len(cols) + 7),
    ]
    for name, r in report["runs"].items():
        w, c = r["wall"], r["cpu"]
        cells = [f"{w[k]:.1f}" if k in w else "-" for k in cols]
        learner = f"{c['update/cpu_s']:.1f} ({c.get('update/old_pass_cpu_s', 0):.1f})" if "update/cpu_s" in c else "-"
        rollout = f"{c['rollout_cpu_s']:.1f}" if "rollout_cpu_s" in c else "-"
        tps = f"{r['engine_tokens_per_s']:.0f}" if r["engine_tokens_per_s"] else "-"
        proj = f"{r['projected_k1_step_s']:.1f}" if "projected_k1_step_s" in r else "-"
        lines.append(
            f"| {name} | {r['max_staleness']} | {r['steps']} | " + " | ".join(cells) + f" | {rollout} | {learner} | "
            f"{tps} | {proj} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders (each with metrics.jsonl and config.yaml)")
    ap.add_argument("--skip", type=int, default=1, help="leading steps left out of the medians (warm-up)")
    ap.add_argument("--out", default="", help="JSON report (default: none)")
    args = ap.parse_args(argv)
    report = {"machine": machine_record(), "skip": args.skip, "runs": {}}
    for run in args.runs:
        d = Path(run)
        report["runs"][str(d)] = phases(read_steps(d), args.skip, staleness_of(d))
    print(table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
