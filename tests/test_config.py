import subprocess
import sys
from pathlib import Path

import pytest

from rapo_ray.config import Config, ConfigError, diff_configs, help_text, load_config, save_config, to_dict

REPO = Path(__file__).resolve().parents[1]


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


def test_per_family_warm_start_demos_are_checked_and_change_only_their_families_cache(tmp_path):
    from rapo_ray.sft import sft_tasks, warm_start_dir

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


def test_train_help_prints_fields():
    out = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "train.py"), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "algo.rapo.retrieve_prob" in out.stdout and "Probability of retrieving" in out.stdout


def test_train_rejects_bad_override_before_work():
    out = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "train.py"), "algo.nme=grpo"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert "unknown config key 'algo.nme'" in out.stderr


def test_moved_algorithm_keys_name_their_new_place(tmp_path):
    with pytest.raises(ConfigError, match=r"'algo.n_hybrid' moved to 'algo.rapo.n_hybrid'"):
        load_config(overrides=["algo.n_hybrid=4"])
    old = tmp_path / "old.yaml"
    old.write_text("algo:\n  name: arpo\n  arpo_beam_size: 3\n")
    with pytest.raises(ConfigError, match=r"old.yaml: config key 'algo.arpo_beam_size' moved to 'algo.arpo.beam_size'"):
        load_config(old)
    cfg = load_config(overrides=["algo.name=arpo", "algo.arpo.beam_size=3", "algo.rapo.n_hybrid=4"])
    assert cfg.algo.arpo.beam_size == 3 and cfg.algo.rapo.n_hybrid == 4


def test_registry_holds_every_algorithm_and_its_hooks():
    from rapo_ray.agent.loop import LoopSettings
    from rapo_ray.algos.registry import Algorithm, algorithm_names, get_algorithm, register
    from rapo_ray.config import BUNDLED_FAMILIES
    from rapo_ray.envs.tasks import TASK_FAMILIES

    assert algorithm_names() == ["arpo", "grpo", "rapo"] and sorted(TASK_FAMILIES) == sorted(BUNDLED_FAMILIES)
    cfg = load_config(overrides=["algo.rapo.n_hybrid=5", "algo.arpo.initial_rollouts=6"])
    assert [get_algorithm(n).hybrid_slots(cfg.algo) for n in ("grpo", "arpo", "rapo")] == [0, 0, 5]
    arpo = LoopSettings.from_config(load_config(overrides=["algo.name=arpo", "algo.arpo.initial_rollouts=6"]))
    assert arpo.arpo_initial == 6 and LoopSettings.from_config(cfg).arpo_initial is None
    assert LoopSettings.from_config(load_config(overrides=["algo.name=arpo"]), evaluation=True).arpo_initial is None
    # an algorithm's own section is checked only when it runs: GRPO with G=4 ignores RAPO's N_hybrid=8
    assert load_config(overrides=["algo.name=grpo", "algo.group_size=4"]).algo.group_size == 4
    with pytest.raises(ConfigError, match=r"algo.arpo.initial_rollouts \(8\)"):
        load_config(overrides=["algo.name=arpo", "algo.group_size=4"])
    with pytest.raises(ValueError, match="already registered"):
        register(Algorithm("grpo", advantages=get_algorithm("grpo").advantages))


def test_model_size_presets_set_the_shape_and_refuse_a_conflicting_field():
    from rapo_ray.config import MODEL_SIZES, ConfigError, load_config

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
