"""Held-out evaluation: pass@1 per family, no retrieval, through the same agent loop as training."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from rapo_ray.agent.loop import AgentLoop, LoopSettings
from rapo_ray.types.trajectory import Task, Trajectory


@dataclass
class FamilyResult:
    n: int
    accuracy: float  # exact match (QA) / equivalence (math)
    f1: float
    format_valid: float
    mean_tool_calls: float
    mean_response_tokens: float

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def family_result(trajectories: Sequence[Trajectory]) -> FamilyResult:
    """One dataset's result from its trajectories, one per example and sample."""
    n = max(len(trajectories), 1)
    return FamilyResult(
        n=len({t.problem_id for t in trajectories}),
        accuracy=sum(float(t.correct) for t in trajectories) / n,
        f1=sum(float(t.f1) for t in trajectories) / n,
        format_valid=sum(float(t.format_ok) for t in trajectories) / n,
        mean_tool_calls=sum(t.tool_calls for t in trajectories) / n,
        mean_response_tokens=sum(len(t.response_ids) for t in trajectories) / n,
    )


def evaluate(
    engine,
    tokenizer,
    tools,
    tasks_by_family: dict[str, list[Task]],
    cfg,
    limit: int | None = None,
    temperature: float = 0.0,
    samples: int = 1,
    seed: int = 0,
) -> dict[str, FamilyResult]:
    """Greedy (default) or sampled pass@1 on each family. ``samples`` > 1 averages over samples per task."""
    settings = LoopSettings.from_config(cfg, evaluation=True)
    settings.temperature, settings.seed = temperature, seed
    loop = AgentLoop(engine, tokenizer, tools, settings, retriever=None)
    out = {}
    for fam, tasks in tasks_by_family.items():
        tasks = tasks[:limit] if limit else tasks
        trajs, _ = loop.run_groups(tasks, group_size=samples)
        out[fam] = family_result(trajs)
    return out


def paired_change(before: dict[str, bool], after: dict[str, bool]) -> dict:
    """Before/after correctness of the same held-out problems: how many flipped each way and the exact
    two-sided sign-test p-value (McNemar's exact test) of "training changed nothing".

    before, after: problem id -> correct. Only problems in both count.
    Returns {"n", "fixed" (wrong -> right), "broken" (right -> wrong), "gain" (accuracy points), "p_value"}.
    """
    ids = sorted(set(before) & set(after))
    fixed = sum(1 for i in ids if after[i] and not before[i])
    broken = sum(1 for i in ids if before[i] and not after[i])
    return {
        "n": len(ids),
        "fixed": fixed,
        "broken": broken,
        "gain": (fixed - broken) / max(len(ids), 1),
        "p_value": sign_test_p(fixed, broken),
    }


def sign_test_p(fixed: int, broken: int) -> float:
    """The exact two-sided sign test's p-value of ``fixed`` flips one way against ``broken`` the other (1 for none)."""
    flips = fixed + broken
    tail = sum(math.comb(flips, k) for k in range(min(fixed, broken) + 1)) / 2**flips if flips else 1.0
    return min(1.0, 2 * tail)


def format_table(results: dict[str, FamilyResult], title: str = "") -> str:
    lines = [title] if title else []
    lines.append(f"{'family':12} {'n':>5} {'acc':>7} {'f1':>7} {'format':>7} {'tools':>6} {'tokens':>7}")
    for fam, r in results.items():
        lines.append(
            f"{fam:12} {r.n:5d} {r.accuracy:7.3f} {r.f1:7.3f} {r.format_valid:7.3f} {r.mean_tool_calls:6.2f} {r.mean_response_tokens:7.1f}"
        )
    return "\n".join(lines)
