"""Typed configuration for the whole system.

Values come from the dataclass defaults, then an optional YAML file, then dotted command-line overrides
(``algo.name=grpo rollout.num_workers=4``); every field has help text (``python jobs/train.py --help``).

- ``sections.py``: one dataclass per section, each with its ``validate()``;
- ``root.py``: ``Config``, the sections together and the checks across them;
- ``load.py``: YAML and overrides, type coercion, strict unknown-key errors, (de)serialisation;
- ``help.py``: ``--help``;
- ``presets.py``: named shapes and the tiny overrides of tests and benchmarks.
"""

from rapo_ray.algos.arpo import ArpoConfig
from rapo_ray.algos.rapo import RapoConfig
from rapo_ray.config.help import help_text
from rapo_ray.config.load import diff_configs, from_dict, load_config, parse_override, save_config, to_dict
from rapo_ray.config.presets import BUNDLED_FAMILIES, MODEL_SIZES, TINY_OVERRIDES, TINY_WARM_OVERRIDES
from rapo_ray.config.root import Config
from rapo_ray.config.sections import (
    AlgoConfig,
    CheckpointConfig,
    ColdStartConfig,
    LearnerConfig,
    ModelConfig,
    ResourcesConfig,
    RetrievalConfig,
    RolloutConfig,
    RunConfig,
    ServeConfig,
    SyncConfig,
    TasksConfig,
    TokenizerConfig,
    TrainerConfig,
)

__all__ = [
    "BUNDLED_FAMILIES",
    "MODEL_SIZES",
    "TINY_OVERRIDES",
    "TINY_WARM_OVERRIDES",
    "AlgoConfig",
    "ArpoConfig",
    "CheckpointConfig",
    "ColdStartConfig",
    "Config",
    "LearnerConfig",
    "ModelConfig",
    "RapoConfig",
    "ResourcesConfig",
    "RetrievalConfig",
    "RolloutConfig",
    "RunConfig",
    "ServeConfig",
    "SyncConfig",
    "TasksConfig",
    "TokenizerConfig",
    "TrainerConfig",
    "diff_configs",
    "from_dict",
    "help_text",
    "load_config",
    "parse_override",
    "save_config",
    "to_dict",
]
