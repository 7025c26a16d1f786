"""A prompt pool that remembers each training prompt's observed pass rate and samples toward the middle.

GRPO learns only from prompts that the policy sometimes solves and sometimes not. With
``trainer.prompt_sampling=pass_rate`` a step draws a prompt with weight p(1 - p), p being the prompt's smoothed pass
rate (c + 1) / (n + 2) after c correct of n rollouts so far (Laplace's rule: an unseen prompt counts as p = 1/2, the
largest weight, so every prompt is tried). Prompts seen always solved or never solved fall to a small weight but
never to zero, so a prompt whose rate changes as the policy learns can come back. The expected share of groups of
size G with signal, 1 - p^G - (1 - p)^G, is largest at p = 1/2, which is what the weight favours (online difficulty
filtering, arXiv 2504.03380, keeps prompts of intermediate pass rate for the same reason).
"""

from __future__ import annotations

from typing import Sequence

from rapo_ray.types.batch import TrajectoryBatch
from rapo_ray.types.trajectory import Task


class PromptPool:
    def __init__(self):
        self.counts: dict[str, list[int]] = {}  # task id -> [correct, rollouts]

    def observe(self, batch: TrajectoryBatch, task_of_group: dict[str, Task]) -> None:
        """Count every rollout of ``batch`` against its group's task (``task_of_group``: group id -> Task)."""
        for t in batch:
            c = self.counts.setdefault(task_of_group[t.group_id].id, [0, 0])
            c[0] += int(bool(t.correct))
            c[1] += 1

    def pass_rate(self, task_id: str) -> float:
        """The smoothed pass rate (c + 1) / (n + 2)."""
        c, n = self.counts.get(task_id, (0, 0))
        return (c + 1) / (n + 2)

    def weights(self, tasks: Sequence[Task]) -> list[float]:
        """Sampling weight p(1 - p) of each task."""
        return [p * (1 - p) for p in map(self.pass_rate, (t.id for t in tasks))]

    def metrics(self) -> dict[str, float]:
        """``prompt_pool/seen`` (prompts rolled out at least once), ``prompt_pool/never_solved`` and
        ``prompt_pool/always_solved`` among them, and ``prompt_pool/mean_pass_rate`` (raw c / n, over seen prompts)."""
        seen = [(c, n) for c, n in self.counts.values() if n]
        return {
            "prompt_pool/seen": float(len(seen)),
            "prompt_pool/never_solved": float(sum(c == 0 for c, _ in seen)),
            "prompt_pool/always_solved": float(sum(c == n for c, n in seen)),
            "prompt_pool/mean_pass_rate": sum(c / n for c, n in seen) / len(seen) if seen else 0.0,
        }

    def get_state(self) -> dict:
        return {tid: list(c) for tid, c in self.counts.items()}

    def set_state(self, state: dict) -> None:
        for tid, c in state.items():
            if not (isinstance(c, list) and len(c) == 2 and 0 <= c[0] <= c[1]):
                raise ValueError(f"prompt pool state: prompt {tid!r} has counts {c!r}, expected [correct, rollouts]")
        self.counts = {tid: [int(c[0]), int(c[1])] for tid, c in state.items()}
