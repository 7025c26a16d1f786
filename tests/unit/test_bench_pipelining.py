"""benchmarks/bench_pipelining.py's step accounting against hand-computed values."""

from __future__ import annotations

import pytest

from tests.helpers import benchmark_module


def _step(step, rollout, old, adv, update, sync, total, lag=1.0):
    return {
        "step": step,
        "reward": -1.0,
        "rollout_s": rollout,
        "old_logprob_s": old,
        "advantages_s": adv,
        "update_s": update,
        "sync_s": sync,
        "step_s": total,
        "staleness_mean": lag,
    }


def test_step_times_hand_computed():
    bench = benchmark_module("bench_pipelining")
    metrics = [
        _step(1, 9.0, 9.0, 9.0, 9.0, 9.0, 99.0, lag=0.0),  # the first step is left out (nothing ran ahead of it)
        _step(2, 2.0, 0.5, 0.1, 1.4, 0.2, 2.4),
        {"step": 2, "eval/mean_accuracy": 0.0},  # not a step's metrics
        _step(3, 2.0, 0.5, 0.1, 1.4, 0.2, 2.4),
        _step(4, 4.0, 0.5, 0.1, 1.4, 0.2, 4.2),
    ]
    t = bench.step_times(metrics)
    # medians: rollout 2.0, learners 0.5 + 0.1 + 1.4 = 2.0, sync 0.2, step 2.4; sequential 4.2, ideal 2.2
    assert t["rollout_s"] == 2.0 and t["learners_s"] == pytest.approx(2.0) and t["sync_s"] == 0.2
    assert t["sequential_s"] == pytest.approx(4.2) and t["ideal_s"] == pytest.approx(2.2)
    assert t["hidden"] == pytest.approx((4.2 - 2.4) / (4.2 - 2.2))  # 0.9 of the overlappable 2.0 s hidden
    assert t["steps"] == 3 and t["staleness_mean"] == 1.0
    with pytest.raises(ValueError, match="at least 2 steps"):
        bench.step_times(metrics[:1])
