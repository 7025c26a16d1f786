"""The multi-turn tool agent loop: groups of trajectories per task, rolled out with one of two schedules
(rapo_ray/agent/lockstep.py, rapo_ray/agent/per_trajectory.py) over the shared turn (rapo_ray/agent/turns.py).
What an algorithm adds to a rollout (RAPO's hybrid slots and retrievals, ARPO's branching) comes from its
rollout policy (rapo_ray/algos/rollout.py), so the loop itself knows no algorithm."""

from __future__ import annotations

from typing import Callable, Sequence

from rapo_ray.agent.lockstep import run_lockstep
from rapo_ray.agent.per_trajectory import run_per_trajectory
from rapo_ray.agent.retriever import StepRetriever
from rapo_ray.agent.turns import AgentTurns, LoopSettings, RolloutStats
from rapo_ray.algos.rollout import ON_POLICY_ROLLOUT, RolloutPolicy
from rapo_ray.config.sections import ROLLOUT_SCHEDULES
from rapo_ray.engines.base import InferenceEngine
from rapo_ray.types.environment import Environment
from rapo_ray.types.trajectory import Task, Trajectory

# Keyed by name, not by position in ROLLOUT_SCHEDULES, so reordering that tuple cannot swap two schedules.
SCHEDULES = {"lockstep": run_lockstep, "per_trajectory": run_per_trajectory}
if set(SCHEDULES) != set(ROLLOUT_SCHEDULES):
    raise ImportError(f"agent SCHEDULES {sorted(SCHEDULES)} != config ROLLOUT_SCHEDULES {sorted(ROLLOUT_SCHEDULES)}")


class AgentLoop(AgentTurns):
    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer,
        tools: Environment,
        settings: LoopSettings,
        retriever: StepRetriever | None = None,
        on_append: Callable[[Trajectory, str, list[int]], None] | None = None,
        rollout: RolloutPolicy = ON_POLICY_ROLLOUT,
    ):
        """``rollout``: the running algorithm's rollout policy (``Algorithm.rollout``); plain on-policy
        sampling by default (evaluation, serving). ``on_append`` is called after every appended segment."""
        super().__init__(engine, tokenizer, tools, settings, retriever, on_append)
        if settings.schedule not in SCHEDULES:
            raise ValueError(f"rollout.schedule: {settings.schedule!r} is not one of {sorted(SCHEDULES)}")
        self.rollout = rollout

    def run_groups(
        self, tasks: Sequence[Task], group_size: int, group_ids: Sequence[str] | None = None
    ) -> tuple[list[Trajectory], RolloutStats]:
        """Roll out a group of up to ``group_size`` trajectories per task (group ids default to task ids). The
        rollout policy picks each group's starting slots; ARPO's groups grow to ``group_size`` by branching."""
        group_ids = list(group_ids) if group_ids is not None else [t.id for t in tasks]
        rollout = self.rollout.begin(group_ids, group_size, self.rng, len(self.tok))
        trajs: list[Trajectory] = []
        for task, gid in zip(tasks, group_ids):
            self.add_samples(trajs, task, gid, rollout.initial_slots(group_size))
        stats = RolloutStats()
        schedule = SCHEDULES[self.s.schedule]
        trajs = schedule(self, trajs, stats, rollout, {gid: task for task, gid in zip(tasks, group_ids)})
        return trajs, stats


__all__ = ["AgentLoop", "LoopSettings", "RolloutStats", "SCHEDULES"]
