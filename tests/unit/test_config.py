"""The typed configuration: defaults, YAML and overrides, strict errors, each section's checks, resource fitting."""

from __future__ import annotations

from pathlib import Path

import pytest

from rapo_ray.config import Config, diff_configs, help_text, load_config, save_config, to_dict
from rapo_ray.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_defaults_follow_the_paper():
    cfg = load_config()
    a = cfg.algo
    assert (a.name, a.group_size, a.rapo.n_hybrid, a.rapo.retrieve_prob) == ("rapo", 16, 8, 0.5)
    assert (a.rapo.shaping_weight, a.rapo.advantage_weight, a.clip_low, a.clip_high) == (0.05, 0.2, 0.28, 0.28)
    # the one deliberate departure: a KL penalty to the starting policy (paper: none), see its help text
    assert a.kl_coef == 0.1 and "paper uses 0" in type(a).__dataclass_fields__["kl_coef"].metadata.get("help", "")
    for paper in ("paper_qwen2.5_3b.yaml", "paper_qwen2.5_7b.yaml"):  # the paper's own configs keep it off
        assert load_config(REPO / "configs" / paper).algo.kl_coef == 0.0


def test_round_trip_yaml(tmp_path):
    cfg = load_config(overrides=["algo.name=grpo", "rollout.num_workers=3", "tasks.families=[arith]"])
    path = tmp_path / "c.yaml"
    save_config(cfg, path)
    again = load_config(path)
    assert to_dict(again) == to_dict(cfg)
    assert again.algo.name == "grpo" and again.rollout.num_workers == 3 and again.tasks.families == ["arith"]


def test_overrides_types():
    cfg = load_config(
        overrides=[
            "learner.lr=3e-4",
            "algo.dual_clip=3",
            "run.tensorboard=false",
            "resources.rollout_custom_resources={a: 1}",
        ]
    )
    assert cfg.learner.lr == 3e-4 and isinstance(cfg.algo.dual_clip, float) and cfg.run.tensorboard is False
    assert cfg.resources.rollout_custom_resources == {"a": 1}


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'algo.nme'.*valid keys under algo: \[.*'name'"):
        load_config(overrides=["algo.nme=grpo"])
    with pytest.raises(ConfigError, match="unknown config key 'bogus'"):
        load_config(overrides=["bogus.x=1"])
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  num_workerz: 2\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown config key 'rollout.num_workerz'"):
        load_config(path)


def test_wrong_types_and_choices():
    with pytest.raises(ConfigError, match=r"rollout.num_workers: expected int, got str 'many'"):
        load_config(overrides=["rollout.num_workers=many"])
    with pytest.raises(ConfigError, match=r"run.tensorboard: expected bool"):
        load_config(overrides=["run.tensorboard=3"])
    with pytest.raises(ConfigError, match=r"algo.name: 'ppo' is not one of"):
        load_config(overrides=["algo.name=ppo"])
    with pytest.raises(ConfigError, match=r"algo: expected a mapping"):
        load_config(overrides=["algo=3"])
    with pytest.raises(ConfigError, match="must look like"):
        load_config(overrides=["algo.name"])


def test_impossible_sizes_are_named():
    with pytest.raises(ConfigError, match=r"algo.rapo.n_hybrid \(20\)"):
        load_config(overrides=["algo.rapo.n_hybrid=20"])
    with pytest.raises(ConfigError, match=r"model.hidden_size \(100\) must be divisible by model.num_heads \(3\)"):
        load_config(overrides=["model.hidden_size=100", "model.num_heads=3", "model.num_kv_heads=1"])
    with pytest.raises(ConfigError, match="tasks.families: unknown family 'chess'"):
        load_config(overrides=["tasks.families=[chess]"])
    with pytest.raises(ConfigError, match="rollout.num_workers"):
        load_config(overrides=["rollout.num_workers=0"])
    with pytest.raises(ConfigError, match=r"rollout.relay_min_workers \(-1\) must be >= 0"):
        load_config(overrides=["rollout.relay_min_workers=-1"])


def test_per_family_warm_start_demos_are_checked_and_change_only_their_families_cache(tmp_path):
    from rapo_ray.pipelines.sft import sft_tasks, warm_start_dir

    with pytest.raises(ConfigError, match="trainer.sft_family_examples: unknown family 'chess'"):
        load_config(overrides=["trainer.sft_family_examples={chess: 3}"])
    with pytest.raises(ConfigError, match=r"trainer.sft_family_examples.alias: expected an integer >= 0, got -1"):
        load_config(overrides=["trainer.sft_family_examples={alias: -1}"])
    base = [f"run.artifacts_dir={tmp_path}"]
    default = load_config(overrides=base)
    # the alias family is not in a default run: its count leaves the default warm start's folder as it was
    assert warm_start_dir(load_config(overrides=[*base, "trainer.sft_family_examples={alias: 7}"])) == warm_start_dir(
        default
    )
    fams = [*base, "tasks.families=[multihop,alias]"]
    assert warm_start_dir(load_config(overrides=[*fams, "trainer.sft_family_examples={alias: 7}"])) != warm_start_dir(
        load_config(overrides=fams)
    )
    cfg = load_config(overrides=[*fams, "trainer.sft_family_examples={alias: 7}"])
    tasks = [f"t{i}" for i in range(50)]
    assert sft_tasks(cfg, tasks, "alias") == tasks[:7]


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(lst)


def test_diff_configs_names_fields():
    a, b = Config(), load_config(overrides=["algo.name=grpo", "learner.lr=1e-3"])
    assert diff_configs(a, b) == ["algo.name", "learner.lr"]


def test_help_lists_every_field():
    text = help_text()

    def keys(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and k in ("rapo", "arpo"):  # nested sections: their own header, then their fields
                assert f"{prefix}{k}: " in text
                yield from keys(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    for section, sub in to_dict(Config()).items():
        for key in keys(sub):
            assert f"{section}.{key} (" in text


def test_every_shipped_config_file_loads():
    files = sorted((REPO / "configs").glob("*.yaml"))
    assert files, "configs/ should ship example configs"
    for f in files:
        load_config(f)


def test_each_section_checks_its_own_fields():
    import dataclasses

    from rapo_ray.config import Config

    # every section has its own validate(); the config's validate runs them all
    assert all(hasattr(getattr(Config(), f.name), "validate") for f in dataclasses.fields(Config))
    for override, message in (
        ("checkpoint.keep_last=0", r"checkpoint.keep_last \(0\) must be >= 1"),
        ("sync.bucket_mb=0", r"sync.bucket_mb \(0.0\) must be > 0"),
        ("resources.cpus_per_learner=-1", r"resources.cpus_per_learner \(-1.0\) must be >= 0"),
        ("serve.retries=-1", r"serve.retries \(-1\) must be >= 0"),
        ("rollout.top_p=0", r"rollout.top_p in \(0, 1\]"),
        ("algo.behaviour_cap=1", r"algo.behaviour_cap \(1.0\) must be > 1"),
        ("algo.behaviour_correction=clip", r"algo.behaviour_correction: 'clip' is not one of"),
        ("algo.max_staleness=-1", r"algo.max_staleness \(-1\) must be >= 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=[override])
    # knobs that only existed to be refused are gone: they are unknown keys now
    for key in ("algo.rapo.retrieval_level=step", "algo.arpo.hard_attribution=false", "algo.stale_policy=refuse"):
        with pytest.raises(ConfigError, match="unknown config key"):
            load_config(overrides=[key])
    with pytest.raises(ConfigError, match="unknown config key 'sync.backend'"):
        load_config(overrides=["sync.backend=gloo"])


def test_registry_holds_every_algorithm_and_its_hooks():
    from rapo_ray.algos.registry import Algorithm, algorithm_names, get_algorithm, register
    from rapo_ray.config import BUNDLED_FAMILIES
    from rapo_ray.envs.tasks import TASK_FAMILIES

    # the built-in three (a test module may have registered a user's algorithm beside them: tests/user_algorithm.py)
    assert {"arpo", "grpo", "rapo"} <= set(algorithm_names()) and sorted(TASK_FAMILIES) == sorted(BUNDLED_FAMILIES)
    cfg = load_config(overrides=["algo.rapo.n_hybrid=5", "algo.arpo.initial_rollouts=6"])
    rollouts = [get_algorithm(n).rollout(cfg.algo) for n in ("grpo", "arpo", "rapo")]
    assert [r.hybrid_slots for r in rollouts] == [0, 0, 5]
    assert [r.initial_slots(16).count("hybrid") for r in rollouts] == [0, 0, 5]
    assert [len(r.initial_slots(16)) for r in rollouts] == [16, 6, 16]  # ARPO grows its groups by branching
    # an algorithm's own section is checked only when it runs: GRPO with G=4 ignores RAPO's N_hybrid=8
    assert load_config(overrides=["algo.name=grpo", "algo.group_size=4"]).algo.group_size == 4
    with pytest.raises(ConfigError, match=r"algo.arpo.initial_rollouts \(8\)"):
        load_config(overrides=["algo.name=arpo", "algo.group_size=4"])
    with pytest.raises(ValueError, match="already registered"):
        register(Algorithm("grpo", advantages=get_algorithm("grpo").advantages))


def test_model_size_presets_set_the_shape_and_refuse_a_conflicting_field():
    from rapo_ray.config import MODEL_SIZES, load_config
    from rapo_ray.core.errors import ConfigError

    cfg = load_config(overrides=["model.size=qwen2.5-0.5b"])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads, cfg.model.num_kv_heads) == (
        896,
        24,
        14,
        2,
    )
    assert (cfg.model.intermediate_size, cfg.model.min_vocab) == (4864, 151936)
    assert load_config(overrides=["model.size=30m", "model.hidden_size=512"]).model.hidden_size == 512  # the same
    with pytest.raises(ConfigError, match="model.size=30m sets model.hidden_size=512; drop model.hidden_size=64"):
        load_config(overrides=["model.size=30m", "model.hidden_size=64"])
    with pytest.raises(ConfigError, match="model.size"):
        load_config(overrides=["model.size=7b"])
    assert load_config().model.hidden_size == MODEL_SIZES["bundled"]["hidden_size"]  # the default is the bundled shape


def test_algo_modules_are_imported_where_the_algorithm_is_looked_up(tmp_path, monkeypatch):
    """``algo.modules``: a user's module, imported by ``algorithm_of`` (the driver's config load and every rollout
    worker), registers its algorithm there; a module that does not import is refused, naming the field."""
    import sys

    from rapo_ray.algos import registry
    from rapo_ray.algos.registry import algorithm_of, get_algorithm

    (tmp_path / "my_algo_for_test.py").write_text(
        "from rapo_ray.algos.group import grpo_group_advantages\n"
        "from rapo_ray.algos.registry import Algorithm, register\n"
        "register(Algorithm('my-grpo', advantages=grpo_group_advantages))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # registered for this test only
    monkeypatch.delitem(sys.modules, "my_algo_for_test", raising=False)
    with pytest.raises(ConfigError, match="algo.name: 'my-grpo' is not one of"):
        load_config(overrides=["algo.name=my-grpo"])
    cfg = load_config(overrides=["algo.name=my-grpo", "algo.modules=[my_algo_for_test]"])
    assert algorithm_of(cfg.algo) is get_algorithm("my-grpo")
    assert algorithm_of(cfg.algo) is get_algorithm("my-grpo")  # imported once: a second lookup registers nothing
    with pytest.raises(ConfigError, match=r"algo.modules: cannot import 'no_such_module_here'"):
        load_config(overrides=["algo.name=grpo", "algo.modules=[no_such_module_here]"])
