"""The whole job on a local Ray: end to end with an exact resume, refused resumes, resource checks, Ray Data
advantages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rapo_ray.config import TINY_WARM_OVERRIDES
from rapo_ray.core.errors import ConfigError
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def warm_cfg(tiny_warm_artifacts):
    """A tiny warm-started policy: after a short warm start its outputs are partly format-valid, so
    rewards (-1 / 0 / 1) differ inside groups and updates are non-trivial."""
    art = tiny_warm_artifacts
    return tiny_config(art, *TINY_WARM_OVERRIDES, f"run.output_dir={art / 'runs'}")


def _final_weights(summary):
    from rapo_ray.model.factory import load_model

    return load_model(summary["checkpoint"]).state_dict()


def test_impossible_resources_fail_fast_and_too_few_cpus_are_shared(ray_session, fleet_cfg):
    from rapo_ray.launch.launcher import check_resources
    from tests.conftest import tiny_config

    cfg = tiny_config(fleet_cfg.run.artifacts_dir, "resources.gpus_per_learner=1")
    with pytest.raises(ConfigError, match="GPUs"):
        check_resources(cfg)
    # the suite's Ray has 6 CPUs: 8 learners + 2 workers at 1 CPU each are scaled to 0.6 each, and said so
    said = []
    cfg = tiny_config(fleet_cfg.run.artifacts_dir, "learner.world_size=8")
    check_resources(cfg, said.append)
    assert (cfg.resources.cpus_per_learner, cfg.resources.cpus_per_rollout_worker) == (0.6, 0.6)
    assert "resources.cpus_per_learner=0.6 resources.cpus_per_rollout_worker=0.6" in said[0]
    cfg = tiny_config(fleet_cfg.run.artifacts_dir, "learner.world_size=8", "resources.fit_cpus=false")
    with pytest.raises(ConfigError, match=r"= 10 CPUs, but the cluster has 6; resources.cpus_per_learner=0.6"):
        check_resources(cfg)


def test_end_to_end_rapo_and_resume(ray_session, warm_cfg):
    """The whole topology (warm start, Milvus buffer, Serve retrieval, FSDP learners, fleet, collective
    sync, checkpoints); then 2 straight GRPO steps equal 1 step + resume + 1 step with the learners fed through
    Ray Data's streaming_split, within 1e-5. (Exact replay across a resume, trajectory by trajectory, is the
    chaos test's: tests/ray/test_chaos.py.)"""
    from dataclasses import replace

    from rapo_ray.launch.launcher import run
    from rapo_ray.model.factory import load_model
    from rapo_ray.pipelines.sft import warm_start

    cfg = replace(
        warm_cfg,
        trainer=replace(warm_cfg.trainer, total_steps=2),
        run=replace(warm_cfg.run, name="rapo"),
        checkpoint=replace(warm_cfg.checkpoint, every=1),
        # on-policy insertion on, with every on-policy trajectory that called a tool qualifying
        retrieval=replace(warm_cfg.retrieval, insert_on_policy=True, insert_min_reward=-1.0),
    )
    said = []
    summary = run(cfg, log=said.append)
    rd = summary["run_dir"]
    # start-up by stage, in the console and in summary.json (a caller's own Ray: no process age, no "ray" wait)
    assert list(summary["startup_s"]) == [
        *("ray", "starting policy", "learner group start", "buffer and retrieval deploy", "rollout fleet"),
        *("learner group", "retrieval replicas ready", "first weight push", "held-out before"),
    ]
    assert sum(line.startswith("start-up ") for line in said) == 1
    metrics = [json.loads(x) for x in open(f"{rd}/metrics.jsonl")]
    steps = [m for m in metrics if "reward" in m]
    assert metrics[0] == {"step": 0, **summary["before"]}  # the held-out curve starts at the starting policy
    assert len(steps) == 2 and all(m["rollout_tokens"] > 0 and m["learner_tokens_per_s"] > 0 for m in steps)
    # each phase's CPU, from the actors' own process clocks (RAPO keeps the old-policy pass for its retrieval reward)
    assert all(m["rollout_cpu_s"] > 0 and m["update/cpu_s"] > 0 and m["update/old_pass_cpu_s"] > 0 for m in steps)
    assert sum(m["retrievals"] for m in steps) > 0  # hybrid slots retrieved through Serve + Milvus
    assert sum(m["inserted_steps"] for m in steps) > 0  # on-policy steps went into the buffer through Serve
    assert Path(f"{rd}/curves.png").is_file() and json.load(open(f"{rd}/summary.json"))["steps"] == 2
    for fam in ("arith", "multihop"):  # the paired before/after count agrees with the two accuracies
        c = summary["paired_change"][fam]
        assert (
            c["n"] == 8
            and abs(c["gain"] - (summary["after"][f"eval/{fam}/accuracy"] - summary["before"][f"eval/{fam}/accuracy"]))
            < 1e-9
        )
    assert list(Path(rd, "tb").glob("events.out.tfevents.*"))  # TensorBoard event files
    import pyarrow.parquet as pq

    t = pq.read_table(f"{rd}/trajectories/step-000001.parquet")
    assert t.num_rows == 2 * 4 and set(t.column("slot_kind").to_pylist()) == {"on_policy", "hybrid"}

    # 4 prompts x 4 rollouts per step: with this weak policy (~15% of sampled trajectories well-formed), 2
    # prompts sometimes gave every group one constant reward, i.e. zero advantages and no update to compare.
    # The learning-signal features are on, so the resume below also proves their state goes through a checkpoint:
    # dynamic sampling, the pass-rate prompt pool (its counts) and a warm-up of 2 steps.
    base = replace(
        cfg,
        algo=replace(cfg.algo, name="grpo"),
        trainer=replace(
            cfg.trainer,
            prompts_per_step=4,
            dynamic_sampling=True,
            dynamic_sampling_budget=1.5,
            prompt_sampling="pass_rate",
        ),
        learner=replace(cfg.learner, warmup_steps=2),
    )
    straight = run(replace(base, run=replace(base.run, name="straight")), log=lambda *_: None)
    # the resumed run feeds its learners through Ray Data's streaming_split (rows reach the ranks dynamically: the
    # same update up to the order in which the ranks sum their rows), and logs to MLflow (sqlite in the run
    # folder): one MLflow run across the resume
    streamed = replace(base.trainer, learner_feed="streaming_split")
    tracked = replace(base.run, name="resumed", mlflow=True)
    first = run(replace(base, trainer=replace(streamed, total_steps=1), run=tracked), log=lambda *_: None)
    resumed = run(
        replace(base, trainer=streamed, run=tracked, checkpoint=replace(base.checkpoint, resume=first["run_dir"])),
        log=lambda *_: None,
    )
    a, b = _final_weights(straight), _final_weights(resumed)
    steps = [m for m in map(json.loads, open(f"{resumed['run_dir']}/metrics.jsonl")) if "reward" in m]
    assert [m["update/lr"] for m in steps] == pytest.approx([base.learner.lr / 2, base.learner.lr])  # the warm-up
    straight_steps = [m for m in map(json.loads, open(f"{straight['run_dir']}/metrics.jsonl")) if "reward" in m]
    for m, n in zip(steps, straight_steps):  # the same draws, refills and pool counts as the straight run
        assert m["dynamic_sampling/groups_kept"] == n["dynamic_sampling/groups_kept"]
        assert m["dynamic_sampling/extra_rollouts"] == n["dynamic_sampling/extra_rollouts"]
        assert m["prompt_pool/seen"] == n["prompt_pool/seen"] > 0
        assert m["groups_with_signal"] == m["dynamic_sampling/groups_kept"] or m["dynamic_sampling/no_signal"] == 1
    # the run's totals went through the checkpoint (a step trains on 4 groups of 4 or, short of signal, fewer)
    totals = [sum(n["trajectories"] for n in straight_steps[: i + 1]) for i in range(2)]
    assert [m["lifetime/trajectories"] for m in steps] == totals and totals[0] % 4 == 0
    from mlflow.tracking import MlflowClient

    mlflow_id = Path(resumed["run_dir"], "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri=f"sqlite:///{Path(resumed['run_dir']).resolve() / 'mlflow.db'}")
    assert [m.step for m in client.get_metric_history(mlflow_id, "reward")] == [1, 2]
    init = load_model(warm_start(base)).state_dict()
    # where the warm start was built and the run ran (warm starts differ between machines: docs/RESULTS.md)
    built_on = json.loads(Path(warm_start(base), "built_on.json").read_text())
    assert built_on["torch"] == torch.__version__ and built_on["cpu"]
    assert summary["machine"]["cpu"] == built_on["cpu"] and summary["machine"]["cpu_count"] >= 1
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    assert max((a[k] - init[k]).abs().max().item() for k in a) > 1e-4  # the steps moved the weights 10x that


def test_a_users_algorithm_module_runs_in_a_ray_job(ray_session, warm_cfg):
    """``algo.modules``: ``rloo-ramp`` of tests/user_algorithm.py, named only in the config, runs in the whole job
    (in colocated mode: the weights through shared memory).
    The rollout workers import it (their groups start with half the slots and get the rest by the ``refill`` hook;
    broken answers pay -2 by ``settle_reward``); the driver's estimator gives each token the leave-one-out advantage
    times (t + 1) / L, a per-token output the module declares; and those reach the loss: at ratio 1 (one update on
    fresh rows), the update's loss is -sum_(i,t) A_it m_it / sum m over the loss tokens m."""
    import pyarrow.parquet as pq

    from rapo_ray.config import from_dict, to_dict
    from rapo_ray.launch.launcher import run

    data = to_dict(warm_cfg)
    data["algo"].update(name="rloo-ramp", modules=["tests.user_algorithm"], group_size=4, kl_coef=0.0)
    data["trainer"].update(total_steps=1, prompts_per_step=4, dynamic_sampling=True, dynamic_sampling_budget=2.0)
    data["learner"].update(mini_batch_size=16, ppo_epochs=1)
    data["run"].update(name="user-algorithm")
    data["resources"].update(colocate=True)  # (and the colocated mode's path through a whole job: issue #65)
    summary = run(from_dict(data).validate(), log=lambda *_: None)
    assert summary["weight_sync"] == "colocated"
    step = next(m for m in map(json.loads, open(f"{summary['run_dir']}/metrics.jsonl")) if "reward" in m)
    rows = pq.read_table(f"{summary['run_dir']}/trajectories/step-000001.parquet").to_pylist()
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    assert groups and all(sorted(r["slot"] for r in g) == [0, 1, 2, 3] for g in groups.values())  # refilled
    assert all(r["reward"] == -2.0 for r in rows if not r["format_ok"]) and any(not r["format_ok"] for r in rows)
    for g in groups.values():  # the module's estimator, per token
        for r in g:
            rest = [u["reward"] for u in g if u is not r]
            a, n = r["reward"] - sum(rest) / len(rest), len(r["response_ids"])
            assert r["advantage"] == pytest.approx([a * (t + 1) / n for t in range(n)], abs=1e-6)
    assert any(any(r["advantage"]) for r in rows)
    weighted = sum(a * m for r in rows for a, m in zip(r["advantage"], r["loss_mask"]))
    assert step["update/old_pass_skipped"] == 1.0 and step["update/old_pass_cpu_s"] == 0.0
    assert step["engine_cache_freed_mb"] > 0 and "free_cache_s" in step  # the torch engines' caches, for the update
    assert step["update/loss_sum"] == pytest.approx(-weighted / sum(sum(r["loss_mask"]) for r in rows), rel=1e-4)


def test_resume_with_incompatible_config_names_fields(ray_session, warm_cfg, tmp_path):
    from dataclasses import replace

    from rapo_ray.launch.launcher import make_run_dir

    rd = make_run_dir(replace(warm_cfg, run=replace(warm_cfg.run, output_dir=str(tmp_path), name="r")))
    bad = replace(
        warm_cfg,
        algo=replace(warm_cfg.algo, clip_high=0.2),
        checkpoint=replace(warm_cfg.checkpoint, resume=str(rd.path)),
    )
    with pytest.raises(ConfigError, match=r"config differs in \['algo.clip_high'\]"):
        make_run_dir(bad)
    with pytest.raises(ConfigError, match="already exists"):  # never overwrite an existing run directory
        make_run_dir(replace(warm_cfg, run=replace(warm_cfg.run, output_dir=str(tmp_path), name="r")))
    with pytest.raises(ConfigError, match="not a run directory"):
        make_run_dir(replace(warm_cfg, checkpoint=replace(warm_cfg.checkpoint, resume=str(tmp_path / "nowhere"))))


def test_a_run_failing_to_deploy_retrieval_stops_the_learners_it_started(ray_session, warm_cfg, tmp_path):
    """The learner ranks start before the buffer and Serve (launcher.run); a failure there must not leave them."""
    from dataclasses import replace

    import ray

    from rapo_ray.launch.launcher import run

    def placed_groups() -> set:  # the learners' placement group holds their CPUs while they live
        return {pg for pg, t in ray.util.placement_group_table().items() if t["state"] == "CREATED"}

    before = placed_groups()
    cfg = replace(
        warm_cfg,
        run=replace(warm_cfg.run, output_dir=str(tmp_path), name="no-milvus"),
        retrieval=replace(warm_cfg.retrieval, milvus_uri="http://127.0.0.1:9"),  # nothing listens on port 9
    )
    with pytest.raises(Exception, match="127.0.0.1:9"):
        run(cfg, log=lambda *_: None)
    assert placed_groups() == before


def test_ray_data_advantages_equal_the_driver(ray_session):
    from rapo_ray.algos.registry import get_algorithm
    from rapo_ray.config import load_config
    from rapo_ray.training.data_flow import advantages_with_ray_data

    algo = load_config().algo
    rng = __import__("random").Random(0)
    n = 24
    batch = {
        "row": list(range(n)),
        "group_id": [f"g{i // 8}" for i in range(n)],
        "reward": [float(rng.choice([-1, 0, 1])) for _ in range(n)],
        "step_entropies": [[rng.random() + 0.1 for _ in range(3)] for _ in range(n)],
        "retrieval_before": [[0] if i % 8 >= 4 else [] for i in range(n)],
        "retrieval_after": [[1 if i % 3 else -1] if i % 8 >= 4 else [] for i in range(n)],
        "num_retrieved_tokens": [7 if i % 8 >= 4 else 0 for i in range(n)],
        "num_response_tokens": [40] * n,
    }
    expected = get_algorithm(algo.name).advantages(batch, algo)
    got = advantages_with_ray_data(batch, get_algorithm(algo.name), algo)
    assert got["row"] == expected["row"]
    for k in ("advantage", "retrieval_reward", "shaping"):
        assert got[k] == pytest.approx(expected[k], abs=1e-6)
    assert any(v != 0 for v in expected["retrieval_reward"])
