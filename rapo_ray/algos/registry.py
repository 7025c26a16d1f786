"""Algorithms by name. An algorithm is what differs between GRPO, ARPO and RAPO outside the shared PPO loss:

- ``advantages(columns, algo_cfg) -> {"row", "advantage", "retrieval_reward", "shaping"}``: its group-wise
  estimator over ``rapo_ray.algos.group.ADVANTAGE_INPUTS`` columns (whole groups; per group or all at once
  give the same numbers, so it also runs per group in Ray Data);
- ``hybrid_slots(algo_cfg) -> int``: hybrid-policy slots per group (RAPO), 0 for on-policy algorithms; a
  run builds the retrieval service only when this is > 0;
- ``rollout_settings(algo_cfg) -> dict``: agent-loop settings it sets for training rollouts (RAPO's retrieval
  probability, ARPO's branching);
- ``validate(algo_cfg)``: checks of its own config section, run by ``Config.validate`` for the running algorithm
  only; it raises ``rapo_ray.core.errors.ConfigError`` naming the field;
- ``config_section``: its nested config (``algo.rapo``, ``algo.arpo``), documented in ``--help``.

A new algorithm is one module (its estimator) and one ``register`` call; the built-in three are in
rapo_ray/algos/builtin.py, which ``rapo_ray.algos`` imports, so the registry is full once the package is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rapo_ray.core.errors import ConfigError


def _no_hybrid_slots(algo_cfg: Any) -> int:
    return 0


def _no_rollout_settings(algo_cfg: Any) -> dict:
    return {}


def _no_checks(algo_cfg: Any) -> None:
    return None


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantages: Callable[[dict, Any], dict]
    hybrid_slots: Callable[[Any], int] = _no_hybrid_slots
    rollout_settings: Callable[[Any], dict] = _no_rollout_settings
    validate: Callable[[Any], None] = _no_checks
    config_section: str | None = None


_REGISTRY: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in _REGISTRY:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered")
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def algorithm_names() -> list[str]:
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> Algorithm:
    if name not in _REGISTRY:
        raise ConfigError(f"algo.name: {name!r} is not one of {sorted(_REGISTRY)} (rapo_ray.algos.registry)")
    return _REGISTRY[name]
