"""Group-wise advantage estimators over a step's trajectories: GRPO's outcome advantage, and RAPO's Eq. 5-10
with the Eq. 8 shaping factor.

Everything they compute is per group, so running one on all groups at once (the driver) or on each group
separately (Ray Data ``map_groups``) gives the same numbers. Columns are numpy arrays per row, and lists where
rows differ in length (``TrajectoryBatch.advantage_inputs`` builds them; a Ray Data group hands the same shapes).
Each returns ``row`` and the outputs its algorithm declares (``Algorithm.outputs``), each [B] aligned with the
input.
"""

from __future__ import annotations

import torch

from rapo_ray.algos.advantages import grpo_outcome_advantage
from rapo_ray.algos.rapo import (
    RetrievalRewardSwitches,
    importance_shaping_factor,
    rapo_advantage,
    retrieval_advantage,
    retrieved_token_fraction,
    trajectory_retrieval_reward,
)

ADVANTAGE_INPUTS = (
    "row",
    "group_id",
    "reward",
    "step_entropies",
    "retrieval_before",
    "retrieval_after",
    "num_retrieved_tokens",
    "num_response_tokens",
)


def grpo_group_advantages(batch: dict, algo) -> dict:
    """GRPO: A_acc, the reward z-scored within its group.

    Args:
        batch: columns of ``ADVANTAGE_INPUTS``, one entry per trajectory (only ``row``, ``group_id`` and
            ``reward`` are read).
        algo: ``AlgoConfig`` (``norm_adv_by_std``).

    Returns:
        ``row`` and ``advantage`` [B], aligned with the input.
    """
    gids = list(batch["group_id"])
    adv = grpo_outcome_advantage(
        torch.tensor(batch["reward"], dtype=torch.float32), gids, norm_by_std=algo.norm_adv_by_std
    )
    return {"row": list(batch["row"]), "advantage": adv.tolist()}


def rapo_group_advantages(batch: dict, algo) -> dict:
    """RAPO: A_RAPO = A_acc (1 + a A_ret) (Eq. 10) with A_ret the group-standardised retrieval reward Z_ret
    (Eq. 5-7, 9), and the importance shaping factor of Eq. 8.

    Args:
        batch: columns of ``ADVANTAGE_INPUTS``: ``row`` (an id passed through), ``group_id``, ``reward``,
            ``step_entropies`` (H per generated step), ``retrieval_before`` / ``retrieval_after`` (step indices
            around each retrieval; -1 = no step after it), ``num_retrieved_tokens``, ``num_response_tokens``.
        algo: ``AlgoConfig`` (``norm_adv_by_std`` and ``algo.rapo``: weights and ablation switches).

    Returns:
        ``row``, ``advantage`` [B], ``retrieval_reward`` [B] (Z_ret, 0 without retrievals), ``shaping`` [B].
    """
    r = algo.rapo
    gids = list(batch["group_id"])
    adv = grpo_outcome_advantage(
        torch.tensor(batch["reward"], dtype=torch.float32), gids, norm_by_std=algo.norm_adv_by_std
    )
    n = len(gids)
    z = torch.zeros(n)
    shaping = torch.ones(n)
    switches = RetrievalRewardSwitches(r.use_quality_term, r.use_timing_term, r.invert_delta, r.invert_timing)
    for i in range(n):
        spans = [
            (int(b), None if int(a) < 0 else int(a))
            for b, a in zip(batch["retrieval_before"][i], batch["retrieval_after"][i])
        ]
        z[i] = trajectory_retrieval_reward(list(batch["step_entropies"][i]), spans, switches)
    if r.use_retrieval_reward:
        adv = rapo_advantage(adv, retrieval_advantage(z, gids), r.advantage_weight, r.clamp_rapo_factor)
    if r.use_importance_shaping:
        f = retrieved_token_fraction(
            torch.tensor(batch["num_retrieved_tokens"]), torch.tensor(batch["num_response_tokens"])
        )
        shaping = importance_shaping_factor(f, r.shaping_weight)
    return {
        "row": list(batch["row"]),
        "advantage": adv.tolist(),
        "retrieval_reward": z.tolist(),
        "shaping": shaping.tolist(),
    }
