"""Bounded staleness (``algo.max_staleness = k``): the bookkeeping of rollouts made ahead of their update.

With k >= 1 the fleet rolls out the groups of steps t+1 .. t+k while the learners update on step t (the trainer's
``step``). A step's rollout that finished before its update is a ``RolloutAhead``. When its update comes, each
trajectory's *lag* is the learners' version minus the version of the weights that sampled it
(``Trajectory.policy_version``, stamped by the engine); a group with any trajectory lagging more than k is stale:
it is dropped, counted, and rolled out again with the current weights. By construction the trainer never rolls
out further ahead than k, so stale groups appear only when a run resumes with a smaller k than it saved with.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rapo_ray.types.batch import TrajectoryBatch


@dataclass
class RolloutAhead:
    """One step's finished rollout, waiting for its update.

    step:      the (0-based) step whose update uses it; its prompts and sampling seed are that step's
    groups:    (group id, Task) pairs in the order the step sampled them
    batch:     the fleet's trajectories, ordered by (group, slot)
    stats:     the fleet's stats for it (``RolloutFleet.run_step``)
    rollout_s: its wall time
    """

    step: int
    groups: list[tuple]
    batch: TrajectoryBatch
    stats: dict
    rollout_s: float


def lag_histogram(batch: TrajectoryBatch, version: int) -> Counter:
    """Trajectories per lag (``version - policy_version``) for an update at learner ``version``."""
    return Counter(version - t.policy_version for t in batch)


def stale_groups(batch: TrajectoryBatch, version: int, max_staleness: int) -> set[str]:
    """Group ids with a trajectory more than ``max_staleness`` versions behind ``version``."""
    return {t.group_id for t in batch if version - t.policy_version > max_staleness}


def replace_groups(ahead: RolloutAhead, redone: set[str], fresh: TrajectoryBatch) -> TrajectoryBatch:
    """``ahead.batch`` with the groups ``redone`` taken from ``fresh`` (their re-rollout), in the step's group order.
    ``fresh`` must hold exactly the groups ``redone``: a group is never counted twice nor lost."""
    if set(fresh.group_ids()) != redone:
        raise RuntimeError(
            f"step {ahead.step + 1}: the re-rollout of stale groups {sorted(redone)[:5]} returned groups "
            f"{sorted(set(fresh.group_ids()))[:5]}"
        )
    rows: dict[str, tuple[TrajectoryBatch, list[int]]] = {}
    for batch, take in ((ahead.batch, lambda g: g not in redone), (fresh, lambda g: True)):
        for i, gid in enumerate(batch.group_ids()):
            if take(gid):
                rows.setdefault(gid, (batch, []))[1].append(i)
    missing = [g for g, _ in ahead.groups if g not in rows]
    if missing:
        raise RuntimeError(f"step {ahead.step + 1}: groups {missing[:5]} have no trajectories")
    return TrajectoryBatch.concat([rows[g][0].select(rows[g][1]) for g, _ in ahead.groups])


def merge_rollout_stats(a: dict, b: dict) -> dict:
    """Two ``run_step`` stats of one step (its rollout and a re-rollout of stale groups): times and counts add up,
    the slowest chunk is the slower of the two."""
    out = {k: a.get(k, 0.0) + b.get(k, 0.0) for k in set(a) | set(b)}
    out["slowest_chunk_s"] = max(a.get("slowest_chunk_s", 0.0), b.get("slowest_chunk_s", 0.0))
    return out


def staleness_metrics(lags: Counter, dropped_groups: int) -> dict[str, float]:
    """A step's metrics: ``staleness_mean`` and ``staleness_max`` over its trajectories, ``staleness/lag<j>`` (how
    many trajectories lagged j versions) and ``stale_groups_dropped``."""
    n = sum(lags.values())
    m: dict[str, float] = {
        "staleness_mean": sum(lag * c for lag, c in lags.items()) / n if n else 0.0,
        "staleness_max": float(max(lags)) if lags else 0.0,
        "stale_groups_dropped": float(dropped_groups),
    }
    m.update({f"staleness/lag{lag}": float(c) for lag, c in sorted(lags.items())})
    return m
