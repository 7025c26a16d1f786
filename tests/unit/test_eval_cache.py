"""The starting policy's held-out result, cached once per (weights, problems, settings, source) and reused."""

from __future__ import annotations

from types import SimpleNamespace

from rapo_ray.config import load_config
from rapo_ray.launch.launcher import evaluate_starting_policy
from rapo_ray.training import eval_cache
from rapo_ray.types.trajectory import Task

GROUPS = [("eval-gsm8k-0", Task("gsm8k-0", "What is 2+3?", ("5",), "math"))]


def model_folder(tmp_path, weights: bytes):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def test_the_key_changes_with_what_the_answer_depends_on_and_only_with_it(tmp_path):
    cfg = load_config(overrides=[f"run.artifacts_dir={tmp_path}"])
    model = model_folder(tmp_path, b"w" * 1000)
    key = eval_cache.eval_key(cfg, model, GROUPS)
    assert key == eval_cache.eval_key(cfg, model, list(GROUPS))
    # which workers run it does not change what a greedy evaluation answers
    assert key == eval_cache.eval_key(load_config(overrides=["rollout.max_workers=3"]), model, GROUPS)
    other_problem = [("eval-gsm8k-0", Task("gsm8k-0", "What is 2+4?", ("6",), "math"))]
    assert key != eval_cache.eval_key(cfg, model, other_problem)
    assert key != eval_cache.eval_key(load_config(overrides=["tasks.system_prompt=paper"]), model, GROUPS)
    assert key != eval_cache.eval_key(load_config(overrides=["rollout.max_response_tokens=100"]), model, GROUPS)
    model_folder(tmp_path, b"v" * 1000)  # other weights in the same folder
    assert key != eval_cache.eval_key(cfg, model, GROUPS)


class FakeTrainer:
    """Counts evaluations; answers the one problem correctly."""

    def __init__(self):
        self.evaluations = 0

    def eval_groups(self):
        return GROUPS

    def evaluate(self):
        self.evaluations += 1
        return SimpleNamespace(metrics={"eval/mean_accuracy": 1.0}, problems={"gsm8k-0": True})


def test_the_second_run_from_the_same_start_reuses_the_first_ones_evaluation(tmp_path):
    cfg = load_config(overrides=[f"run.artifacts_dir={tmp_path}"])
    model, trainer, said = model_folder(tmp_path, b"w" * 1000), FakeTrainer(), []
    first = evaluate_starting_policy(cfg, trainer, model, said.append)
    second = evaluate_starting_policy(cfg, trainer, model, said.append)
    assert first == second == ({"eval/mean_accuracy": 1.0}, {"gsm8k-0": True})
    assert trainer.evaluations == 1 and "reusing" in said[-1]
    (entry,) = (tmp_path / "eval_before").glob("*.json")
    entry.write_text('{"metrics": {')  # a torn or damaged entry is evaluated again and rewritten, not trusted
    assert evaluate_starting_policy(cfg, trainer, model, said.append) == first and trainer.evaluations == 2
    assert eval_cache.load_cached(entry) == first
    off = load_config(overrides=[f"run.artifacts_dir={tmp_path}", "trainer.reuse_eval_before=false"])
    evaluate_starting_policy(off, trainer, model, said.append)
    assert trainer.evaluations == 3
