"""Multi-node simulations on this box: a fake autoscaler, a rollout node lost mid-step, a learner node lost."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> str:
    """One bundled tiny model for the three scenarios (each built its own before: ~4 s of a core apiece)."""
    return str(tmp_path_factory.mktemp("cluster_sim"))


def _sim(scenario: str, artifacts: str, timeout_s: int = 400) -> dict:
    cmd = [sys.executable, str(REPO / "benchmarks" / "cluster_sim.py"), scenario, "--timeout", "120"]
    proc = subprocess.run(
        [*cmd, "--artifacts", artifacts],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith('{"scenario"')]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


def test_fleet_autoscaling_adds_and_removes_fake_nodes(artifacts):
    r = _sim("autoscale", artifacts)
    assert r["nodes_at_start"] == 1 and r["nodes_with_1_worker"] == 2  # the first worker needed a node
    assert r["workers_after_scale_up"] == 3 and r["nodes_after_scale_up"] == 4  # backlog 6 groups / 2 per worker
    assert r["groups_done"] == 6
    assert r["workers_after_scale_down"] == 1 and r["nodes_after_scale_down"] == 2  # idle nodes were removed


def test_rollout_node_loss_mid_step_loses_no_group(artifacts):
    r = _sim("node-loss", artifacts)
    assert r["requeued_groups"] == r["killed_worker_groups"] > 0 and r["replaced_workers"] == 1
    assert r["groups_done"] == r["groups"] and r["rows"] == r["rows_expected"] and r["each_group_once"]
    assert r["workers_after"] == 2


def test_learner_node_loss_resumes_from_checkpoint(artifacts):
    r = _sim("learner-loss", artifacts)
    assert r["learner_failures"] == 1 and r["steps"] == 8
    assert r["logged_steps"][-1] == 8 and set(range(1, 9)) <= set(r["logged_steps"])
    # the node dies once step 2's checkpoint is complete; a quick step 3 may finish first (its checkpoint too), so
    # the run resumes from step 2 or a later complete checkpoint, never from before the one it had
    resumed = [int(m.group(1)) for l in r["log"] if (m := re.search(r"resumed at step (\d+) from .*step-", l))]
    assert len(resumed) == 1 and 2 <= resumed[0] < 8, r["log"]
    assert any(l.startswith("rebuilt the learners (the fleet kept)") for l in r["log"]), r["log"]  # only they restart
