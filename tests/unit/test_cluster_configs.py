"""Cluster configs validate with Ray's own validation; KubeRay manifests and the runtime env parse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


CLUSTER = REPO / "cluster"


def _worker_groups(spec: dict) -> dict:
    return {g["groupName"]: g for g in spec["workerGroupSpecs"]}


def _check_ray_cluster_spec(spec: dict):
    assert spec["enableInTreeAutoscaling"] is True and spec["rayVersion"].startswith("2.60")
    assert spec["authOptions"]["mode"] == "token"
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] and "nvidia.com/gpu" not in head["resources"]["limits"]
    groups = _worker_groups(spec)
    assert set(groups) == {"rollout-gpu", "learner-gpu"}
    for name, custom in (("rollout-gpu", "rollout_node"), ("learner-gpu", "learner_node")):
        g = groups[name]
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"] and g["maxReplicas"] >= 1
        assert custom in json.loads(yaml.safe_load(g["rayStartParams"]["resources"]))  # '"{...}"' as KubeRay expects
        c = g["template"]["spec"]["containers"][0]
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1 and c["image"]


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_cloud_launcher_configs_validate(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((CLUSTER / name).read_text())
    cfg = prepare_config(raw)  # fills the provider's defaults, as `ray up` does
    validate_config(cfg)  # Ray's JSON schema
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] == "head" and types["head"]["resources"].get("GPU", 0) == 0  # a CPU head
    assert types["rollout_gpu"]["resources"]["GPU"] >= 1 and types["rollout_gpu"]["resources"]["rollout_node"] >= 1
    assert types["learner_gpu"]["resources"]["GPU"] >= 1 and types["learner_gpu"]["resources"]["learner_node"] >= 1
    for t in ("rollout_gpu", "learner_gpu"):
        assert 0 == types[t]["min_workers"] < types[t]["max_workers"]  # autoscaling from zero
    assert any(".[gpu]" in c for c in cfg["setup_commands"])  # installs the project with the vLLM extra
    assert all(
        "RAY_AUTH_MODE=token" in c
        for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
        if "ray start" in c
    )


def test_fake_cluster_config_validates():
    from ray.autoscaler._private.util import validate_config

    cfg = yaml.safe_load((CLUSTER / "fake-multinode.yaml").read_text())
    validate_config(cfg)
    assert cfg["provider"]["type"] == "fake_multinode" and cfg["provider"]["use_node_id_as_ip"] is True
    assert cfg["provider"]["gcs_address"].startswith("127.0.0.1:")


def test_kuberay_manifests_parse_and_carry_required_fields():
    rc = yaml.safe_load((CLUSTER / "kuberay-raycluster.yaml").read_text())
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster" and rc["metadata"]["name"]
    _check_ray_cluster_spec(rc["spec"])
    job = yaml.safe_load((CLUSTER / "kuberay-rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["metadata"]["name"]
    assert (
        job["spec"]["entrypoint"].startswith("python jobs/train.py") and job["spec"]["shutdownAfterJobFinishes"] is True
    )
    assert "env_vars" in yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    _check_ray_cluster_spec(job["spec"]["rayClusterSpec"])


def test_rayjob_entrypoint_overrides_parse():
    import shlex

    from rapo_ray.config import load_config

    job = yaml.safe_load((CLUSTER / "kuberay-rayjob.yaml").read_text())
    argv = shlex.split(job["spec"]["entrypoint"])
    overrides = [a for a in argv[2:] if "=" in a and not a.startswith("--")]
    cfg = load_config(overrides=overrides)
    assert cfg.resources.rollout_custom_resources == {"rollout_node": 1} and cfg.resources.learner_custom_resources == {
        "learner_node": 1
    }


def test_runtime_env_file_is_valid():
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load((CLUSTER / "runtime_env.yaml").read_text())
    RuntimeEnv(**env)  # raises on unknown fields
    assert env["env_vars"]["RAPO_AUTOSCALING_CLUSTER"] == "1"
