"""benchmarks/control_plane.py's packed engines on the suite's local Ray: the real fleet and weight sync drive many
engines per process, and a host's death re-queues its engines' groups exactly once."""

from __future__ import annotations

import argparse

import pytest

from tests.helpers import benchmark_module


@pytest.mark.parametrize("relay_min_workers", [0, 6], ids=["direct", "relays"])
def test_packed_fleet_steps_kill_and_sync(ray_session, relay_min_workers):
    control_plane = benchmark_module("control_plane")
    # (no gc.freeze: it would freeze the suite's own heap)
    args = argparse.Namespace(
        hosts=2,
        steps=1,
        group_size=2,
        decode_s=0.5,  # each engine sleeps this per rollout: long enough for the kill to land mid-step
        model_kb=4,
        timeout=60.0,
        profile=5,
        gc_freeze=False,
        relay_min_workers=relay_min_workers,
    )
    out = control_plane.fleet_size(args, 6)
    assert (out["hosts"], out["per_host"]) == (2, 3)
    assert out["uses_relays"] == (relay_min_workers > 0)
    for step in (out["first_step"], *out["steps"]):
        assert step["each_group_once"] and step["trajectories"] == 12
        assert step["requeued_groups"] == step["replaced_workers"] == step["lost_relays"] == 0
        assert step["relays"] == (1 if relay_min_workers else 0)  # the suite's Ray is one node
        assert (step["relays_cpu_s"] > 0) == (relay_min_workers > 0)
        assert step["wall_s"] >= args.decode_s
        assert 0 < step["driver_main_thread_cpu_s"] <= step["driver_cpu_s"]
        assert 0 <= step["gc_s"] <= step["driver_cpu_s"] and step["gc_s"] == pytest.approx(
            sum(step["gc_s_by_generation"])
        )
    kill = out["kill"]  # one host of two (3 engines, one group each) killed once every group was out
    assert kill["killed_engines"] == 3
    assert kill["requeued_groups"] == 3 and kill["replaced_workers"] == 3
    assert kill["each_group_once"] and kill["trajectories"] == 12
    sync = out["sync"]  # 6 engines + the stub learner; pushes 1 and 2, then 3 to the fleet with its replacements
    assert sync["members"] == 7 and sync["replaced_at_push"] == 0
    assert out["ping_all_s"] > 0 and out["driver_rss_mb"] > 0
    patterns = ("wait_each", "callbacks_get", "callbacks_future", "ping_get_each", "ping_get_all")
    assert set(out["collection"]) == set(patterns)
    for name in patterns:  # two turns each, every call collected (a lost one would hang, a failed one raise)
        assert len(out["collection"][name]["wall_s"]) == 2 and min(out["collection"][name]["driver_cpu_s"]) > 0
    assert min(out["collection"]["callbacks_future"]["wall_s"]) >= args.decode_s  # it waited for the rollouts
    profile = out["profile"]  # one more step under cProfile: run_step itself is among the main thread's functions
    assert len(profile["by_own_time"]) == len(profile["by_cumulative_time"]) == 5
    assert any(r["function"].endswith(":run_step") for r in profile["by_cumulative_time"])
    # cProfile ran on the main thread's CPU clock inside the window the main thread's CPU was read over
    assert 0 < profile["profiled_s"] <= profile["main_thread_cpu_s"] <= profile["driver_cpu_s"]
