"""GRPO, ARPO and RAPO, registered by name (rapo_ray/algos/registry.py)."""

from __future__ import annotations

from rapo_ray.algos.arpo import ArpoConfig, BranchingRollout
from rapo_ray.algos.group import grpo_group_advantages, rapo_group_advantages
from rapo_ray.algos.rapo import HybridRollout, RapoConfig, buffer_candidates
from rapo_ray.algos.registry import Algorithm, register
from rapo_ray.core.errors import ConfigError


def _arpo_rollout(algo_cfg) -> BranchingRollout:
    a = algo_cfg.arpo
    return BranchingRollout(a.initial_rollouts, a.beam_size, a.branch_prob, a.entropy_weight, a.entropy_tokens)


def _arpo_validate(algo_cfg) -> None:
    a = algo_cfg.arpo
    if not 1 <= a.initial_rollouts <= algo_cfg.group_size:
        raise ConfigError(f"algo.arpo.initial_rollouts ({a.initial_rollouts}) must be in [1, algo.group_size]")


def _rapo_validate(algo_cfg) -> None:
    r = algo_cfg.rapo
    if not 0 <= r.n_hybrid <= algo_cfg.group_size:
        raise ConfigError(f"algo.rapo.n_hybrid ({r.n_hybrid}) must be in [0, algo.group_size={algo_cfg.group_size}]")
    if not 0.0 <= r.retrieve_prob <= 1.0:
        raise ConfigError(f"algo.rapo.retrieve_prob ({r.retrieve_prob}) must be in [0, 1]")


def _rapo_reads_step_entropies(algo_cfg) -> bool:
    # the retrieval reward (Eq. 5) is the entropy change around each retrieval, read from the old-policy pass
    return algo_cfg.rapo.use_retrieval_reward


def _rapo_describe(algo_cfg) -> str:
    r = algo_cfg.rapo
    return f"N_hybrid={r.n_hybrid}, m={r.shaping_weight}, a={r.advantage_weight}"


def _arpo_describe(algo_cfg) -> str:
    a = algo_cfg.arpo
    return f"{a.initial_rollouts} full samples, beam {a.beam_size}, branch p {a.branch_prob}"


def _rapo_rollout(algo_cfg) -> HybridRollout:
    r = algo_cfg.rapo
    return HybridRollout(r.n_hybrid, r.retrieve_prob, r.reward_retrieved_answers)


GRPO = register(Algorithm("grpo", advantages=grpo_group_advantages))
# ARPO's default (soft) advantage attribution is plain GRPO over the branched group (spec, ARPO section).
ARPO = register(
    Algorithm(
        "arpo",
        advantages=grpo_group_advantages,
        rollout=_arpo_rollout,
        validate=_arpo_validate,
        settings=ArpoConfig,
        settings_help="ARPO (algo.name=arpo): entropy-guided branching.",
        describe=_arpo_describe,
    )
)
RAPO = register(
    Algorithm(
        "rapo",
        advantages=rapo_group_advantages,
        rollout=_rapo_rollout,
        buffer_candidates=buffer_candidates,
        validate=_rapo_validate,
        settings=RapoConfig,
        settings_help="RAPO (algo.name=rapo): hybrid rollout, retrieval reward, shaping.",
        reads_step_entropies=_rapo_reads_step_entropies,
        outputs=("advantage", "retrieval_reward", "shaping"),
        describe=_rapo_describe,
    )
)
