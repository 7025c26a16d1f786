"""Bounded staleness on a local Ray (algo.max_staleness): k=0 is the synchronous step bit for bit; k=1 rolls the
next step out during the update, keeps every group exactly once through a worker's death, and resumes from the
queued rollout exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rapo_ray.config import TINY_WARM_OVERRIDES
from tests.conftest import tiny_config

STEPS = 3


@pytest.fixture(scope="module")
def sync_cfg(tiny_warm_artifacts):
    art = tiny_warm_artifacts
    return tiny_config(
        art, *TINY_WARM_OVERRIDES, f"run.output_dir={art / 'runs'}", "algo.name=grpo", f"trainer.total_steps={STEPS}"
    )


@pytest.fixture(scope="module")
def ahead_cfg(sync_cfg):
    return replace(sync_cfg, algo=replace(sync_cfg.algo, max_staleness=1, behaviour_correction="truncate"))


@pytest.fixture(scope="module")
def policy_dir(ray_session, sync_cfg):
    from rapo_ray.launch.launcher import starting_policy

    return starting_policy(sync_cfg, log=lambda *_: None)  # the trainer tests' tiny warm start (cached)


def _trainer(cfg, policy_dir, checkpoints):
    from rapo_ray.training.trainer import Trainer

    return Trainer(cfg, policy_dir, checkpoints, retrieval_app=None)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_k0_is_the_synchronous_step_bit_for_bit(sync_cfg, policy_dir, tmp_path):
    from rapo_ray.algos.old_pass import old_pass_reason
    from rapo_ray.training.data_flow import compute_advantages

    cfg = sync_cfg
    trainer = _trainer(cfg, policy_dir, tmp_path / "a")
    try:
        trainer.sync_weights()
        start = trainer.save()  # step 0: the reference below starts where the steps did
        steps = [trainer.step() for _ in range(2)]
        weights = trainer.learners.state_dict()
        assert trainer._learner_thread is None and not trainer.ahead  # no thread, nothing rolled out ahead
        assert all(m["staleness_max"] == 0 and m["staleness/lag0"] == 8 for m in steps)
        # the reference: the step's stages called by hand in their synchronous order, on the same actors from the
        # step-0 checkpoint (weights, optimizer, sampler and RNG state; a fresh Trainer's load is test_k1's)
        trainer.load(start)
        for s in range(2):
            groups = trainer._sample_groups(cfg.trainer.prompts_per_step, s)
            batch, _ = trainer.fleet.run_step(groups, cfg.algo.group_size, seed=cfg.trainer.seed * 7919 + s)
            skip = old_pass_reason(cfg, len(batch), trainer.algorithm) is None  # one update on fresh rows: GRPO skips
            (trainer.learners.learner_batch if skip else trainer.learners.forward_old)(batch)
            compute_advantages(batch, trainer.algorithm, cfg.algo, on=cfg.trainer.advantages_on)
            trainer.learners.update(batch, s, old_from_update=skip)
            assert steps[s]["update/old_pass_skipped"] == float(skip)
            trainer.version = s + 1
            trainer.sync_weights()
            assert steps[s]["reward"] == pytest.approx(sum(batch.rewards()) / len(batch), abs=0)
        assert _equal(weights, trainer.learners.state_dict())
    finally:
        trainer.shutdown()


def test_k1_rolls_out_ahead_and_resumes_from_the_queue_exactly(ahead_cfg, sync_cfg, policy_dir, tmp_path):
    trainer = _trainer(ahead_cfg, policy_dir, tmp_path / "straight")
    try:
        trainer.sync_weights()
        first = trainer.step()
        # step 2's groups were rolled out during step 1's update, by the weights of version 0
        assert first["staleness/lag0"] == 8 and first["ahead_rollout_s"] > 0
        assert [a.step for a in trainer.ahead] == [1]
        assert {t.policy_version for t in trainer.ahead[0].batch} == {0}
        second = trainer.step()
        assert second["staleness/lag1"] == 8 and second["staleness_max"] == 1 and second["stale_groups_dropped"] == 0
        checkpoint = trainer.save()  # after step 2, with step 3's rollout queued
        queued = [t.response_ids.tolist() for t in trainer.ahead[0].batch]
        third = trainer.step()
        assert not trainer.ahead  # nothing is rolled out past trainer.total_steps
        assert third["staleness/lag1"] == 8
        straight = trainer.learners.state_dict()
        assert dict(trainer.lag_counts) == {0: 8, 1: 16}
    finally:
        trainer.shutdown()

    resumed = _trainer(ahead_cfg, policy_dir, tmp_path / "resumed")
    try:
        resumed.load(checkpoint)
        assert [
            t.response_ids.tolist() for t in resumed.ahead[0].batch
        ] == queued  # the queue came back, not a new rollout
        m = resumed.step()
        assert m["staleness/lag1"] == 8 and m["reward"] == third["reward"]
        assert _equal(straight, resumed.learners.state_dict())
    finally:
        resumed.shutdown()

    # resumed with k=0, the queued rollout is one version too old: its groups are dropped, counted, rolled out again
    synchronous = _trainer(sync_cfg, policy_dir, tmp_path / "k0")
    try:
        synchronous.load(checkpoint)
        m = synchronous.step()
        assert m["stale_groups_dropped"] == 2 and m["staleness/lag0"] == 8 and m["trajectories"] == 8
    finally:
        synchronous.shutdown()


def test_k1_requeues_a_dead_workers_groups_during_the_update(ahead_cfg, policy_dir, tmp_path):
    """A rollout worker killed while the learners update and the fleet rolls out the next step: its groups are
    rolled out again by the others or its replacement (brought up with the updated weights), each exactly once."""
    import ray

    trainer = _trainer(ahead_cfg, policy_dir, tmp_path / "ck")
    forward_old = trainer.learners.forward_old
    killed = []

    def forward_old_and_kill(batch):  # runs in the learner thread, as the ahead rollout starts
        if not killed:
            wid = sorted(trainer.fleet.workers)[0]
            ray.kill(trainer.fleet.workers[wid], no_restart=True)
            killed.append(wid)
        return forward_old(batch)

    trainer.learners.forward_old = forward_old_and_kill
    try:
        trainer.sync_weights()
        trainer.step()
        second = trainer.step()  # uses the rollout that lost a worker
        assert killed and second["requeued_groups"] >= 1 and second["replaced_workers"] >= 1
        assert second["trajectories"] == 8 and second["staleness_max"] <= 1
        assert killed[0] not in trainer.fleet.workers and len(trainer.fleet.workers) == ahead_cfg.rollout.num_workers
        trainer.step()
    finally:
        trainer.shutdown()
