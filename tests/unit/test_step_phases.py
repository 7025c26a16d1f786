"""benchmarks/step_phases.py: phase medians, the engine's tokens/s and the k=1 projection, against hand-computed
values on written metrics; a run without steps, and a --skip that leaves none, are named errors."""

from __future__ import annotations

import json

import pytest

from benchmarks.step_phases import main, phases, read_steps, staleness_of


def step(n, rollout, old, update, *, skipped=0, tokens=100, generate=1.0, **extra):
    return {
        "step": n,
        "reward": 0.5,
        "rollout_s": rollout,
        "old_logprob_s": old,
        "update_s": update,
        "sync_s": 0.5,
        "step_s": rollout + old + update + 0.5,
        "generated_tokens": tokens,
        "generate_s": generate,
        "update/old_pass_skipped": skipped,
        "trajectories": 16,
        **extra,
    }


def write_run(path, steps, max_staleness=0):
    path.mkdir()
    rows = [{"step": 0, "eval/arith/accuracy": 0.5}, *steps]  # the held-out row has no reward: not a step
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (path / "config.yaml").write_text(f"algo:\n  name: grpo\n  max_staleness: {max_staleness}\n")
    return path


def test_medians_after_the_warm_up_and_the_overlap_projection(tmp_path):
    run = write_run(
        tmp_path / "k0",
        [
            step(1, 50.0, 50.0, 50.0, tokens=10),  # warm-up: left out by skip=1
            step(2, 8.0, 6.0, 20.0, tokens=200, generate=2.0, rollout_cpu_s=7.0),
            step(3, 10.0, 8.0, 24.0, tokens=300, generate=2.0, rollout_cpu_s=9.0),
            step(4, 12.0, 7.0, 22.0, tokens=400, generate=2.0, rollout_cpu_s=8.0),
        ],
    )
    r = phases(read_steps(run), skip=1, max_staleness=staleness_of(run))
    assert r["steps"] == 3 and r["max_staleness"] == 0
    assert r["wall"]["rollout_s"] == 10.0 and r["wall"]["old_logprob_s"] == 7.0 and r["wall"]["update_s"] == 22.0
    assert r["wall"]["step_s"] == 41.5  # steps 34.5, 42.5, 41.5: each key's own median, not one step's phases
    assert r["cpu"] == {"rollout_cpu_s": 8.0}
    assert r["engine_tokens_per_s"] == 150.0  # 100, 150, 200 tokens/s
    # max(rollout 10, old pass 7 + update 22) + sync 0.5
    assert r["projected_k1_step_s"] == pytest.approx(29.5)


def test_a_skipped_pass_projects_without_it_and_a_run_already_ahead_not_at_all(tmp_path):
    skipped = write_run(tmp_path / "skip", [step(1, 8.0, 0.1, 20.0, skipped=1), step(2, 8.0, 0.1, 20.0, skipped=1)])
    ahead = write_run(tmp_path / "k1", [step(1, 8.0, 6.0, 20.0), step(2, 8.0, 6.0, 20.0)], max_staleness=1)
    r_skip = phases(read_steps(skipped), 1, staleness_of(skipped))
    r_ahead = phases(read_steps(ahead), 1, staleness_of(ahead))
    # rolled out ahead, the pass stays skipped: max(rollout 8, 0.1 + update 20) + sync 0.5
    assert r_skip["old_pass_skipped"] and r_skip["projected_k1_step_s"] == pytest.approx(20.6)
    assert r_ahead["max_staleness"] == 1 and "projected_k1_step_s" not in r_ahead


def test_bad_runs_and_skips_are_named(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="metrics.jsonl: cannot read the run.s metrics log"):
        read_steps(empty)
    only_eval = write_run(tmp_path / "eval-only", [])
    with pytest.raises(SystemExit, match="no training steps"):
        read_steps(only_eval)
    run = write_run(tmp_path / "two", [step(1, 8.0, 6.0, 20.0), step(2, 8.0, 6.0, 20.0)])
    with pytest.raises(SystemExit, match="--skip 2: the run has 2 steps"):
        main([str(run), "--skip", "2"])
    out = tmp_path / "report.json"
    assert main([str(run), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["runs"][str(run)]["projected_k1_step_s"] == pytest.approx(26.5)
    assert "| 0 | 1 |" in capsys.readouterr().out
