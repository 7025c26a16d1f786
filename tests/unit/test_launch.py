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
