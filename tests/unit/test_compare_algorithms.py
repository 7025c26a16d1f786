"""benchmarks/compare_algorithms.py: its reading of trajectories (the answer-leak flags), its tables, the order it runs
the arms in, and when it reuses a finished run."""

from __future__ import annotations

import argparse
import json

import pytest

from rapo_ray.config import load_config
from rapo_ray.config.load import save_config
from tests.helpers import compare_module


def test_compare_flags_a_reward_earned_with_a_retrieved_answer_after_wrong_own_searches():
    """compare_algorithms.leak_flags on a rollout of the kind the alias comparison found (session 16): the policy
    searched the wrong relation twice, a retrieved block showed the expert's last hop, and it answered from it."""
    compare = compare_module()
    expert = {"neighbor of Dohimi", "sibling of Tupaka", "rival of Pamisi"}
    leaked = (
        "<think>find the partner of Dohimi</think><search>partner of Dohimi</search><result>...</result>"
        "<think>find the partner of Hihive</think><search> partner of Hihive </search><result>...</result>"
        "<think>done</think><answer>\\boxed{Gavefu}</answer>"
    )
    shown = "<retrieve><search>rival of Pamisi</search><result>The rival of Pamisi is Gavefu.</result></retrieve>"
    assert compare.leak_flags(leaked, shown, "Gavefu", expert) == (True, True)
    own = "<search>neighbor of Dohimi</search><result>...</result><search>sibling of Tupaka</search>"
    assert compare.leak_flags(own, shown, "Fuhimi", expert) == (False, False)  # on the path, answer not shown
    assert compare.leak_flags(own, shown, "", expert) == (False, False)  # no answer: nothing shown


class CharTokenizer:
    """One token per character: ``decode`` turns code points back into text."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    @staticmethod
    def decode(ids) -> str:
        return "".join(chr(i) for i in ids)


def row_of(*parts: tuple[str, str], answer: str = "") -> dict:
    """A trajectory row as the run's parquet holds it: response ids and (kind, start, end) segments."""
    ids, segments = [], []
    for kind, text in parts:
        segments.append({"kind": kind, "start": len(ids), "end": len(ids) + len(text)})
        ids += CharTokenizer.encode(text)
    return {"response_ids": ids, "segments": segments, "answer": answer}


def test_next_step_calls_counts_only_tool_calls_that_ran_right_after_a_retrieved_block():
    compare = compare_module()
    row = row_of(
        ("generated", "<think>start</think><python>print(2)</python>"),
        ("tool_result", "<result>2</result>"),
        ("retrieved", "<retrieve><python>print(48/2)</python><result>24.0</result></retrieve>"),
        ("generated", "<think>then</think><python>print(24*3)</python>"),  # a call that ran: counted
        ("tool_result", "<result>72</result>"),
        ("retrieved", "<retrieve><python>print(72+1)</python><result>73</result></retrieve>"),
        ("generated", "<answer>\\boxed{73}</answer>"),  # an answer, not a call
    )
    assert compare.next_step_calls(CharTokenizer, row) == (2, 1)
    # a step that is cut off (no tool result follows) is not a call that ran
    cut = row_of(("retrieved", "<retrieve>x</retrieve>"), ("generated", "<python>print(1"))
    assert compare.next_step_calls(CharTokenizer, cut) == (1, 0)
    texts = compare.segment_texts(CharTokenizer, row)
    assert texts["tool_result"] == "<result>2</result><result>72</result>"
    assert texts["retrieved"].count("<retrieve>") == 2
    # the answer 73 was shown by a retrieved block and none of the rollout's own results: handed
    assert compare.answer_handed("73", texts["retrieved"], texts["tool_result"])
    assert not compare.answer_handed("72", texts["retrieved"], texts["tool_result"])  # its own tool produced it


def test_tables_report_the_retrieved_step_use_pooled_over_seeds():
    """The per-slot-kind use of retrieved steps (#38): step counts summed over seeds, shares as mean ± std."""
    compare = compare_module()

    def run(method, seed, before, after, use):
        return {
            "method": method,
            "seed": seed,
            "before": {"eval/gsm8k/accuracy": before, "eval/mean_accuracy": before},
            "after": {"eval/gsm8k/accuracy": after, "eval/mean_accuracy": after},
            "per_step": {"step_s": 50.0, "retrieve_s": 0.2},
            "rewards": {},
            "retrieved_steps": {"gsm8k": use} if use else {},
        }

    use0 = {"next_steps": 10, "next_step_tool_call": 0.6, "answered": 4, "answer_handed": 0.25}
    use1 = {"next_steps": 30, "next_step_tool_call": 0.8, "answered": 8, "answer_handed": 0.0}
    text = compare.tables(
        [
            run("grpo", 0, 0.03, 0.02, None),
            run("rapo", 0, 0.03, 0.04, use0),
            run("rapo", 1, 0.03, 0.05, use1),
        ]
    )
    assert "| rapo | gsm8k | 40 | 0.700 ± 0.141 | 12 | 0.125 ± 0.177 |" in text
    assert "| rapo | 0.045 ± 0.007 | 0.045 ± 0.007 | 0.015 ± 0.007 |" in text  # accuracy, and its change
    assert "| grpo | gsm8k" not in text  # GRPO never retrieves


def test_tables_pair_each_rapo_variant_with_rapo_and_give_each_step_time_against_grpo():
    """#39's backend arms: a variant is tested against RAPO itself (held-out problems paired per seed), every
    method against GRPO, and the step table says each method's step time as a multiple of GRPO's."""
    compare = compare_module()

    def run(method, seed, step_s, solved):
        problems = {f"arith-{i}": ok for i, ok in enumerate(solved)}
        acc = sum(solved) / len(solved)
        return {
            "method": method,
            "seed": seed,
            "before": {"eval/arith/accuracy": 0.0, "eval/mean_accuracy": 0.0},
            "after": {"eval/arith/accuracy": acc, "eval/mean_accuracy": acc},
            "after_problems": problems,
            "per_step": {"step_s": step_s},
            "rewards": {},
        }

    results = [
        run("grpo", 0, 2.0, [1, 0, 0, 0]),
        run("rapo", 0, 3.0, [1, 1, 0, 0]),
        run("rapo bm25", 0, 2.2, [1, 0, 1, 1]),
    ]
    assert compare.baselines(results) == [("rapo", "grpo"), ("rapo bm25", "grpo"), ("rapo bm25", "rapo")]
    text = compare.tables(results)
    # bm25 against rapo: problems 2 and 3 only bm25 solved, problem 1 only rapo; gain (2 - 1) / 4
    assert "| rapo bm25 | rapo | arith | 4 | 2 | 1 | +0.250 | 1.000 |" in text
    assert "| rapo bm25 | grpo | arith | 4 | 2 | 0 | +0.500 | 0.500 |" in text
    assert "| rapo | 3.00 | 1.50x |" in text and "| rapo bm25 | 2.20 | 1.10x |" in text
    assert "| grpo | grpo |" not in text


def test_tables_give_each_runs_held_out_change_and_the_flips_pooled_over_its_seeds():
    """#62's claim for one recipe: each seed's before -> after with its own sign test, then the seeds' flips pooled:
    6 fixed and 0 broken in all (2^-5 two-sided: 0.03125), where no single seed is significant."""
    compare = compare_module()
    runs = [
        {
            "method": "grpo",
            "seed": seed,
            "before": {"eval/arith/accuracy": 0.5, "eval/mean_accuracy": 0.5},
            "after": {"eval/arith/accuracy": 0.5 + fixed / 10, "eval/mean_accuracy": 0.5 + fixed / 10},
            "paired_change": {"arith": {"n": 10, "fixed": fixed, "broken": 0, "p_value": 0.5**fixed * 2}},
            "per_step": {"step_s": 1.0},
            "rewards": {},
        }
        for seed, fixed in ((1, 2), (0, 1), (2, 3))
    ]
    rows = compare.held_out_change(runs, ["arith"])
    assert rows[3:] == [
        "| grpo | arith | 0 | 0.500 | 0.600 | 1 | 0 | 1 |",
        "| grpo | arith | 1 | 0.500 | 0.700 | 2 | 0 | 0.5 |",
        "| grpo | arith | 2 | 0.500 | 0.800 | 3 | 0 | 0.25 |",
        "| grpo | arith | pooled (3) | | | 6 | 0 | 0.031 |",
    ]
    assert "| grpo | arith | pooled (3) |" in compare.tables(runs)
    # the held-out curve starts at the starting policy, logged at step 0 or (older runs) only in the summary
    evals = [
        {"step": 10, "eval/mean_accuracy": 0.7},
        {"step": 10, "reward": 1.0},
        {"step": 30, "eval/mean_accuracy": 0.8},
    ]
    assert compare.eval_curve(evals, {"eval/mean_accuracy": 0.5}) == [(0, 0.5), (10, 0.7), (30, 0.8)]
    logged = [{"step": 0, "eval/mean_accuracy": 0.5}, *evals]
    assert compare.eval_curve(logged, {"eval/mean_accuracy": 0.5}) == [(0, 0.5), (10, 0.7), (30, 0.8)]


def test_a_finished_run_is_reused_only_for_the_config_it_was_run_with(tmp_path):
    """A finished run of an arm is reused by a later comparison only when its saved config is what the arm asks for
    today: after a default changed (the retrieval backend, #39), an old run under the same name is named, not mixed
    in. Where runs go, checkpointing and the resources a launch fits to the machine may differ."""
    compare = compare_module()
    save_config(load_config(overrides=["retrieval.embedder=minilm", "run.name=a"]), tmp_path / "config.yaml")
    same = ["retrieval.embedder=minilm", "run.name=b", "checkpoint.every=0", "resources.cpus_per_learner=0.5"]
    assert compare.config_change(tmp_path, None, same) == ""
    change = compare.config_change(tmp_path, None, ["retrieval.embedder=bm25", "trainer.seed=3"])
    assert change == "retrieval.embedder: 'minilm' -> 'bm25', trainer.seed: 0 -> 3"
    (tmp_path / "config.yaml").write_text("algo: {no_such_knob: 1}\n")  # a run from a schema that no longer loads
    assert compare.config_change(tmp_path, None, []).startswith("its config.yaml does not load today: ")


def test_each_seed_runs_the_arms_in_a_rotated_order():
    compare = compare_module()
    arms = ["grpo", "rapo", "rapo bm25"]
    assert [compare.run_order(arms, t) for t in range(4)] == [
        ["grpo", "rapo", "rapo bm25"],
        ["rapo", "rapo bm25", "grpo"],
        ["rapo bm25", "grpo", "rapo"],
        ["grpo", "rapo", "rapo bm25"],
    ]


def test_a_step_is_divided_by_the_probe_rounds_that_started_within_it():
    """speed_normalized by hand: step 1 (t 100-104) holds rounds at 101 and 103, step 2 (t 105-111) holds none and
    takes the round nearest its middle (108: the one at 111.5); steps without an end time are left out."""
    compare = compare_module()
    steps = [{"step_s": 4.0, "time": 104.0}, {"step_s": 6.0, "time": 111.0}, {"step_s": 9.0}]
    rounds = [
        {"wall": 101.0, "python_s": 0.01, "matmul_s": 0.02},
        {"wall": 103.0, "python_s": 0.03, "matmul_s": 0.02},
        {"wall": 111.5, "python_s": 0.04, "matmul_s": 0.05},
    ]
    # step 1: 4 / 0.02 = 200 (both probes); step 2: the round at 111.5 -> 6 / 0.04 = 150 and 6 / 0.05 = 120
    assert compare.speed_normalized(steps, rounds) == {"python_s": 175.0, "matmul_s": 160.0}
    assert compare.speed_normalized(steps, []) == {}
    assert compare.speed_normalized([{"step_s": 1.0}], rounds) == {}  # a run from before steps had a time


def test_the_probe_table_gives_each_step_in_probe_units_beside_the_raw_step_and_their_ratios_to_grpo():
    """RAPO's raw step is 1.5x GRPO's while its probe time was 1.5x too: in probe units the two read the same. Runs
    without probe rounds are left out, and without any the table is empty."""
    compare = compare_module()

    def run(method, seed, step_s, python, matmul):
        return {
            "method": method,
            "seed": seed,
            "per_step": {"step_s": step_s},
            "per_step_in_probes": {"python_s": python, "matmul_s": matmul},
        }

    results = [run("grpo", 0, 2.0, 100.0, 50.0), run("rapo", 0, 3.0, 100.0, 50.0), {"method": "rapo", "seed": 1}]
    text = "\n".join(compare.probe_table(results))
    assert "| grpo | 1 | 2.00 | 1.00x | 100.00 | 1.00x | 50.00 | 1.00x |" in text
    assert "| rapo | 1 | 3.00 | 1.50x | 100.00 | 1.00x | 50.00 | 1.00x |" in text  # the run without a probe left out
    assert compare.probe_table([{"method": "grpo", "seed": 0, "per_step": {"step_s": 1.0}}]) == []


def test_an_earlier_report_joins_only_for_the_same_experiment(tmp_path):
    """--include-report: the earlier report's runs that this one lacks join it; another config or budget is refused
    with the difference named, and a file that is not a report is named too."""
    compare = compare_module()
    args = argparse.Namespace(config="c.yaml", steps=None, prompts=None, eval_size=None, overrides=[])
    earlier = {
        "config": "c.yaml",
        "steps": None,
        "prompts_per_step": None,
        "eval_size": None,
        "overrides": [],
        "runs": [{"method": "rapo", "seed": 0, "x": "old"}, {"method": "rapo", "seed": 2, "x": "old"}],
    }
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    joined = compare.included_runs([str(path)], args, [{"method": "rapo", "seed": 2, "x": "new"}])
    assert joined == [{"method": "rapo", "seed": 0, "x": "old"}]  # seed 2 was run here: this run's wins
    path.write_text(json.dumps(earlier | {"steps": 30}))
    with pytest.raises(SystemExit, match="another experiment .*'steps': 30"):
        compare.included_runs([str(path)], args, [])
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a compare_algorithms report"):
        compare.included_runs([str(path)], args, [])
