"""Bounded staleness bookkeeping (rapo_ray/training/staleness.py) against hand-counted batches."""

from __future__ import annotations

from collections import Counter

import pytest

from rapo_ray.training.staleness import (
    RolloutAhead,
    lag_histogram,
    merge_rollout_stats,
    replace_groups,
    stale_groups,
    staleness_metrics,
)
from rapo_ray.types.batch import TrajectoryBatch
from rapo_ray.types.trajectory import Trajectory


def _traj(group: str, slot: int, version: int, reward: float = 0.0) -> Trajectory:
    return Trajectory(
        group_id=group,
        slot=slot,
        slot_kind="on_policy",
        problem_id=f"p-{group}",
        task_kind="math",
        answers=("1",),
        prompt_ids=[1, 2],
        policy_version=version,
        reward=reward,
    )


def _ahead(versions: dict[str, list[int]]) -> RolloutAhead:
    trajs = [_traj(g, i, v) for g, vs in versions.items() for i, v in enumerate(vs)]
    return RolloutAhead(
        step=3,
        groups=[(g, f"task-{g}") for g in versions],
        batch=TrajectoryBatch(trajs),
        stats={"generate_s": 1.0, "requeued_groups": 0, "slowest_chunk_s": 2.0},
        rollout_s=2.5,
    )


def _ahead_without(group: str) -> RolloutAhead:
    ahead = _ahead({"a": [1, 1], "b": [0, 0], "c": [1, 1]})
    ahead.batch = TrajectoryBatch([t for t in ahead.batch if t.group_id != group])
    return ahead


def test_lags_and_stale_groups_hand_counted():
    # learners at version 5: group a sampled at 4 (lag 1), b at 3 (lag 2), c mixed 4/2 (a replaced worker; lag 3)
    ahead = _ahead({"a": [4, 4], "b": [3, 3], "c": [4, 2]})
    assert lag_histogram(ahead.batch, 5) == Counter({1: 3, 2: 2, 3: 1})
    assert stale_groups(ahead.batch, 5, max_staleness=2) == {"c"}  # any trajectory beyond the bound stales its group
    assert stale_groups(ahead.batch, 5, max_staleness=1) == {"b", "c"}
    assert stale_groups(ahead.batch, 5, max_staleness=3) == set()
    m = staleness_metrics(lag_histogram(ahead.batch, 5), dropped_groups=1)
    assert m == {
        "staleness_mean": pytest.approx((1 * 3 + 2 * 2 + 3 * 1) / 6),
        "staleness_max": 3.0,
        "stale_groups_dropped": 1.0,
        "staleness/lag1": 3.0,
        "staleness/lag2": 2.0,
        "staleness/lag3": 1.0,
    }
    assert staleness_metrics(Counter(), 0)["staleness_max"] == 0.0


def test_replace_groups_keeps_the_step_order_and_every_group_once():
    ahead = _ahead({"a": [1, 1], "b": [0, 0], "c": [1, 1]})
    fresh = TrajectoryBatch([_traj("b", 1, 2, reward=1.0), _traj("b", 0, 2, reward=1.0)])
    out = replace_groups(ahead, {"b"}, fresh)
    assert out.group_ids() == ["a", "a", "b", "b", "c", "c"]
    assert [t.policy_version for t in out] == [1, 1, 2, 2, 1, 1]  # b's stale rows are gone, its fresh ones in
    assert out.rewards() == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    # a re-rollout that lost a group or brought another is an error, never a silently wrong batch
    with pytest.raises(RuntimeError, match=r"step 4: the re-rollout of stale groups \['b'\] returned groups \['x'\]"):
        replace_groups(ahead, {"b"}, TrajectoryBatch([_traj("x", 0, 2)]))
    # every group of the step must come out (a batch that lost one of its groups before the re-rollout)
    with pytest.raises(RuntimeError, match=r"step 4: groups \['c'\] have no trajectories"):
        replace_groups(_ahead_without("c"), {"b"}, fresh)


def test_merge_rollout_stats_adds_times_and_keeps_the_slowest_chunk():
    a = {"generate_s": 1.0, "requeued_groups": 1, "replaced_workers": 0, "slowest_chunk_s": 2.0}
    b = {"generate_s": 0.5, "requeued_groups": 0, "replaced_workers": 1, "slowest_chunk_s": 3.0}
    assert merge_rollout_stats(a, b) == {
        "generate_s": 1.5,
        "requeued_groups": 1,
        "replaced_workers": 1,
        "slowest_chunk_s": 3.0,
    }
