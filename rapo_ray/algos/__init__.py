"""The learning signal: pure torch, no Ray. Equation numbers refer to shared/RAPO_SPEC.md."""

from rapo_ray.algos.advantages import broadcast_to_tokens, group_zscore, grpo_outcome_advantage
from rapo_ray.algos.arpo import (
    BranchBudget,
    EntropyBrancher,
    branch_probability,
    hard_advantage_attribution,
    normalized_segment_entropy,
    should_branch,
)
from rapo_ray.algos.entropy import (
    batch_step_entropies,
    step_entropies,
    token_entropy_from_logits,
    topk_entropy_estimate,
)
from rapo_ray.algos.group import group_advantages
from rapo_ray.algos.loss import AGG_MODES, PolicyLossConfig, aggregation_denominator, policy_loss
from rapo_ray.algos.rapo import (
    RetrievalRewardSwitches,
    importance_shaping_factor,
    rapo_advantage,
    retrieval_advantage,
    retrieval_reward_single,
    retrieved_token_fraction,
    trajectory_retrieval_reward,
)

__all__ = [name for name in dir() if not name.startswith("_")]
