"""Dynamic sampling (DAPO; verl's ``filter_groups``): a step trains only on groups whose rewards differ.

A group whose rollouts all earned the same reward has zero outcome advantage: it costs a learner pass and teaches
nothing. With ``trainer.dynamic_sampling`` the step drops such groups and rolls out fresh prompts in their place,
round after round, until it holds ``trainer.prompts_per_step`` groups with signal or has rolled out
``trainer.dynamic_sampling_budget`` x ``prompts_per_step`` groups in all (the cap on extra generation). Groups with
signal past the target are left out (verl does the same), so the batch keeps the size the learner was sized for.
A step that finds no group with signal within the cap trains on its first draw (zero outcome advantage everywhere:
only the KL term and RAPO's retrieval reward can move the weights) and says so in ``dynamic_sampling/no_signal``.

The filter reads each trajectory's outcome reward (``Trajectory.reward``, the task's reward), not RAPO's retrieval
reward, as DAPO's filter reads the task metric.
"""

from __future__ import annotations

import math
from typing import Callable

from rapo_ray.training.staleness import merge_rollout_stats
from rapo_ray.types.batch import TrajectoryBatch

# roll_out(n, first): roll out n new groups numbered first, first + 1, ...; returns ((group id, Task) pairs, their
# trajectories, the fleet's stats)
RollOut = Callable[[int, int], tuple[list[tuple], TrajectoryBatch, dict]]


def groups_with_signal(batch: TrajectoryBatch) -> set[str]:
    """The group ids whose trajectories' rewards are not all equal (a group of one never has signal)."""
    rewards: dict[str, set[float]] = {}
    for t in batch:
        rewards.setdefault(t.group_id, set()).add(float(t.reward))
    return {gid for gid, rs in rewards.items() if len(rs) > 1}


def dynamic_sample(target: int, budget: float, roll_out: RollOut) -> tuple[list[tuple], TrajectoryBatch, dict]:
    """Roll out ``target`` groups, then refill the ones without signal until ``target`` have signal or
    ``ceil(budget x target)`` groups were rolled out in all. Each refill round draws enough fresh groups for the
    signal rate seen so far to fill the step (at least the number missing, at least a tenth of a rate assumed),
    within the cap.

    Returns the groups trained on (in the order drawn), their trajectories, and the merged rollout stats with
    ``dynamic_sampling/*`` counts: ``groups_kept``, ``groups_dropped`` (no signal), ``groups_surplus`` (signal past
    the target), ``extra_rollouts`` (trajectories of the refill rounds), ``refill_rounds`` and ``no_signal``."""
    if target < 1:
        raise ValueError(f"dynamic sampling needs a target of at least one group, got {target}")
    if budget < 1:
        raise ValueError(f"trainer.dynamic_sampling_budget ({budget}) must be >= 1: the first draw alone is 1")
    cap = max(target, math.ceil(budget * target))
    groups, batch, stats = roll_out(target, 0)
    first_groups, first_batch = groups, batch
    kept_groups: list[tuple] = []
    kept_parts: list[TrajectoryBatch] = []
    drawn, with_signal, dropped, surplus, rounds, extra_rollouts = target, 0, 0, 0, 0, 0
    while True:
        signal = groups_with_signal(batch)
        rows: dict[str, list[int]] = {}
        for i, gid in enumerate(batch.group_ids()):
            rows.setdefault(gid, []).append(i)
        for group in groups:
            gid = group[0]
            if gid not in signal:
                dropped += 1
            elif len(kept_groups) < target:
                kept_groups.append(group)
                kept_parts.append(batch.select(rows.get(gid, [])))
                with_signal += 1
            else:
                surplus += 1
                with_signal += 1
        need = target - len(kept_groups)
        if need == 0 or drawn >= cap:
            break
        rate = max(with_signal / drawn, 0.1)
        n = min(cap - drawn, max(need, math.ceil(need / rate)))
        groups, batch, more = roll_out(n, drawn)
        stats = merge_rollout_stats(stats, more)
        extra_rollouts += len(batch)
        drawn += n
        rounds += 1
    no_signal = not kept_groups
    if no_signal:
        kept_groups, out = first_groups, first_batch
    else:
        out = TrajectoryBatch.concat(kept_parts)
    stats = dict(stats)
    stats.update(
        {
            "dynamic_sampling/groups_kept": float(0 if no_signal else len(kept_groups)),
            "dynamic_sampling/groups_dropped": float(dropped),
            "dynamic_sampling/groups_surplus": float(surplus),
            "dynamic_sampling/extra_rollouts": float(extra_rollouts),
            "dynamic_sampling/refill_rounds": float(rounds),
            "dynamic_sampling/no_signal": float(no_signal),
        }
    )
    return kept_groups, out, stats
