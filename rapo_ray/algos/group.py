"""One function from a batch of trajectories to their advantages (GRPO, or RAPO's Eq. 5-10 with shaping).

Everything it computes is per group, so running it on all groups at once (the driver) or on each group
separately (Ray Data ``map_groups``) gives the same numbers. Columns are plain lists so the batch can be an
Arrow table's ``to_pydict()``.
"""

from __future__ import annotations

import torch

from rapo_ray.algos.advantages import grpo_outcome_advantage
from rapo_ray.algos.rapo import (RetrievalRewardSwitches, importance_shaping_factor, rapo_advantage, retrieval_advantage,
                                 retrieved_token_fraction, trajectory_retrieval_reward)

INPUT_COLUMNS = ("row", "group_id", "reward", "step_entropies", "retrieval_before", "retrieval_after",
                 "num_retrieved_tokens", "num_response_tokens")


def group_advantages(batch: dict, algo) -> dict:
    """Advantages of the trajectories in ``batch`` (any number of whole groups).

    Args:
        batch: columns of ``INPUT_COLUMNS``, one entry per trajectory: ``row`` (an id passed through),
            ``group_id``, ``reward``, ``step_entropies`` (H per generated step), ``retrieval_before`` /
            ``retrieval_after`` (step indices around each retrieval; -1 = no step after it),
            ``num_retrieved_tokens``, ``num_response_tokens``.
        algo: ``AlgoConfig`` (name, norm_adv_by_std, advantage_weight, shaping_weight, the switches).

    Returns:
        ``row``, ``advantage`` (A_RAPO or A_acc), ``retrieval_reward`` (Z_ret, 0 without retrievals), ``shaping``
        (the Eq. 8 factor; 1 outside RAPO), each a list aligned with the input.
    """
    gids = list(batch["group_id"])
    adv = grpo_outcome_advantage(torch.tensor(batch["reward"], dtype=torch.float32), gids, norm_by_std=algo.norm_adv_by_std)
    n = len(gids)
    z = torch.zeros(n)
    shaping = torch.ones(n)
    if algo.name == "rapo":
        switches = RetrievalRewardSwitches(algo.use_quality_term, algo.use_timing_term, algo.invert_delta, algo.invert_timing)
        for i in range(n):
            spans = [(int(b), None if int(a) < 0 else int(a)) for b, a in zip(batch["retrieval_before"][i], batch["retrieval_after"][i])]
            z[i] = trajectory_retrieval_reward(list(batch["step_entropies"][i]), spans, switches)
        if algo.use_retrieval_reward:
            adv = rapo_advantage(adv, retrieval_advantage(z, gids), algo.advantage_weight, algo.clamp_rapo_factor)
        if algo.use_importance_shaping:
            f = retrieved_token_fraction(torch.tensor(batch["num_retrieved_tokens"]), torch.tensor(batch["num_response_tokens"]))
            shaping = importance_shaping_factor(f, algo.shaping_weight)
    return {"row": list(batch["row"]), "advantage": adv.tolist(), "retrieval_reward": z.tolist(), "shaping": shaping.tolist()}
