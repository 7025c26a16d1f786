"""Job entry points on a local Ray: jobs/evaluate.py scores a checkpoint per dataset, a killed driver takes its
Ray with it, benchmarks/compare_algorithms.py pairs problems under one seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rapo_ray.config import TINY_OVERRIDES
from tests.helpers import compare_module

REPO = Path(__file__).resolve().parents[2]


def test_evaluate_checkpoint_on_bundled_and_a_data_file(ray_session, tiny_cfg, tiny_model_dir, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("evaluate_job", REPO / "jobs" / "evaluate.py")
    evaluate_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate_job)

    data = tmp_path / "mini.jsonl"
    data.write_text(
        "\n".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) for i in range(3)) + "\n"
    )
    overrides = [
        f"run.artifacts_dir={tiny_cfg.run.artifacts_dir}",
        *TINY_OVERRIDES,
        "rollout.max_response_tokens=64",
        "rollout.max_step_tokens=32",
        "rollout.engine=torch",
        "rollout.num_workers=1",
    ]
    out = tmp_path / "eval.json"
    rc = evaluate_job.main(
        ["--checkpoint", str(tiny_model_dir), "--datasets", f"bundled,{data}", "--limit", "4", "--out", str(out)]
        + overrides
    )
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"arith", "multihop", "mini"}
    assert res["arith"]["n"] == 4 and res["mini"]["n"] == 3
    for r in res.values():
        assert 0.0 <= r["accuracy"] <= r["f1"] + 1e-9 <= 1.0 + 1e-9 and 0.0 <= r["format_valid"] <= 1.0
    # the same checkpoint again against the first run (--baseline): greedy, so nothing flips; per-problem results kept
    again = tmp_path / "again.json"
    args = ["--checkpoint", str(tiny_model_dir), "--datasets", str(data), "--limit", "4", "--out", str(again)]
    assert evaluate_job.main([*args, "--baseline", str(out)] + overrides) == 0
    saved = json.loads(again.read_text())
    assert len(saved["problems"]["mini"]) == 3
    assert saved["paired_change"]["mini"] == {"n": 3, "fixed": 0, "broken": 0, "gain": 0.0, "p_value": 1.0}
    (tmp_path / "bad.json").write_text("{}")
    assert evaluate_job.main([*args, "--baseline", str(tmp_path / "bad.json")] + overrides) == 2
    with pytest.raises(SystemExit, match="is not 'bundled', a file, or a folder"):
        evaluate_job.main(["--checkpoint", str(tiny_model_dir), "--datasets", "nope.jsonl"] + overrides)
    assert evaluate_job.main(["--checkpoint", str(tmp_path / "missing")] + overrides) == 2


def test_a_killed_driver_takes_its_local_ray_with_it(tmp_path):
    """Issue #22: after a driver SIGKILL the local Ray's dashboard and runtime-env agents outlived it (30 s+).
    ``init_ray`` now starts ``rapo_ray/launch/ray_reaper.py`` beside the Ray it starts; killing the driver ends every
    process of that Ray session within the reaper's grace and SIGTERM wait."""
    import os
    import signal
    import time

    from rapo_ray.launch.ray_reaper import GRACE_S, TERM_WAIT_S, session_processes

    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, ray\n"
            "from rapo_ray.config import Config\n"
            "from rapo_ray.launch.launcher import init_ray\n"
            "init_ray(Config())\n"
            "print(ray._private.worker._global_node.get_session_dir_path(), flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
    )
    try:
        session = driver.stdout.readline().strip()
        assert session and session_processes(session), session  # a Ray of its own is running
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + GRACE_S + TERM_WAIT_S + 10
    while session_processes(session) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not session_processes(session), [
        Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in session_processes(session)
    ]


def test_compare_pairs_each_held_out_problem_with_itself_under_the_same_seed():
    """benchmarks/compare_algorithms.py's method-vs-method sign test, by hand: seeds 0 and 1 ran both methods
    (seed 2 only one, so it is left out); rapo solved 2 alias problems grpo did not and none the other way."""
    compare = compare_module()
    results = [
        {"method": "grpo", "seed": 0, "after_problems": {"alias-a": False, "alias-b": True, "multihop-a": True}},
        {"method": "rapo", "seed": 0, "after_problems": {"alias-a": True, "alias-b": True, "multihop-a": False}},
        {"method": "grpo", "seed": 1, "after_problems": {"alias-a": False, "alias-b": False}},
        {"method": "rapo", "seed": 1, "after_problems": {"alias-a": True, "alias-b": False}},
        {"method": "rapo", "seed": 2, "after_problems": {"alias-a": True}},
    ]
    alias = compare.paired_vs(results, "rapo", "grpo", "alias")
    assert alias["seeds"] == [0, 1] and alias["n"] == 4
    assert (alias["fixed"], alias["broken"], alias["gain"], alias["p_value"]) == (2, 0, 0.5, 0.5)
    multihop = compare.paired_vs(results, "rapo", "grpo", "multihop")
    assert (multihop["n"], multihop["fixed"], multihop["broken"]) == (1, 0, 1)
    assert compare.paired_vs(results, "arpo", "grpo", "alias") is None
