"""The chaos benchmark's small version: one short job with four faults, replayed against an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_chaos_run_survives_every_fault_and_replays_exactly(tmp_path, tiny_warm_artifacts):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "chaos.py"), "--quick", "--work", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(
        [*cmd, "--artifacts", str(tiny_warm_artifacts)],  # the trainer tests' warm start and buffer
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    faults = report["faults"]
    assert sorted(f["kind"] for f in faults) == ["driver", "learner", "retrieval_replica", "rollout_worker"]
    assert all(f["injected"] and f["survived"] for f in faults), faults
    (run,) = report["runs"]
    assert run["attempts"] == 2  # the driver's SIGKILL, then checkpoint.resume
    assert run["lost_groups"] == 0 and run["duplicated_groups"] == 0
    assert run["leftover_processes"] == [] and report["reference"]["leftover_processes"] == []
    # every step before a degraded slot equals the uninterrupted run's; with none degraded, the final weights too
    assert run["replayed_exactly"]
    assert run["weights_equal"] or run["degraded"]
