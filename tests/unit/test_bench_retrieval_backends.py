"""benchmarks/bench_retrieval_backends.py: the proxy pairs and R@1 that choose the CPU retrieval backend."""

from __future__ import annotations

from rapo_ray.retrieval.backends import make_encoder
from tests.helpers import benchmark_module


def test_history_pairs_lead_from_the_question_and_steps_so_far_to_the_next_step():
    bench = benchmark_module("bench_retrieval_backends")
    assert bench.history_next_step("Q?", ["a", "b", "c"]) == [("Q?", "a"), ("Q? a", "b"), ("Q? a b", "c")]
    pairs = bench.multihop_pairs(3)
    assert pairs and all(target and history.startswith("Who is ") for history, target in pairs)


def test_recall_at_1_counts_a_query_whose_best_target_is_its_own():
    bench = benchmark_module("bench_retrieval_backends")
    bm25 = make_encoder("bm25", "", "last", 1300)
    pairs = [("apples cost 3", "3 apples cost 9"), ("pears cost 4", "4 pears cost 8"), ("plums", "nothing shared")]
    # the third query shares no term with any target: its top-1 is the first target, not its own
    assert bench.recall_at_1("bm25", bm25, pairs) == 2 / 3
    # a target that occurs twice is one candidate: either pair finds it
    assert bench.recall_at_1("bm25", bm25, [("figs", "figs 1"), ("figs again", "figs 1")]) == 1.0
