"""The skipped old-policy pass (rapo_ray/algos/old_pass.py), without Ray: when it is redundant, the step's
advantages without it, and how the update's own values go back into the step's rows. The equality of the loss and
the gradients with and without the pass, on a learner rank: tests/ray/test_workers.py."""

from __future__ import annotations

import pytest
import torch

from rapo_ray.algos.old_pass import old_pass_reason
from rapo_ray.algos.registry import get_algorithm
from rapo_ray.config import load_config
from rapo_ray.training.data_flow import compute_advantages
from rapo_ray.types.batch import TrajectoryBatch
from rapo_ray.types.learner_batch import LearnerBatch
from rapo_ray.types.trajectory import Trajectory
from rapo_ray.workers.learner import put_back_pass, split_for_ranks

ONE_UPDATE = ["learner.mini_batch_size=16", "learner.ppo_epochs=1", "algo.max_staleness=0"]


def _reason(rows: int, *overrides: str) -> str | None:
    cfg = load_config(None, [*ONE_UPDATE, *overrides])
    return old_pass_reason(cfg, rows, get_algorithm(cfg.algo.name))


def test_the_pass_is_skipped_only_where_the_updates_forward_is_pi_old():
    for name in ("grpo", "arpo"):  # neither estimator reads old-policy values
        assert _reason(16, f"algo.name={name}") is None
    assert _reason(16, "algo.name=rapo", "algo.rapo.use_retrieval_reward=false") is None  # RAPO w/o RR
    assert "reads the old policy's step entropies" in _reason(16, "algo.name=rapo")  # the retrieval reward
    # the pass still runs where the update's forward is not at pi_old, or where its rows could not be put back
    assert "learner.mini_batch_size=16" in _reason(17, "algo.name=grpo")
    assert "learner.ppo_epochs=2" in _reason(16, "algo.name=grpo", "learner.ppo_epochs=2")
    # rows rolled out ahead: the pass would run at the current weights, as the update's forward does
    assert _reason(16, "algo.name=grpo", "algo.max_staleness=1", "algo.behaviour_correction=truncate") is None
    assert "learner.ppo_epochs=2" in _reason(16, "algo.name=grpo", "algo.max_staleness=1", "learner.ppo_epochs=2")
    assert "streaming_split" in _reason(16, "algo.name=grpo", "trainer.learner_feed=streaming_split")
    assert "skip_redundant_old_pass" in _reason(16, "algo.name=grpo", "learner.skip_redundant_old_pass=false")


def _batch(lengths: list[int], rewards: list[float]) -> TrajectoryBatch:
    trajs = [
        Trajectory(f"g{i // 2}", i % 2, "on_policy", f"p{i // 2}", "qa", ("1",), prompt_ids=[3, 4],
                   response_ids=[7] * n, loss_mask=[1] * n, reward=r, correct=r > 0)
        for i, (n, r) in enumerate(zip(lengths, rewards))
    ]  # fmt: skip
    batch = TrajectoryBatch(trajs)
    batch.learner = LearnerBatch.from_trajectories(trajs, 0)
    return batch


def test_advantages_without_the_pass_are_those_with_it_and_rapo_refuses():
    cfg = load_config(None, ["algo.name=grpo"])
    with_pass, without = _batch([3, 4, 5, 6], [1, 0, 0, 1]), _batch([3, 4, 5, 6], [1, 0, 0, 1])
    with_pass.learner.entropies = torch.ones_like(with_pass.learner.response_mask)
    grpo = get_algorithm("grpo")
    compute_advantages(with_pass, grpo, cfg.algo)
    compute_advantages(without, grpo, cfg.algo)
    # (r - mean) / std within each group of 2 (sample std): +-0.5 / 0.7071
    assert torch.equal(without.learner.signal["advantage"], with_pass.learner.signal["advantage"])
    assert without.learner.signal["advantage"].abs().tolist() == pytest.approx([0.5**0.5] * 4, abs=1e-5)
    assert without.step_entropies == [[], [], [], []]  # filled after the update, from its own forward
    rapo_cfg = load_config(None, ["algo.name=rapo"])
    with pytest.raises(ValueError, match="rapo reads the old policy's step entropies"):
        compute_advantages(_batch([3, 4], [1, 0]), get_algorithm("rapo"), rapo_cfg.algo)


def test_the_updates_values_go_back_to_their_rows():
    """Ranks see rows out of order (balanced micro-batches); each row's log-probs and entropies
    land on it: here each rank echoes a row's index as its log-probs and its length as its entropies."""
    lengths = [30, 3, 4, 31, 5, 29, 6, 2]
    batch = _batch(lengths, [0.0] * len(lengths))
    lb = batch.learner
    per_rank, _ = split_for_ranks(lb, 2, 3, 0, "balanced")
    results = [
        [
            (
                (mb.response_mask * mb.row[:, None]).numpy(),
                (mb.response_mask * (mb.length - mb.prompt_len)[:, None]).numpy(),
            )
            for mb in mbs
        ]
        for mbs in per_rank
    ]
    put_back_pass(lb, per_rank, results)
    assert [set(lb.response_values("old_logprobs", i).tolist()) for i in range(8)] == [{float(i)} for i in range(8)]
    assert [set(lb.response_values("entropies", i).tolist()) for i in range(8)] == [{float(n)} for n in lengths]
    assert float((lb.old_logprobs * (1 - lb.response_mask)).abs().sum()) == 0  # nothing outside the rows' targets
