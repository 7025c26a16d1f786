"""Where held-out multihop answers go wrong: each run's newest checkpoint, greedy on the bundled multihop test
problems without retrieval (as the held-out evaluation runs them), every trajectory classified by the first place it
leaves the question's chain of searches.

    .venv/bin/python benchmarks/multihop_chain.py --runs <out>/runs/grpo-s0 <out>/runs/rapo-s0 ... \
        [--before <artifacts>/warm-start-<hash>] [--limit 100] [--out multihop_chain.json]

A multihop question ("Who is the R3 of the R2 of the R1 of X?") is solved by searching "R1 of X", reading the
entity Y from "The R1 of X is Y.", then "R2 of Y", and so on. The first deviation of a trajectory is one of:
``correct``; ``right chain, wrong answer`` (every hop searched as planned, the boxed answer wrong); ``hop k: wrong
relation`` (the right entity with another relation); ``hop k: stale entity`` (an entity the context holds, not the
one the last hop found); ``hop k: off-chain entity`` (an entity that neither the question nor any result shows);
``hop k: malformed``; ``answered after hop k`` (too early); ``extra search``; ``no answer``. Runs are pooled into
arms by their name without the ``-s<seed>`` suffix (compare_algorithms' run names). Prints one JSON line per run
and a table per arm.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

from rapo_ray.agent.loop import AgentLoop, LoopSettings
from rapo_ray.config import load_config
from rapo_ray.core.files import write_json_atomic
from rapo_ray.engines.torch_engine import TorchEngine
from rapo_ray.envs.suite import build_tools, task_splits
from rapo_ray.envs.tasks import multihop_plan
from rapo_ray.model.factory import load_model_and_tokenizer, resolve_checkpoint, set_torch_threads
from rapo_ray.retrieval.search_index import search_index_for
from rapo_ray.types.trajectory import GENERATED, TOOL_RESULT

_NAME = re.compile(r"[A-Z][a-z]+")
_SEARCH = re.compile(r"<search>(.*?)</search>", re.S)


def first_deviation(question: str, segments: list[tuple[str, str]], correct: bool) -> str:
    """The first place a multihop trajectory leaves its question's chain (the categories are in the module doc).

    Args:
        question: the bundled multihop question.
        segments: the response as ``(kind, text)`` in order (``trajectory.GENERATED``, ``TOOL_RESULT``, ...).
        correct: whether the trajectory's answer was scored correct.
    """
    plan = multihop_plan(question)
    if plan is None:
        raise ValueError(f"not a multihop question: {question!r}")
    entity, relations = plan
    seen = set(_NAME.findall(question))
    hop = 0  # searches made as planned
    for kind, text in segments:
        if kind != GENERATED:
            if kind == TOOL_RESULT and hop:
                found = re.search(rf"The {re.escape(relations[hop - 1])} of {re.escape(entity)} is (\w+)", text)
                entity = found.group(1) if found else entity
            seen |= set(_NAME.findall(text))
            continue
        for query in _SEARCH.findall(text):
            if hop >= len(relations):
                return "extra search"
            parts = re.fullmatch(r"(\w+) of (\w+)", query.strip())
            if parts is None:
                return f"hop {hop + 1}: malformed"
            if parts.group(2) != entity:
                return f"hop {hop + 1}: " + ("stale entity" if parts.group(2) in seen else "off-chain entity")
            if parts.group(1) != relations[hop]:
                return f"hop {hop + 1}: wrong relation"
            hop += 1
        if "<answer>" in text:
            if hop < len(relations):
                return f"answered after hop {hop}"
            return "correct" if correct else "right chain, wrong answer"
    return "no answer"


def arm_of(run_name: str) -> str:
    """compare_algorithms' run name without its seed: ``rapo_handed-unpaid-s2`` -> ``rapo_handed-unpaid``."""
    return re.sub(r"-s\d+$", "", run_name)


def classify_checkpoint(model_dir: Path, cfg, tasks, tools) -> Counter:
    model, tok = load_model_and_tokenizer(model_dir)
    settings = LoopSettings.from_config(cfg, evaluation=True)
    loop = AgentLoop(TorchEngine(model, tok), tok, tools, settings, retriever=None)
    trajectories, _ = loop.run_groups(tasks, group_size=1)
    by_id = {t.id: t for t in tasks}
    out = Counter()
    for t in trajectories:
        segments = [(kind, tok.decode(t.response_ids[a:b])) for kind, a, b in t.segments]
        out[first_deviation(by_id[t.problem_id].question, segments, bool(t.correct))] += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", type=Path, required=True, help="run directories with checkpoints")
    ap.add_argument("--before", type=Path, default=None, help="the runs' starting policy (a model folder)")
    ap.add_argument("--limit", type=int, default=100, help="held-out multihop problems (the first N)")
    ap.add_argument("--out", type=Path, default=None, help="JSON output")
    args = ap.parse_args()
    for run in args.runs:
        if not (run / "config.yaml").is_file():
            sys.exit(f"--runs: {run} has no config.yaml (not a run directory)")
    set_torch_threads(1)
    cfg = load_config(args.runs[0] / "config.yaml")
    if "multihop" not in cfg.tasks.families:
        sys.exit(f"--runs: {args.runs[0]} trains on {cfg.tasks.families}, without the multihop family")
    _, test = task_splits(cfg.tasks)
    tasks = test["multihop"][: args.limit]
    tools = build_tools(cfg.tasks, cfg.rollout, search_index_for(cfg.tasks))
    models = ([("before", args.before)] if args.before else []) + [(r.name, resolve_checkpoint(r)) for r in args.runs]
    per_run, per_arm = {}, {}
    for name, model_dir in models:
        counts = classify_checkpoint(model_dir, cfg, tasks, tools)
        per_run[name] = dict(sorted(counts.items()))
        per_arm.setdefault(arm_of(name), Counter()).update(counts)
        print(json.dumps({"run": name, "checkpoint": str(model_dir), **per_run[name]}), flush=True)
    kinds = sorted({k for c in per_arm.values() for k in c})
    print("\n| arm | runs | " + " | ".join(kinds) + " |\n|---|---|" + "---|" * len(kinds))
    for arm, c in per_arm.items():
        runs = sum(1 for n in per_run if arm_of(n) == arm)
        print(f"| {arm} | {runs} | " + " | ".join(str(c.get(k, 0)) for k in kinds) + " |")
    if args.out:
        write_json_atomic(args.out, {"problems": len(tasks), "runs": per_run})
    return 0


if __name__ == "__main__":
    sys.exit(main())
