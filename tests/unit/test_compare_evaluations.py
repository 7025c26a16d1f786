"""benchmarks/compare_evaluations.py: per-run and pooled sign tests against the start and a reference arm, checked
against hand-counted flips; bad arguments name themselves."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.compare_evaluations import main, parse_run


def write(path, solved: dict[str, bool]):
    path.write_text(json.dumps({"checkpoint": "x", "problems": {"gsm8k": solved}}))
    return path


def test_flips_against_the_start_and_the_reference_pooled_over_seeds(tmp_path, capsys):
    ids = [f"gsm8k-{i}" for i in range(4)]
    start = write(tmp_path / "start.json", dict(zip(ids, [False, False, True, True])))
    # grpo seed 0 fixes 0 and 1, breaks 2; seed 1 fixes 0; rapo seed 0 fixes nothing, breaks 3; seed 1 fixes 1
    files = {
        "grpo:0": [True, True, False, True],
        "grpo:1": [True, False, True, True],
        "rapo:0": [False, False, True, False],
        "rapo:1": [False, True, True, True],
    }
    runs = [f"{k}={write(tmp_path / (k.replace(':', '-') + '.json'), dict(zip(ids, v)))}" for k, v in files.items()]
    out = tmp_path / "report.json"
    assert main(["--start", str(start), "--reference", "grpo", "--out", str(out), *runs]) == 0
    report = json.loads(out.read_text())["report"]["gsm8k"]
    assert report["start_accuracy"] == 0.5 and report["n"] == 4
    by_run = {(r["arm"], r["seed"]): (r["accuracy"], r["fixed"], r["broken"]) for r in report["runs"]}
    assert by_run == {
        ("grpo", 0): (0.75, 2, 1),
        ("grpo", 1): (0.75, 1, 0),
        ("rapo", 0): (0.25, 0, 1),
        ("rapo", 1): (0.75, 1, 0),
    }
    grpo = report["arms"]["grpo"]
    assert (grpo["fixed"], grpo["broken"]) == (3, 1)
    assert grpo["p_value"] == pytest.approx(2 * (1 + 4) / 16)  # two-sided exact sign test, 3 vs 1 of 4 flips
    assert report["arms"]["rapo"]["accuracy_mean"] == pytest.approx(0.5)
    assert report["arms"]["rapo"]["accuracy_sd"] == pytest.approx(math.sqrt(0.125))
    # rapo against grpo, pairs (seed, problem): seed 0: grpo alone solves 0, 1, 3, rapo alone 2; seed 1: grpo
    # alone solves 0, rapo alone 1 -> 2 only-rapo / 4 only-grpo of 8 pairs
    against = report["against_reference"]["rapo"]
    assert (against["fixed"], against["broken"], against["n"], against["seeds"]) == (2, 4, 8, [0, 1])
    assert against["p_value"] == pytest.approx(2 * (1 + 6 + 15) / 64)
    assert "rapo against grpo, seeds [0, 1]: 2 only rapo / 4 only grpo of 8 pairs" in capsys.readouterr().out


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit, match="expected ARM:SEED=FILE"):
        parse_run("grpo=eval.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    good = write(tmp_path / "good.json", {"gsm8k-0": True})
    with pytest.raises(SystemExit, match="bad.json: not a jobs/evaluate.py JSON"):
        main(["--start", str(bad), f"grpo:0={good}"])
    with pytest.raises(SystemExit, match="grpo:0 is given twice"):
        main(["--start", str(good), f"grpo:0={good}", f"grpo:0={good}"])
    with pytest.raises(SystemExit, match="--reference 'rloo': no run of that arm"):
        main(["--start", str(good), "--reference", "rloo", f"grpo:0={good}"])
