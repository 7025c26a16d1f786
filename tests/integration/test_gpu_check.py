"""benchmarks/gpu_check.py as a user runs it: every check on the CPU here, the GPU path where CUDA is present."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_its_checks_on_the_cpu(tmp_path):
    """The acceptance command end to end where there is no GPU: every check but vLLM's runs and passes."""
    report = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_check.py",
            "--device",
            "cpu",
            "--quick",
            "--artifacts",
            str(tmp_path / "models"),
            "--out",
            str(report),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(report.read_text())["checks"]
    status = {name: c["status"] for name, c in checks.items()}
    assert status.pop("vllm: greedy and weight load") == "SKIP"
    assert set(status.values()) == {"PASS"}, status
    assert checks["engine: greedy, seeded sampling, logprobs"]["greedy_equals_generate"] == "3/3"
    assert checks["learner: one bf16 mixed-precision update"]["weights_changed_frac"] > 0.9
    colocated = checks["colocated: learner -> engine by shared memory"]  # another process read every tensor
    assert (
        colocated["kind"] == "shm"
        and colocated["tensors_equal"].split("/")[0] == colocated["tensors_equal"].split("/")[1]
    )
    assert "GPU check on" in proc.stdout and "report:" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_check_on_cuda(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--device", "cuda", "--size", "bundled", "--quick"]
        + ["--artifacts", str(tmp_path / "models"), "--out", str(tmp_path / "gpu.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
