"""The chaos benchmark's small version: one short job with four faults, replayed against an uninterrupted run.

The benchmark is one subprocess of about 3 minutes of both cores, so it starts with the session (``starts_early``,
tests/background.py) and runs beside the unit half; this test, right after that half, waits for it and checks its
report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def quick_chaos_command(fixture, work: Path) -> list:
    """``benchmarks/chaos.py --quick`` on the trainer tests' warm start and buffer (built by this run if it is first)."""
    return [
        *(sys.executable, REPO / "benchmarks" / "chaos.py", "--quick", "--work", work, "--out", work / "chaos.json"),
        *("--artifacts", fixture("tiny_warm_artifacts")),
    ]


@pytest.mark.starts_early(command=quick_chaos_command)
def test_quick_chaos_run_survives_every_fault_and_replays_exactly(early_starts, request):
    done = early_starts.wait(request.node.nodeid, timeout_s=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((done.work / "chaos.json").read_text())
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
