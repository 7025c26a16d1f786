"""A user's algorithm with a settings section of its own, installed the way a package installs it: an entry point in
the group ``rapo_ray.algorithms`` (tests/unit/test_custom_algorithm.py writes the entry point's metadata into a
temporary folder on ``PYTHONPATH``). ``scaled_rloo``: leave-one-out advantages times ``algo.scaled_rloo.scale``."""

from __future__ import annotations

from dataclasses import dataclass

from rapo_ray.algos.registry import Algorithm, algorithm_names, register
from rapo_ray.core.errors import ConfigError
from rapo_ray.core.options import option
from tests.user_algorithm import rloo_advantages


@dataclass
class ScaledRlooConfig:
    scale: float = option(1.0, "Factor on every leave-one-out advantage.")


def scaled_rloo_advantages(columns: dict, algo_cfg) -> dict:
    out = rloo_advantages(columns, algo_cfg)
    out["advantage"] = [a * algo_cfg.scaled_rloo.scale for a in out["advantage"]]
    return out


def _validate(algo_cfg) -> None:
    if algo_cfg.scaled_rloo.scale <= 0:
        raise ConfigError(f"algo.scaled_rloo.scale ({algo_cfg.scaled_rloo.scale}) must be > 0")


SCALED_RLOO = Algorithm(
    "scaled_rloo",
    advantages=scaled_rloo_advantages,
    validate=_validate,
    settings=ScaledRlooConfig,
    settings_help="Leave-one-out advantages, scaled (algo.name=scaled_rloo; a test plugin).",
    describe=lambda algo_cfg: f"scale {algo_cfg.scaled_rloo.scale}",
)
if SCALED_RLOO.name not in algorithm_names():
    register(SCALED_RLOO)
