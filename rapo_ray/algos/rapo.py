"""RAPO: hybrid-policy rollout (spec Algorithm 1), retrieval reward (Eq. 5-7), retrieval advantage (Eq. 9),
combined advantage (Eq. 10), retrieval importance shaping (Eq. 8) and on-policy buffer growth. Equation
numbers refer to ``shared/RAPO_SPEC.md`` section 3.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from rapo_ray.algos.advantages import EPS, group_zscore
from rapo_ray.algos.rollout import RolloutPolicy
from rapo_ray.core.options import option
from rapo_ray.types.trajectory import HYBRID, ON_POLICY, Trajectory


@dataclass
class RapoConfig:
    """RAPO's section, ``algo.rapo``: hybrid rollout, retrieval reward, importance shaping and their ablations."""

    n_hybrid: int = option(8, "Hybrid slots per group N_hybrid (paper: 8). The first G - N_hybrid slots are on-policy.")
    retrieve_prob: float = option(
        0.5, "Probability of retrieving before each step after the first in a hybrid slot (Eq. 4)."
    )
    shaping_weight: float = option(0.05, "m in Eq. 8 (importance shaping).")
    advantage_weight: float = option(0.2, "a in Eq. 10 (retrieval advantage weight).")
    clamp_rapo_factor: bool = option(False, "Clamp (1 + a A_ret) at 0.")
    use_retrieval_reward: bool = option(True, "Ablation: False is 'w/o RR' (A_RAPO = A_acc).")
    use_importance_shaping: bool = option(True, "Ablation: False is 'w/o RIS' (shaping factor 1).")
    use_quality_term: bool = option(True, "Ablation: False is 'w/o RQ' (no g term).")
    use_timing_term: bool = option(True, "Ablation: False is 'w/o RT' (no H_before term).")
    invert_delta: bool = option(False, "Table 3 variant: reward entropy increase.")
    invert_timing: bool = option(False, "Table 3 variant: reward retrieving at low entropy.")
    reward_retrieved_answers: bool = option(
        True,
        "False (not in the paper): a hybrid rollout whose answer occurs in a retrieved step and in none of its own "
        "tool results earns reward 0 instead of its score, since the expert found that answer, not the policy. "
        "(docs/RESULTS.md, Algorithms: the answer leak).",
    )


class HybridRollout(RolloutPolicy):
    """Hybrid-policy rollout: the last ``n_hybrid`` slots of a group are hybrid. Before each policy step after
    its first, a hybrid slot splices a retrieved step with probability ``retrieve_prob``.

    ``reward_retrieved_answers=False`` zeroes the reward of a rollout whose answer was handed to it by a
    retrieved step (``Trajectory.answer_retrieved``), so the policy is not paid for what the expert found.
    """

    def __init__(self, n_hybrid: int, retrieve_prob: float, reward_retrieved_answers: bool = True):
        self.hybrid_slots = n_hybrid
        self.retrieve_prob = retrieve_prob
        self.reward_retrieved_answers = reward_retrieved_answers

    def initial_slots(self, group_size: int) -> list[str]:
        n = min(self.hybrid_slots, group_size)
        return [ON_POLICY] * (group_size - n) + [HYBRID] * n

    def wants_retrieval(self, t: Trajectory, rng: random.Random) -> bool:
        # Never before the first policy step; the draw happens only for hybrid slots that could retrieve.
        return t.slot_kind == HYBRID and t.num_generated_steps > 0 and rng.random() < self.retrieve_prob

    def settle_reward(self, t: Trajectory) -> None:
        if t.answer_retrieved and not self.reward_retrieved_answers:
            t.reward = 0.0


def buffer_candidates(trajs: Iterable[Trajectory], min_reward: float) -> list[Trajectory]:
    """RAPO's optional buffer growth: the trajectories whose steps may join the step buffer. Only on-policy
    rollouts that never retrieved and scored at least ``min_reward``, so the buffer never learns from itself."""
    return [t for t in trajs if t.slot_kind != HYBRID and not t.num_retrievals and t.reward >= min_reward]


@dataclass(frozen=True)
class RetrievalRewardSwitches:
    """The paper's ablations of the retrieval reward (Fig. 7, Table 3).

    use_quality: keep the g term (Eq. 6); False is "w/o RQ", Z = H_before.
    use_timing: keep the H_before term (Eq. 7); False is "w/o RT", Z = g.
    invert_delta: Table 3's "up-Delta-H" variants, H_delta <- -H_delta (reward an entropy increase).
    invert_timing: Table 3's "H^Low" variants, H_before <- 1 / H_before (reward retrieving at low entropy).
    """

    use_quality: bool = True
    use_timing: bool = True
    invert_delta: bool = False
    invert_timing: bool = False


def retrieval_reward_single(
    h_before: float,
    h_after: float,
    switches: RetrievalRewardSwitches = RetrievalRewardSwitches(),
    eps: float = EPS,
) -> float:
    """Reward of one retrieval.

    H_delta = -(H_after - H_before) / H_before          (Eq. 5, division guarded by eps)
    g       = tanh(2 * H_delta)                          (Eq. 6)
    Z       = g * H_before                               (Eq. 7)

    Args:
        h_before: mean entropy of the policy step just before the retrieval (H_{t-1}).
        h_after: mean entropy of the policy step just after it (H_{t+1}).
    """
    h_delta = -(h_after - h_before) / max(h_before, eps)
    if switches.invert_delta:
        h_delta = -h_delta
    quality = math.tanh(2.0 * h_delta) if switches.use_quality else 1.0
    timing = h_before
    if switches.invert_timing:
        timing = 1.0 / max(h_before, eps)
    if not switches.use_timing:
        timing = 1.0
    return quality * timing


def trajectory_retrieval_reward(
    step_entropy: Sequence[float],
    retrievals: Sequence[tuple[int, int | None]],
    switches: RetrievalRewardSwitches = RetrievalRewardSwitches(),
    eps: float = EPS,
) -> float:
    """Z_ret of one trajectory: the mean of Eq. 7 over its retrievals.

    Args:
        step_entropy: mean entropy of each generated step, indexed by generated-step number.
        retrievals: one ``(step_before, step_after)`` pair per retrieval, indices into ``step_entropy``;
            ``step_after`` is None when the trajectory ended (truncation) before a policy step followed.

    Returns:
        Mean Z over retrievals that have both neighbours; 0.0 for on-policy trajectories, hybrid ones that
        never retrieved, and ones whose every retrieval lacks a following step (spec §8.1).
    """
    values = []
    for before, after in retrievals:
        if after is None or after >= len(step_entropy) or before is None or before < 0:
            continue
        values.append(retrieval_reward_single(step_entropy[before], step_entropy[after], switches, eps))
    return float(sum(values) / len(values)) if values else 0.0


def retrieval_advantage(z_ret: torch.Tensor, group_ids: torch.Tensor | list, eps: float = EPS) -> torch.Tensor:
    """A_ret^i = (Z_ret^i - mean_g Z_ret) / (std_g Z_ret + eps)  (Eq. 9).

    Normalised over the whole group, on-policy zeros included (spec §8.8); a group whose Z are all equal
    (for example, all on-policy) gets 0.

    Args:
        z_ret: [B] per-trajectory retrieval reward.
        group_ids: [B].

    Returns:
        [B] retrieval advantage.
    """
    return group_zscore(z_ret, group_ids, divide_by_std=True, eps=eps)


def rapo_advantage(
    acc_advantage: torch.Tensor,
    ret_advantage: torch.Tensor,
    advantage_weight: float = 0.2,
    clamp_factor_at_zero: bool = False,
) -> torch.Tensor:
    """A_RAPO^i = (1 + a * A_ret^i) * A_acc^i  (Eq. 10).

    Args:
        acc_advantage: [B] GRPO outcome advantage A_acc.
        ret_advantage: [B] retrieval advantage A_ret.
        advantage_weight: a (paper: 0.2).
        clamp_factor_at_zero: optionally keep (1 + a A_ret) >= 0 so a retrieval can never flip the sign of
            the outcome advantage (only happens when A_ret < -1/a; spec §8.8).

    Returns:
        [B] combined advantage. Where A_ret is 0 it equals A_acc exactly.
    """
    factor = 1.0 + advantage_weight * ret_advantage
    if clamp_factor_at_zero:
        factor = factor.clamp(min=0.0)
    return factor * acc_advantage


def retrieved_token_fraction(num_retrieved_tokens: torch.Tensor, num_response_tokens: torch.Tensor) -> torch.Tensor:
    """F_ret = retrieved tokens / response tokens (generated + tool result + retrieved; no prompt, no padding).

    Args:
        num_retrieved_tokens: [B].
        num_response_tokens: [B].

    Returns:
        [B] in [0, 1); 0 for on-policy trajectories and for empty responses.
    """
    num_retrieved_tokens = num_retrieved_tokens.to(torch.float32)
    num_response_tokens = num_response_tokens.to(torch.float32)
    if bool((num_retrieved_tokens > num_response_tokens).any()):
        raise ValueError("num_retrieved_tokens exceeds num_response_tokens for some trajectory")
    return num_retrieved_tokens / num_response_tokens.clamp(min=1.0)


def importance_shaping_factor(retrieved_fraction: torch.Tensor, shaping_weight: float = 0.05) -> torch.Tensor:
    """The per-trajectory multiplier of Eq. 8: ``r_hat = (1 + m * F_ret) * r``.

    Args:
        retrieved_fraction: [B] F_ret.
        shaping_weight: m (paper: 0.05).

    Returns:
        [B] factor, exactly 1 for on-policy trajectories (their update stays unbiased).
    """
    return 1.0 + shaping_weight * retrieved_fraction.to(torch.float32)
