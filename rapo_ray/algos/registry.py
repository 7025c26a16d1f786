"""Algorithms by name. An algorithm is what differs between GRPO, ARPO and RAPO outside the shared PPO loss:

- ``advantages(columns, algo_cfg) -> {"row", *outputs}``: its group-wise estimator over
  ``rapo_ray.algos.group.ADVANTAGE_INPUTS`` columns (whole groups; per group or all at once give the same numbers,
  so it also runs per group in Ray Data);
- ``outputs``: the names it returns, which go to the learners as the step batch's ``signal`` tensors
  (``LearnerBatch.signal``) and into each step's parquet file. ``advantage`` is required; the loss also reads
  ``shaping`` when present (RAPO). An output named in ``per_token`` is, for each row, a sequence over its response
  tokens (a [B, T-1] tensor on the learners, where the loss takes it token by token); the others are one float a
  row. A new output needs nothing outside the algorithm's module, and the loss if the loss is to read it;
- ``rollout(algo_cfg) -> RolloutPolicy``: its training rollout (rapo_ray/algos/rollout.py): hybrid slots and
  retrieval (RAPO), branching (ARPO), or plain on-policy sampling; a run builds the retrieval service only
  when its ``hybrid_slots`` is > 0;
- ``buffer_candidates(trajectories, min_reward) -> list``: the trajectories of a step whose steps join the
  step buffer when ``retrieval.insert_on_policy`` is on (RAPO), none for algorithms without a buffer;
- ``validate(algo_cfg)``: checks of its own config section, run by ``Config.validate`` for the running algorithm
  only; it raises ``rapo_ray.core.errors.ConfigError`` naming the field;
- ``settings``: the dataclass of its own config section, ``algo.<name>`` (RAPO's ``RapoConfig`` in
  rapo_ray/algos/rapo.py), built from ``rapo_ray.core.options.option`` fields, with ``settings_help`` as the
  section's one-line help. ``rapo_ray.config`` adds one section per registered algorithm that has settings, so the
  section loads from YAML and overrides, is saved with the run and is listed in ``--help``, like the shared ones;
- ``reads_step_entropies(algo_cfg) -> bool``: whether its estimator reads the old policy's step entropies
  (``step_entropies``, from the learners' old-policy pass) before the update; an algorithm that does not lets the
  trainer skip that pass where its log-probs equal the update's own (``rapo_ray/algos/old_pass.py``);
- ``describe(algo_cfg) -> str``: its own settings in one phrase, for the run's resource plan (``--plan``).

A new algorithm is one module (its estimator and hooks) and one ``register`` call; the built-in three are in
rapo_ray/algos/builtin.py, which ``rapo_ray.algos`` imports, so the registry is full once the package is imported.
A user's own algorithm comes in one of two ways:

- an entry point in the group ``rapo_ray.algorithms`` of an installed package (``[project.entry-points.
  "rapo_ray.algorithms"] my_algo = "my_pkg.my_algo"``): ``rapo_ray.algos`` imports it with the built-in three, in
  every process, before the configuration is built, so its settings section is part of the config (the module
  must therefore not import ``rapo_ray.config``, which is built from the registry);
- a module named in ``algo.modules``: every process that looks an algorithm up (the driver, each rollout worker)
  goes through ``algorithm_of``, which imports those modules first, so the module's ``register`` call runs in each
  of them. The configuration exists by then, so such an algorithm cannot add a settings section (``Config.validate``
  says so and names the entry-point way).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any, Callable

from rapo_ray.algos.rollout import ON_POLICY_ROLLOUT, RolloutPolicy
from rapo_ray.core.errors import ConfigError


def _on_policy_rollout(algo_cfg: Any) -> RolloutPolicy:
    return ON_POLICY_ROLLOUT


def _no_buffer(trajectories: Any, min_reward: float) -> list:
    return []


def _no_checks(algo_cfg: Any) -> None:
    return None


def _reads_no_entropies(algo_cfg: Any) -> bool:
    return False


def _no_settings(algo_cfg: Any) -> str:
    return ""


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantages: Callable[[dict, Any], dict]
    rollout: Callable[[Any], RolloutPolicy] = _on_policy_rollout
    buffer_candidates: Callable[[Any, float], list] = _no_buffer
    validate: Callable[[Any], None] = _no_checks
    settings: type | None = None
    settings_help: str = ""
    outputs: tuple[str, ...] = ("advantage",)
    per_token: tuple[str, ...] = ()
    reads_step_entropies: Callable[[Any], bool] = _reads_no_entropies
    describe: Callable[[Any], str] = _no_settings

    def __post_init__(self):
        if "advantage" not in self.outputs or not set(self.per_token) <= set(self.outputs):
            raise ValueError(
                f"algorithm {self.name!r}: outputs {self.outputs} must include 'advantage', and per_token "
                f"{self.per_token} must be among them"
            )
        if self.settings is not None and not self.name.isidentifier():
            raise ValueError(
                f"algorithm {self.name!r} has settings, so its name is a config section (algo.{self.name}) and must "
                "be a Python identifier"
            )


_REGISTRY: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in _REGISTRY:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered")
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def algorithm_names() -> list[str]:
    return sorted(_REGISTRY)


def algorithms_with_settings() -> list[Algorithm]:
    """The registered algorithms that have their own config section (``Algorithm.settings``), by name."""
    return [_REGISTRY[name] for name in sorted(_REGISTRY) if _REGISTRY[name].settings is not None]


def get_algorithm(name: str) -> Algorithm:
    if name not in _REGISTRY:
        raise ConfigError(f"algo.name: {name!r} is not one of {sorted(_REGISTRY)} (rapo_ray.algos.registry)")
    return _REGISTRY[name]


def import_algorithm_modules(modules) -> None:
    """Import each of ``modules`` (``algo.modules``) in this process; importing one registers its algorithm. A
    module imported before is not run again."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"algo.modules: cannot import {module!r} ({exc})") from None


def algorithm_of(algo_cfg: Any) -> Algorithm:
    """The algorithm ``algo_cfg`` (the config's ``algo`` section) names, after importing its ``algo.modules``."""
    import_algorithm_modules(algo_cfg.modules)
    return get_algorithm(algo_cfg.name)


ENTRY_POINT_GROUP = "rapo_ray.algorithms"


def load_entry_points() -> None:
    """Import every installed ``rapo_ray.algorithms`` entry point; importing one registers its algorithm."""
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as exc:  # a broken plugin must say which one, not fail as an anonymous import error
            raise ConfigError(
                f"entry point {entry.name!r} = {entry.value!r} (group {ENTRY_POINT_GROUP}) failed to load: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
