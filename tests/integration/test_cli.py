"""The command line as a user runs it (no Ray): --help, bad overrides and a bad resume fail before any work, the
paper recipes resolve with --dry-run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from rapo_ray.config import Config, save_config
from tests.helpers import write_checkpoint


def _run_folder(tmp_path, cfg: Config):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    save_config(cfg, run / "config.yaml")
    return run


REPO = Path(__file__).resolve().parents[2]


def test_a_bad_resume_fails_in_one_line_before_any_process_starts(tmp_path, capsys):
    import ray

    from rapo_ray.launch.cli import train_main

    args = [f"run.output_dir={tmp_path / 'runs'}", f"run.artifacts_dir={tmp_path / 'art'}"]
    run = _run_folder(tmp_path, Config())
    broken = write_checkpoint(run / "checkpoints", 3)
    (broken / "optimizer.pt").write_bytes(b"")
    before = sorted(p.name for p in run.rglob("*"))
    cases = [
        (args + [f"checkpoint.resume={run}"], [str(broken), "optimizer.pt is 0 bytes"]),
        (args + [f"checkpoint.resume={run}", "algo.clip_high=0.5"], [str(run), "config differs in ['algo.clip_high']"]),
        (args + [f"checkpoint.resume={tmp_path / 'nowhere'}"], ["nowhere", "not a run directory"]),
    ]
    for argv, expected in cases:
        t0 = time.monotonic()
        assert train_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        assert all(e in err for e in expected), err
        assert time.monotonic() - t0 < 20  # no Ray, no warm start, no actors: the check is all that ran
        assert not ray.is_initialized()
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing written into the run being resumed


def test_train_help_prints_fields():
    out = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "train.py"), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "algo.rapo.retrieve_prob" in out.stdout and "Probability of retrieving" in out.stdout


def test_train_rejects_bad_override_before_work():
    out = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "train.py"), "algo.nme=grpo"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert "unknown config key 'algo.nme'" in out.stderr


@pytest.mark.parametrize("recipe, size", [("paper_qwen2.5_3b.yaml", "3B"), ("paper_qwen2.5_7b.yaml", "7B")])
def test_paper_recipes_resolve_and_print_the_resource_plan(recipe, size):
    out = subprocess.run(
        [sys.executable, "jobs/train.py", "--config", f"configs/{recipe}", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"Qwen2.5-{size}-Instruct" in text and "G=16, N_hybrid=8" in text and "m=0.05, a=0.2" in text
    assert "32 prompts x 16 rollouts" in text and "PPO mini-batch 16" in text and "lr 1e-06" in text
    assert "4 x (4 CPU, 1 GPU) in one placement group" in text and "x (4 CPU, 0.9 GPU), engine vllm" in text
    assert "replicas (0.1 GPU each)" in text and "total at start:  32 CPU, 7.7 GPU; at most 32 CPU, 7.8 GPU" in text
    assert text.count("\n  eval: ") == 8 and "toolstar/train_10k.parquet" in text


def test_dry_run_rejects_bad_config():
    out = subprocess.run(
        [sys.executable, "jobs/train.py", "--dry-run", "algo.rapo.n_hybrid=99"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "algo.rapo.n_hybrid (99) must be in [0, algo.group_size=16]" in out.stderr
