"""A new algorithm is one module and one register call: the one in tests/user_algorithm.py is defined outside
rapo_ray, and the config, the agent loop and the advantage stage run it without a change to rapo_ray (in a Ray job:
tests/ray/test_trainer.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from rapo_ray.agent.loop import AgentLoop
from rapo_ray.algos.registry import get_algorithm
from rapo_ray.config import load_config
from rapo_ray.core.errors import ConfigError
from rapo_ray.engines.base import GenerationResult, InferenceEngine
from rapo_ray.types.batch import TrajectoryBatch
from rapo_ray.types.trajectory import Task
from tests.helpers import settings
from tests.user_algorithm import RLOO_SECOND_CHANCE


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
