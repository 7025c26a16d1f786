"""benchmarks/multihop_chain.py: the first place a multihop trajectory leaves its chain, on hand-written ones."""

from __future__ import annotations

import pytest

from rapo_ray.types.trajectory import GENERATED, RETRIEVED, TOOL_RESULT
from tests.helpers import benchmark_module

Q = "Who is the rival of the sibling of the neighbor of Ramiga?"  # neighbor, then sibling, then rival
R1 = "<result>The neighbor of Ramiga is Repave.\nThe mentor of Ramiga is Higado.</result>"
R2 = "<result>The sibling of Repave is Nesido.\nThe mentor of Repave is Revene.</result>"
R3 = "<result>The rival of Nesido is Logapa.</result>"


def step(query: str) -> tuple[str, str]:
    return GENERATED, f"<think>find it</think><search>{query}</search>"


CHAIN = [  # every hop searched as planned, each with its result
    step("neighbor of Ramiga"),
    (TOOL_RESULT, R1),
    step("sibling of Repave"),
    (TOOL_RESULT, R2),
    step("rival of Nesido"),
    (TOOL_RESULT, R3),
]
ANSWER = (GENERATED, "<think>done</think><answer>\\boxed{Logapa}</answer>")


@pytest.mark.parametrize(
    ("segments", "correct", "expected"),
    [
        (
            [*CHAIN, ANSWER],
            True,
            "correct",
        ),
        (
            [*CHAIN, ANSWER],
            False,
            "right chain, wrong answer",
        ),
        ([step("partner of Ramiga")], False, "hop 1: wrong relation"),
        ([step("neighbor of Ramiga"), (TOOL_RESULT, R1), step("sibling of Higado")], False, "hop 2: stale entity"),
        ([step("neighbor of Ramiga"), (TOOL_RESULT, R1), step("sibling of Dozove")], False, "hop 2: off-chain entity"),
        # a name that only a retrieved block showed is context the trajectory holds: stale, not off-chain
        (
            [
                step("neighbor of Ramiga"),
                (TOOL_RESULT, R1),
                (RETRIEVED, "<retrieve>" + R2 + "</retrieve>"),
                step("rival of Nesido"),
            ],
            False,
            "hop 2: stale entity",
        ),
        ([step("neighbor of Ramiga"), (TOOL_RESULT, R1), ANSWER], False, "answered after hop 1"),
        ([step("the neighbor")], False, "hop 1: malformed"),
        (
            [*CHAIN, step("rival of Logapa")],
            False,
            "extra search",
        ),
        ([step("neighbor of Ramiga"), (TOOL_RESULT, R1)], False, "no answer"),
    ],
)
def test_first_deviation_by_hand(segments, correct, expected):
    assert benchmark_module("multihop_chain").first_deviation(Q, segments, correct) == expected


def test_arms_pool_seeds_and_other_questions_are_refused():
    chain = benchmark_module("multihop_chain")
    assert chain.arm_of("rapo_handed-unpaid-s2") == "rapo_handed-unpaid" and chain.arm_of("before") == "before"
    with pytest.raises(ValueError, match="not a multihop question"):
        chain.first_deviation("What is 3 + 4?", [], False)
