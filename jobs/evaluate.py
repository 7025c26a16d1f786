"""Evaluate a checkpoint: pass@1 (exact match / math equivalence) and F1 per dataset, greedy, no retrieval,
batched through the rollout fleet.

    python jobs/evaluate.py --checkpoint runs/rapo-20261122-101500
    python jobs/evaluate.py --checkpoint DIR --datasets bundled,../shared/data/eval/gsm8k/test.jsonl --limit 200
    python jobs/evaluate.py --checkpoint RUN --baseline eval-BEFORE.json   # what training fixed and broke, sign test

--datasets: comma-separated; `bundled` (the held-out split of every tasks.families family), a data file of
the loader's shapes (jsonl / parquet; rapo_ray.envs.loaders), or a folder (every */test.jsonl under it).
Default: bundled plus ../shared/data/eval when it exists. Writes a table and a JSON file (--out).
Note: the search tool searches the bundled corpus; web-search datasets (bamboogle, gaia, ...) measure the
model without a real search engine behind it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from rapo_ray.launch.cli import parse  # noqa: E402

DEFAULT_EVAL_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"


def _extra(parser):
    parser.add_argument(
        "--checkpoint", required=True, help="HF model folder, trainer checkpoint, run directory, or a folder of runs"
    )
    parser.add_argument(
        "--datasets",
        default="",
        help="comma-separated: bundled, data files, folders (default: bundled + ../shared/data/eval)",
    )
    parser.add_argument("--limit", type=int, default=100, help="examples per dataset (0: all)")
    parser.add_argument(
        "--out", default="", help="JSON output (default: eval-<checkpoint name>.json next to the run, or ./)"
    )
    parser.add_argument(
        "--baseline",
        default="",
        help="an earlier evaluate.py JSON (e.g. of the starting policy): per dataset in both, the problems each "
        "fixed and broke, and the exact sign test's p-value",
    )


def dataset_specs(text: str) -> list[str]:
    specs = (
        [s.strip() for s in text.split(",") if s.strip()]
        if text
        else ["bundled"] + ([str(DEFAULT_EVAL_DIR)] if DEFAULT_EVAL_DIR.is_dir() else [])
    )
    out = []
    for s in specs:
        p = Path(s)
        if s == "bundled":
            out.append(s)
        elif p.is_dir():
            files = sorted(p.glob("*/test.jsonl")) + sorted(p.glob("*.jsonl"))
            if not files:
                raise SystemExit(f"--datasets: folder {p} holds no */test.jsonl or *.jsonl files")
            out.extend(str(f) for f in files)
        elif p.is_file():
            out.append(str(p))
        else:
            raise SystemExit(f"--datasets: {s!r} is not 'bundled', a file, or a folder")
    return out


def load_datasets(cfg, specs: list[str], limit: int) -> dict[str, list]:
    from rapo_ray.envs.loaders import load_examples
    from rapo_ray.envs.suite import dataset_name, task_splits, to_task

    out = {}
    for s in specs:
        if s == "bundled":
            _, test = task_splits(cfg.tasks)
            for fam, tasks in test.items():
                out[fam] = tasks[:limit] if limit else tasks
        else:
            examples, _ = load_examples(s, limit=limit or None)
            out[dataset_name(s)] = [to_task(e) for e in examples]
    return out


def main(argv=None) -> int:
    cfg, args = parse(__doc__, argv, extra=_extra)
    import ray

    from rapo_ray.agent.evaluation import family_result, format_table, paired_change
    from rapo_ray.core.errors import ModelLoadError
    from rapo_ray.launch.launcher import init_ray
    from rapo_ray.model.factory import load_tokenizer, resolve_checkpoint
    from rapo_ray.types import protocol
    from rapo_ray.workers.rollout import RolloutFleet

    try:
        model_dir = resolve_checkpoint(args.checkpoint)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    baseline = {}
    if args.baseline:
        try:
            baseline = {k: dict(v) for k, v in json.loads(Path(args.baseline).read_text())["problems"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            print(
                f"error: --baseline {args.baseline}: not an evaluate.py JSON with per-problem results ({exc})",
                file=sys.stderr,
            )
            return 2
    from dataclasses import replace

    if (
        cfg.tasks.system_prompt == "auto"
    ):  # the bundled model (its frame tokens in the vocabulary) uses the short prompt
        bundled = protocol.ASSISTANT in load_tokenizer(model_dir).get_vocab()
        cfg = replace(cfg, tasks=replace(cfg.tasks, system_prompt="short" if bundled else "paper"))
    datasets = load_datasets(cfg, dataset_specs(args.datasets), args.limit)
    owns_ray = not ray.is_initialized()  # disconnect at the end, also from a cluster (its Ray stays up)
    init_ray(cfg)
    fleet = None
    try:
        fleet = RolloutFleet(str(model_dir), cfg, None)
        results, timings, problems = {}, {}, {}
        for name, tasks in datasets.items():
            t0 = time.perf_counter()
            groups = [(f"eval-{name}-{i}", t) for i, t in enumerate(tasks)]
            batch, _ = fleet.run_step(groups, 1, seed=0, evaluation=True)
            results[name] = family_result(batch.trajectories)
            problems[name] = {t.problem_id: bool(t.correct) for t in batch.trajectories}
            timings[name] = round(time.perf_counter() - t0, 1)
            print(f"{name}: {len(tasks)} examples in {timings[name]} s", flush=True)
    finally:
        if fleet is not None:
            fleet.shutdown()
        if owns_ray:
            ray.shutdown()
    print(format_table(results, f"checkpoint {model_dir} (greedy, no retrieval):"))
    change = {k: paired_change(baseline[k], solved) for k, solved in problems.items() if k in baseline}
    if baseline and not change:
        print(f"--baseline {args.baseline}: no dataset in common with this evaluation ({sorted(baseline)})")
    for name, c in change.items():
        print(
            f"{name} against --baseline: {c['fixed']} fixed, {c['broken']} broken of {c['n']} "
            f"({c['gain']:+.3f}, sign test p = {c['p_value']:.2g})"
        )
    out = (
        Path(args.out)
        if args.out
        else (model_dir.parent.parent if model_dir.parent.name == "checkpoints" else Path("."))
        / f"eval-{model_dir.name}.json"
    )
    out.write_text(
        json.dumps(
            {
                "checkpoint": str(model_dir),
                "limit": args.limit,
                "seconds": timings,
                "results": {k: v.as_dict() for k, v in results.items()},
                "problems": problems,  # dataset -> problem id -> solved, for a later --baseline
                **({"baseline": args.baseline, "paired_change": change} if change else {}),
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
