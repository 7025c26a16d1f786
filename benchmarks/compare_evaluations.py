"""Pooled paired tests over ``jobs/evaluate.py`` outputs: several arms x seeds evaluated on one data set, each
against the common start and against a reference arm. For a second held-out report (the first 200 GSM8K test
problems, say) of runs that compare_algorithms.py already compared on the recipe's own held-out set.

    python benchmarks/compare_evaluations.py --start eval-cold-start.json \\
        grpo:0=eval-grpo-s0.json grpo:1=eval-grpo-s1.json rapo:0=eval-rapo-s0.json rapo:1=eval-rapo-s1.json \\
        --reference grpo --out report.json

Each run is ``ARM:SEED=FILE``; a FILE (and ``--start``) may also be a run folder's eval_before.json /
eval_after.json, for runs whose configs differ (rolled out ahead against the synchronous step, say). Per data set in
the files: each run's accuracy and its fixed / broken problems against ``--start`` with the exact sign test; per arm,
the flips pooled over its seeds; per arm against ``--reference``, the problems only one of them solved, pooled over
the seeds both ran (a problem under seed s is paired with itself under seed s). Writes a markdown table to stdout and
the numbers to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rapo_ray.agent.evaluation import paired_change, sign_test_p


def parse_run(text: str) -> tuple[str, int, Path]:
    """``ARM:SEED=FILE`` -> (arm, seed, file); a clear error naming the argument otherwise."""
    label, sep, path = text.partition("=")
    arm, colon, seed = label.partition(":")
    if not (sep and colon and arm and path and seed.isdigit()):
        raise SystemExit(f"run {text!r}: expected ARM:SEED=FILE, e.g. grpo:0=eval-grpo-s0.json")
    return arm, int(seed), Path(path)


def read_problems(path: Path) -> dict[str, dict[str, bool]]:
    """Per-problem results: data set -> problem id -> solved. From a jobs/evaluate.py JSON (problems by data set), or
    a run folder's eval_before.json / eval_after.json (one flat problem map: the run's held-out set, named
    ``held-out``), so that runs whose configs differ (and so cannot share a compare_algorithms report) still pair."""
    try:
        problems = json.loads(path.read_text())["problems"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(
            f"{path}: not a jobs/evaluate.py or run evaluation JSON with per-problem results ({exc})"
        ) from None
    if not isinstance(problems, dict) or not problems:
        raise SystemExit(f"{path}: its 'problems' holds no data set")
    if all(isinstance(ok, bool) for ok in problems.values()):  # a run's eval_*.json
        return {"held-out": dict(problems)}
    if not all(isinstance(solved, dict) for solved in problems.values()):
        raise SystemExit(f"{path}: 'problems' mixes data sets and single problems")
    return {name: {pid: bool(ok) for pid, ok in solved.items()} for name, solved in problems.items()}


def accuracy(solved: dict[str, bool]) -> float:
    return sum(solved.values()) / max(len(solved), 1)


def compare(start: dict[str, dict[str, bool]], runs: dict[tuple[str, int], dict], reference: str | None) -> dict:
    """start: data set -> problem -> solved; runs: (arm, seed) -> the same. Returns, per data set, ``runs`` (each
    run's accuracy and change against the start), ``arms`` (pooled over seeds) and ``against_reference``."""
    report = {}
    for name in start:
        have = {key: r[name] for key, r in runs.items() if name in r}
        per_run = [
            {"arm": arm, "seed": seed, "accuracy": accuracy(solved), **paired_change(start[name], solved)}
            for (arm, seed), solved in sorted(have.items())
        ]
        arms = {}
        for arm in dict.fromkeys(r["arm"] for r in per_run):
            mine = [r for r in per_run if r["arm"] == arm]
            fixed, broken = sum(r["fixed"] for r in mine), sum(r["broken"] for r in mine)
            accs = [r["accuracy"] for r in mine]
            arms[arm] = {
                "seeds": [r["seed"] for r in mine],
                "accuracy_mean": statistics.mean(accs),
                "accuracy_sd": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "fixed": fixed,
                "broken": broken,
                "p_value": sign_test_p(fixed, broken),
            }
        against = {}
        for arm in arms if reference in arms else ():
            seeds = sorted({s for a, s in have if a == arm} & {s for a, s in have if a == reference})
            if arm == reference or not seeds:
                continue

            def pooled(a, seeds=seeds):
                return {f"{s}:{pid}": ok for s in seeds for pid, ok in have[(a, s)].items()}

            # "fixed": the arm right where the reference was wrong
            against[arm] = {"seeds": seeds, **paired_change(pooled(reference), pooled(arm))}
        report[name] = {
            "n": len(start[name]),
            "start_accuracy": accuracy(start[name]),
            "runs": per_run,
            "arms": arms,
            "against_reference": against,
        }
    return report


def markdown(report: dict, reference: str | None) -> str:
    lines = []
    for name, r in report.items():
        lines += [
            f"### {name}: {r['n']} problems, start {r['start_accuracy']:.3f}",
            "",
            "| arm | seed | after | fixed | broken | sign test p |",
            "|---|---|---|---|---|---|",
        ]
        for run in r["runs"]:
            lines.append(
                f"| {run['arm']} | {run['seed']} | {run['accuracy']:.3f} | {run['fixed']} | {run['broken']} | "
                f"{run['p_value']:.2g} |"
            )
        for arm, a in r["arms"].items():
            lines.append(
                f"| {arm} | pooled ({len(a['seeds'])}) | {a['accuracy_mean']:.3f} ± {a['accuracy_sd']:.3f} | "
                f"{a['fixed']} | {a['broken']} | {a['p_value']:.2g} |"
            )
        for arm, c in r["against_reference"].items():
            lines.append(
                f"\n{arm} against {reference}, seeds {c['seeds']}: {c['fixed']} only {arm} / {c['broken']} only "
                f"{reference} of {c['n']} pairs, p = {c['p_value']:.2g}"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start", required=True, help="evaluate.py JSON of the common starting policy")
    ap.add_argument("--reference", default=None, help="the arm every other arm is paired against (e.g. grpo)")
    ap.add_argument("--out", default=None, help="JSON report")
    ap.add_argument("runs", nargs="+", help="ARM:SEED=FILE, one per evaluated run")
    args = ap.parse_args(argv)
    start = read_problems(Path(args.start))
    runs = {}
    for text in args.runs:
        arm, seed, path = parse_run(text)
        if (arm, seed) in runs:
            raise SystemExit(f"run {text!r}: {arm}:{seed} is given twice")
        runs[(arm, seed)] = read_problems(path)
    if args.reference and args.reference not in {arm for arm, _ in runs}:
        raise SystemExit(f"--reference {args.reference!r}: no run of that arm (arms: {sorted({a for a, _ in runs})})")
    report = compare(start, runs, args.reference)
    print(markdown(report, args.reference))
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"start": args.start, "runs": args.runs, "reference": args.reference, "report": report}, indent=1
            )
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
