"""The launcher's decisions that need no Ray: CPU shares that fit a small cluster, a submitted job's environment."""

from __future__ import annotations

import json

import pytest

from rapo_ray.config import load_config
from rapo_ray.core.errors import ConfigError


def test_a_two_cpu_cluster_gets_cpu_shares_that_fit_or_the_overrides_that_would():
    from rapo_ray.launch.plan import fit_cpus, resource_needs

    cfg = load_config()  # 2 learners + 2 rollout workers at 1 CPU each
    assert resource_needs(cfg).cpus_start == 4 and fit_cpus(cfg, 8) is None
    said = fit_cpus(cfg, 2)
    assert (cfg.resources.cpus_per_learner, cfg.resources.cpus_per_rollout_worker) == (0.5, 0.5)
    assert "= 4 CPUs, but the cluster has 2" in said and resource_needs(cfg).cpus_start == 2
    cfg = load_config(overrides=["resources.fit_cpus=false"])
    with pytest.raises(
        ConfigError, match="resources.cpus_per_learner=0.5 resources.cpus_per_rollout_worker=0.5 would fit"
    ):
        fit_cpus(cfg, 2)
    assert cfg.resources.cpus_per_learner == 1.0  # refused: nothing changed
    with pytest.raises(ConfigError, match="too few CPUs"):
        fit_cpus(load_config(), 0.01)


def test_the_learners_start_before_the_buffer_only_where_its_build_still_fits():
    from rapo_ray.launch.plan import learners_start_before_buffer
    from rapo_ray.pipelines.buffer import BUILD_CPUS

    rapo = load_config()  # 2 learner ranks at 1 CPU each; the build's two actors take 1 CPU each
    assert BUILD_CPUS == 2
    assert learners_start_before_buffer(rapo, 4.0) and not learners_start_before_buffer(rapo, 3.5)
    rapo.resources.cpus_per_learner = 0.5  # a 2-CPU cluster's fitted shares (fit_cpus)
    assert learners_start_before_buffer(rapo, 3.0) and not learners_start_before_buffer(rapo, 2.0)
    assert learners_start_before_buffer(load_config(overrides=["algo.name=grpo"]), 0.0)  # no buffer to build
    # colocated: rank r's bundle also holds rollout worker r's CPUs (2 ranks x (1 + 1) here), from the start
    colocated = load_config(overrides=["resources.colocate=true"])
    assert colocated.rollout.num_workers == 2 and colocated.resources.cpus_per_rollout_worker == 1.0
    assert learners_start_before_buffer(colocated, 6.0) and not learners_start_before_buffer(colocated, 5.5)


def test_a_submitted_jobs_own_env_vars_win_over_the_drivers(monkeypatch):
    """``ray job submit --runtime-env cluster/runtime_env.yaml`` sets OMP_NUM_THREADS too; Ray refuses to merge a key
    that the job and ``ray.init`` both set, so the driver leaves the job's keys out of its own."""
    from rapo_ray.launch.launcher import submitted_job_env_vars

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert submitted_job_env_vars() == {}
    job = {"runtime_env": {"working_dir": "gcs://pkg.zip", "env_vars": {"OMP_NUM_THREADS": "1", "X": "y"}}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    assert submitted_job_env_vars() == {"OMP_NUM_THREADS": "1", "X": "y"}


class _FakeTrainer:
    """What ``rebuild_after_loss`` calls on a trainer, recorded."""

    def __init__(self, cfg, keeps_fleet: bool):
        self.cfg, self.keeps_fleet, self.calls, self.step_idx = cfg, keeps_fleet, [], 3

    def can_keep_fleet(self, lost):
        return self.keeps_fleet

    def replace_learners(self):
        self.calls.append("replace_learners")

    def shutdown(self, graceful=True):
        self.calls.append(f"shutdown(graceful={graceful})")

    def load(self, path):
        self.calls.append(f"load({path.name})")
        self.step_idx = int(path.name.split("-")[1])

    def sync_weights(self):
        self.calls.append("sync_weights")
        self.step_idx = 0


class _FakeMetrics:
    def __init__(self):
        self.rewound_to = None

    def rewind(self, step):
        self.rewound_to = step


def test_a_lost_learner_is_replaced_with_the_fleet_kept_only_where_it_can_be(tmp_path, monkeypatch):
    """The fleet outlives a lost learner group when the trainer says it can and a checkpoint restores the trainer's
    state; otherwise (no checkpoint, or a loss in the weight push, colocated mode, rollouts ahead) the whole trainer
    is built anew, and past trainer.max_failures the run stops naming its checkpoint."""
    from rapo_ray.core.errors import LearnerLost
    from rapo_ray.launch import launcher
    from rapo_ray.training.trainer import Trainer
    from tests.helpers import write_checkpoint

    cfg = load_config(overrides=["trainer.max_failures=2"])
    # the trainer's own rule, on its config and the loss
    for overrides, lost, keeps in [
        ([], LearnerLost("a learner died"), True),
        ([], LearnerLost("a learner died during the weight push (sending)", in_weight_push=True), False),
        (["resources.colocate=true"], LearnerLost("a learner died"), False),
        (["algo.max_staleness=1"], LearnerLost("a learner died"), False),
    ]:
        assert Trainer.can_keep_fleet(_FakeTrainer(load_config(overrides=overrides), None), lost) is keeps, overrides

    built = []

    def new_trainer(*args):
        built.append(_FakeTrainer(cfg, True))
        return built[-1]

    monkeypatch.setattr(launcher, "Trainer", new_trainer)

    def parts_with(trainer, checkpoint_steps):
        run_dir = launcher.RunDir(tmp_path / f"run-{len(list(tmp_path.iterdir()))}")
        for step in checkpoint_steps:
            write_checkpoint(run_dir.checkpoints, step)
        parts = launcher.RunParts(run_dir, launcher.StageTimer(), metrics=_FakeMetrics(), trainer=trainer)
        parts.retrieval = type("Retrieval", (), {"app": "retrieval"})()
        return parts

    said = []
    kept = _FakeTrainer(cfg, True)
    parts = parts_with(kept, [1, 2])
    launcher.rebuild_after_loss(cfg, parts, LearnerLost("a learner died"), said.append)
    assert parts.trainer is kept and kept.calls == ["replace_learners", "load(step-000002)"] and not built
    assert parts.metrics.rewound_to == 2 and parts.failures == 1
    assert (
        said[-1]
        == f"rebuilt the learners (the fleet kept); resumed at step 2 from {parts.run_dir.checkpoints}/step-000002"
    )

    for trainer, steps in [(_FakeTrainer(cfg, False), [1]), (_FakeTrainer(cfg, True), [])]:
        parts = parts_with(trainer, steps)
        launcher.rebuild_after_loss(cfg, parts, LearnerLost("a learner died"), said.append)
        assert trainer.calls == ["shutdown(graceful=False)"] and parts.trainer is built[-1]
        assert built[-1].calls == (["load(step-000001)"] if steps else ["sync_weights"])
        assert said[-1].startswith("rebuilt the learners and fleet; resumed at step ")

    # the third loss is past trainer.max_failures=2: the trainer is stopped (its fleet too) and none is built
    trainer = _FakeTrainer(cfg, True)
    parts = parts_with(trainer, [1])
    parts.failures, n_built = 2, len(built)
    with pytest.raises(RuntimeError, match=r"gave up after 2 rebuilds .*continue with checkpoint.resume="):
        launcher.rebuild_after_loss(cfg, parts, LearnerLost("a learner died"), said.append)
    assert trainer.calls == ["shutdown(graceful=False)"] and parts.trainer is None and len(built) == n_built
