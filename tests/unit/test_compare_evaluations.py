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


def test_a_run_folders_flat_evaluation_files_pair_as_one_held_out_set(tmp_path):
    """eval_before.json / eval_after.json of two runs (a flat problem map each): 2 fixed by k1 only, 1 by k0 only."""

    def run_eval(name, solved):
        path = tmp_path / name
        path.write_text(json.dumps({"eval/arith/accuracy": 0.0, "problems": solved}))
        return path

    ids = [f"arith-test-{i}" for i in range(4)]
    before = run_eval("before.json", dict(zip(ids, [False, False, False, True])))
    k0 = run_eval("k0.json", dict(zip(ids, [True, False, False, True])))
    k1 = run_eval("k1.json", dict(zip(ids, [False, True, True, True])))
    out = tmp_path / "report.json"
    assert main(["--start", str(before), "--reference", "k0", f"k0:0={k0}", f"k1:0={k1}", "--out", str(out)]) == 0
    held_out = json.loads(out.read_text())["report"]["held-out"]
    assert held_out["n"] == 4 and held_out["start_accuracy"] == 0.25
    k1_vs_k0 = held_out["against_reference"]["k1"]  # "fixed": k1 right where k0 was wrong
    assert (k1_vs_k0["fixed"], k1_vs_k0["broken"], k1_vs_k0["n"]) == (2, 1, 4)
    mixed = run_eval("mixed.json", {"arith-test-0": True, "gsm8k": {"gsm8k-0": True}})
    with pytest.raises(SystemExit, match="mixes data sets and single problems"):
        main(["--start", str(before), f"k0:0={mixed}"])


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit, match="expected ARM:SEED=FILE"):
        parse_run("grpo=eval.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    good = write(tmp_path / "good.json", {"gsm8k-0": True})
    with pytest.raises(SystemExit, match="bad.json: not a jobs/evaluate.py or run evaluation JSON"):
        main(["--start", str(bad), f"grpo:0={good}"])
    with pytest.raises(SystemExit, match="grpo:0 is given twice"):
        main(["--start", str(good), f"grpo:0={good}", f"grpo:0={good}"])
    with pytest.raises(SystemExit, match="--reference 'rloo': no run of that arm"):
        main(["--start", str(good), "--reference", "rloo", f"grpo:0={good}"])
