"""A new algorithm is one module and one register call: the one in tests/user_algorithm.py is defined outside
rapo_ray, and the config, the agent loop and the advantage stage run it without a change to rapo_ray (in a Ray job:
tests/ray/test_trainer.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from rapo_ray.agent.loop import AgentLoop
from rapo_ray.algos.registry import _REGISTRY, Algorithm, get_algorithm
from rapo_ray.config import load_config
from rapo_ray.core.errors import ConfigError
from rapo_ray.core.options import option
from rapo_ray.engines.base import GenerationResult, InferenceEngine
from rapo_ray.types.batch import TrajectoryBatch
from rapo_ray.types.trajectory import Task
from tests.helpers import settings
from tests.user_algorithm import RLOO_SECOND_CHANCE, rloo_advantages


class CyclingEngine(InferenceEngine):
    """Answers every request with the next of: right, wrong, format-broken (one step each)."""

    name = "cycling"
    STEPS = (
        "<think>6*7</think><answer>\\boxed{42}</answer>",
        "<think>6*7</think><answer>\\boxed{41}</answer>",
        "<think>6*7<answer>\\boxed{42}</answer>",
    )

    def __init__(self, tok):
        super().__init__()
        self.tok, self.n = tok, 0

    def load_weights(self, sd, v):
        self.version = v

    def generate(self, prompts, params):
        out = []
        for _ in prompts:
            ids = self.tok(self.STEPS[self.n % 3], add_special_tokens=False)["input_ids"]
            self.n += 1
            out.append(GenerationResult(ids, [-0.5] * len(ids), [1.0] * len(ids), "stop", None))
        return out


@pytest.fixture
def rloo():
    return get_algorithm(RLOO_SECOND_CHANCE.name)  # registered when tests.user_algorithm was imported


def test_an_algorithm_defined_outside_rapo_ray_runs_config_rollout_and_advantages(
    rloo, tiny_cfg, tiny_tokenizer, tools
):
    cfg = load_config(overrides=["algo.name=rloo-second-chance", "algo.group_size=4"])
    with pytest.raises(ConfigError, match=r"algo.group_size \(1\) must be >= 2"):
        load_config(overrides=["algo.name=rloo-second-chance", "algo.group_size=1"])
    algorithm = get_algorithm(cfg.algo.name)
    assert algorithm is rloo and algorithm.rollout(cfg.algo).hybrid_slots == 0  # no retrieval service needed

    tasks = [Task(f"q{i}", "What is 6*7?", ("42",), "math") for i in range(3)]
    loop = AgentLoop(
        CyclingEngine(tiny_tokenizer), tiny_tokenizer, tools, settings(), rollout=algorithm.rollout(cfg.algo)
    )
    trajs, _ = loop.run_groups(tasks, group_size=cfg.algo.group_size)
    # every group: 2 started, 2 more once all its paths had ended (the engine saw 6 requests, then 6 more)
    assert Counter(t.group_id for t in trajs) == {"q0": 4, "q1": 4, "q2": 4} and loop.engine.n == 12
    assert all(sorted(t.slot for t in trajs if t.group_id == g) == [0, 1, 2, 3] for g in ("q0", "q1", "q2"))
    broken = [t for t in trajs if not t.format_ok]
    assert len(broken) == 4 and all(t.reward == -2.0 for t in broken)
    assert sum(t.correct and t.format_ok for t in trajs) == 4 and len({t.reward for t in trajs}) == 3

    batch = TrajectoryBatch(trajs)
    batch.step_entropies = [[0.0] * t.num_generated_steps for t in batch]
    out = algorithm.advantages(batch.advantage_inputs(), cfg.algo)
    for i, t in enumerate(batch):
        rest = [u.reward for u in batch if u.group_id == t.group_id and u is not t]
        assert out["advantage"][i] == pytest.approx(t.reward - sum(rest) / 3)
    assert set(out) == {"row", "advantage"} == {"row", *algorithm.outputs}  # no shaping: the loss uses none


PLUGIN_PROBE = """
import json
from rapo_ray.config import help_text, load_config, save_config, from_dict, to_dict
from rapo_ray.algos.registry import algorithm_of
from rapo_ray.core.errors import ConfigError
import yaml, sys
cfg = load_config(None, ["algo.name=scaled_rloo", "algo.scaled_rloo.scale=0.5", "algo.group_size=4"])
out = {"scale": cfg.algo.scaled_rloo.scale, "help": "algo.scaled_rloo.scale (float, default 1.0)" in help_text()}
adv = algorithm_of(cfg.algo).advantages({"row": [0, 1], "group_id": ["g", "g"], "reward": [1.0, 0.0]}, cfg.algo)
out["advantage"] = adv["advantage"]
out["saved"] = from_dict(yaml.safe_load(yaml.safe_dump(to_dict(cfg)))).algo.scaled_rloo.scale
for bad in (["algo.scaled_rloo.scal=2"], ["algo.name=scaled_rloo", "algo.scaled_rloo.scale=0"]):
    try:
        load_config(None, bad)
        out[bad[-1]] = "accepted"
    except ConfigError as exc:
        out[bad[-1]] = str(exc)
print(json.dumps(out))
"""


def test_an_installed_algorithm_brings_its_own_config_section(tmp_path):
    """An algorithm installed through the ``rapo_ray.algorithms`` entry point group (tests/plugin_algorithm.py) has
    its section ``algo.scaled_rloo``: typed from YAML or overrides, in --help, saved with the run, checked by the
    algorithm, and read by its estimator. Run in a fresh interpreter, where the entry point is installed."""
    dist = tmp_path / "scaled_rloo_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: scaled-rloo-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rapo_ray.algorithms]\nscaled_rloo = tests.plugin_algorithm\n")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)])}
    proc = subprocess.run(
        [sys.executable, "-c", PLUGIN_PROBE], capture_output=True, text=True, timeout=180, cwd=repo, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["scale"] == 0.5 and out["saved"] == 0.5 and out["help"]
    assert out["advantage"] == [0.5, -0.5]  # (1 - 0) x 0.5 and (0 - 1) x 0.5
    assert "unknown config key 'algo.scaled_rloo.scal'" in out["algo.scaled_rloo.scal=2"]
    assert "algo.scaled_rloo.scale (0.0) must be > 0" in out["algo.scaled_rloo.scale=0"]


def test_an_algorithm_with_settings_named_in_algo_modules_is_refused_with_the_way_that_works():
    """``algo.modules`` imports a module after the configuration exists, so a settings section cannot join it; the
    error names the entry-point group instead of failing later on a missing ``algo.<name>``."""
    try:
        with pytest.raises(ConfigError, match="entry point in the group rapo_ray.algorithms"):
            load_config(None, ["algo.name=scaled_rloo", "algo.modules=[tests.plugin_algorithm]"])
    finally:
        _REGISTRY.pop("scaled_rloo", None)  # this process's registry stays as the other tests expect it


def test_an_algorithm_with_settings_needs_a_name_that_can_be_a_config_section():
    @dataclass
    class ScaledRlooConfig:
        scale: float = option(1.0, "Factor.")

    with pytest.raises(ValueError, match="must be a Python identifier"):
        Algorithm("scaled-rloo", advantages=rloo_advantages, settings=ScaledRlooConfig)
    assert Algorithm("scaled-rloo", advantages=rloo_advantages).settings is None  # no section: any name
