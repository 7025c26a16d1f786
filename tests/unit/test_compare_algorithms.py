"""benchmarks/compare_algorithms.py's reading of trajectories: the answer-leak flags."""

from __future__ import annotations

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
