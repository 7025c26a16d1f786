"""RAPO's on-policy buffer insertion: a failed insert is counted and the step goes on."""

from __future__ import annotations

from rapo_ray.agent.loop import AgentLoop
from rapo_ray.algos.registry import get_algorithm
from rapo_ray.envs.suite import task_splits
from rapo_ray.pipelines.expert import ScriptedExpertEngine
from tests.helpers import settings


def test_a_failed_buffer_insertion_is_counted_and_the_step_goes_on(tiny_cfg, tiny_tokenizer, tools, monkeypatch):
    """``retrieval.insert_on_policy``: the Serve insert failing (a dead replica, a timeout) used to end the step;
    now ``Trainer._insert_on_policy`` returns -1 (``insert_errors`` in the step's metrics) and the step goes on."""
    from types import SimpleNamespace

    from ray import serve

    from rapo_ray.training.trainer import Trainer
    from rapo_ray.types.batch import TrajectoryBatch

    _, test = task_splits(tiny_cfg.tasks)
    loop = AgentLoop(ScriptedExpertEngine(tiny_tokenizer), tiny_tokenizer, tools, settings())
    trajs, _ = loop.run_groups(test["arith"][:2], group_size=2)
    assert all(t.correct for t in trajs)
    sent, timeouts = [], []

    class Insert:
        def __init__(self, fail):
            self.fail = fail

        def remote(self, steps):
            sent.append(len(steps))
            return self

        def result(self, timeout_s=None):
            timeouts.append(timeout_s)
            if self.fail:
                raise TimeoutError("the replica did not answer")
            return sent[-1]

    rapo = get_algorithm("rapo")
    trainer = SimpleNamespace(cfg=tiny_cfg, tok=tiny_tokenizer, retrieval_app="retrieval", step_idx=3, algorithm=rapo)
    for fail, expected in ((False, None), (True, -1)):
        monkeypatch.setattr(
            serve, "get_deployment_handle", lambda *a, fail=fail, **k: SimpleNamespace(insert=Insert(fail))
        )
        got = Trainer._insert_on_policy(trainer, TrajectoryBatch(trajs))
        assert got == (sent[-1] if expected is None else expected) and sent[-1] > 0
    assert timeouts == [tiny_cfg.retrieval.timeout_s] * 2
    # the algorithm picks what joins the buffer: RAPO its successful on-policy rollouts, GRPO (no buffer) nothing
    assert rapo.buffer_candidates(trajs, 1.0) == trajs and rapo.buffer_candidates(trajs, 2.0) == []
    trajs[0].slot_kind = "hybrid"
    assert rapo.buffer_candidates(trajs, 1.0) == trajs[1:]
    trainer.algorithm = get_algorithm("grpo")
    assert Trainer._insert_on_policy(trainer, TrajectoryBatch(trajs)) == 0 and len(sent) == 2
