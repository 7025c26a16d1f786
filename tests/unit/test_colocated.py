"""Colocated mode without Ray: the shared-memory weight handoff (learner ranks' segments in /dev/shm, put together
by the importer), the placement it needs, and how ``resources.colocate`` is decided and checked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rapo_ray.config import Config
from rapo_ray.core.errors import ConfigError
from rapo_ray.launch.plan import resolve_colocate, resource_needs, resource_plan
from rapo_ray.workers.colocated import SegmentExporter, SegmentImporter, SharedSegment
from rapo_ray.workers.learner import learner_bundles
from rapo_ray.workers.sync import ColocatedSync
from rapo_ray.workers.weight_layout import TensorSlot, shard_rows


def _export(exporters, weights, rows, version, wire_dtype, prefix):
    """Every rank's export of ``weights``, rank r holding rows ``rows[name]`` (``TensorSlot.rows``) of each."""
    entries = [(k, tuple(v.shape), wire_dtype, rows.get(k, ())) for k, v in weights.items()]

    def holder(rank):
        def local(name):
            w = weights[name]
            first, n = TensorSlot(name, tuple(w.shape), "", 0, 0, rows.get(name, ())).rows_of(rank)
            return w if w.dim() == 0 else w[first : first + n]

        return local

    return [e.export(version, entries, holder(e.rank), len(exporters), prefix, "cpu") for e in exporters]


def test_three_ranks_rows_are_put_together_bit_exact_in_the_wire_dtype(tmp_path):
    """Ranks 0-2 hold torch.chunk rows (7 -> 3, 3, 1; 2 -> 1, 1, none; "n" plain, on rank 0): the importer gets
    every tensor whole, bit for bit in bf16, from files in the shared folder that only the learners wrote."""
    torch.manual_seed(1)
    weights = {"w": torch.randn(7, 5), "b": torch.randn(2), "e": torch.randn(9, 2, 3), "n": torch.randn(4)}
    rows = {"w": shard_rows(7, 3), "b": shard_rows(2, 3), "e": shard_rows(9, 3)}
    exporters = [SegmentExporter(r) for r in range(3)]
    prefix = f"rapo_test_{os.getpid()}"
    try:
        segments = _export(exporters, weights, rows, 4, "bfloat16", prefix)
        assert [s.kind for s in segments] == ["shm"] * 3 and all(Path(s.path).is_file() for s in segments)
        version, got = SegmentImporter().state_dict(segments)
        assert version == 4 and set(got) == set(weights)
        for k, v in weights.items():
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k
        # the next version overwrites the same files; an importer that mapped them reads the new bytes
        importer = SegmentImporter()
        importer.state_dict(segments)
        moved = {k: v + 1 for k, v in weights.items()}
        again = _export(exporters, moved, rows, 5, "bfloat16", prefix)
        assert [s.path for s in again] == [s.path for s in segments]
        version, got = importer.state_dict(again)
        assert version == 5 and all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in moved.items())
    finally:
        for e in exporters:
            e.close()
    assert not any(Path(s.path).exists() for s in segments)


def test_one_rank_holding_the_whole_model_is_read_in_place():
    """World size 1 (one shared GPU): the learner's buffer is laid out as the bucket, so the engine's state dict is
    views of the mapped file itself, no copy on the way; fp32 on an fp32 wire is the learner's bytes."""
    weights = {"a": torch.arange(12.0).view(3, 4), "b": torch.tensor(2.5)}
    exporter = SegmentExporter(0)
    try:
        (seg,) = _export([exporter], weights, {}, 1, "float32", f"rapo_test_{os.getpid()}")
        importer = SegmentImporter()
        _, got = importer.state_dict([seg])
        assert all(torch.equal(got[k], v) for k, v in weights.items())
        assert got["a"].untyped_storage().data_ptr() == importer.open(seg).untyped_storage().data_ptr()
    finally:
        exporter.close()


def test_a_larger_model_gets_a_new_file_and_the_old_one_is_removed():
    exporter = SegmentExporter(0)
    try:
        (small,) = _export([exporter], {"a": torch.ones(4)}, {}, 1, "float32", f"rapo_test_{os.getpid()}")
        (large,) = _export([exporter], {"a": torch.ones(4096)}, {}, 2, "float32", f"rapo_test_{os.getpid()}")
        assert large.path != small.path and not Path(small.path).exists() and Path(large.path).is_file()
        _, got = SegmentImporter().state_dict([large])
        assert torch.equal(got["a"], torch.ones(4096))
    finally:
        exporter.close()


def test_the_importer_refuses_a_mixed_or_incomplete_export():
    weights = {"w": torch.randn(4, 2)}
    rows = {"w": shard_rows(4, 2)}
    exporters = [SegmentExporter(r) for r in range(2)]
    try:
        v1 = _export(exporters, weights, rows, 1, "float32", f"rapo_test_{os.getpid()}")
        v2 = _export(exporters, weights, rows, 2, "float32", f"rapo_test_{os.getpid()}")
        with pytest.raises(ValueError, match=r"one segment per learner rank 0..1 of one version.*versions \[1, 2\]"):
            SegmentImporter().state_dict([v1[0], v2[1]])
        with pytest.raises(ValueError, match=r"ranks \[0\]"):
            SegmentImporter().state_dict(v1[:1])
        with pytest.raises(ValueError, match="of kind 'nfs'"):
            SegmentImporter().open(SharedSegment(1, 0, 1, v1[0].spec, "nfs", 8))
    finally:
        for e in exporters:
            e.close()


def test_the_driver_removes_what_a_killed_learner_left():
    sync = ColocatedSync()
    exporter = SegmentExporter(0)
    (seg,) = _export([exporter], {"a": torch.ones(8)}, {}, 1, "float32", sync.prefix)
    exporter._path = ""  # as if the learner died without closing
    sync.close()
    assert not Path(seg.path).exists()


# ---------------------------------------------------------------- placement and the config


def _cfg(**resources) -> Config:
    cfg = Config()
    for k, v in resources.items():
        setattr(cfg.resources, k, v)
    return cfg


def test_a_colocated_bundle_holds_the_pair_on_one_machine_and_the_gpu_is_split():
    cfg = _cfg(colocate=True, cpus_per_learner=1.0, cpus_per_rollout_worker=0.5, gpus_per_learner=1.0)
    cfg.resources.gpus_per_rollout_worker = 1.0
    cfg.resources.learner_custom_resources = cfg.resources.rollout_custom_resources = {"n": 1}
    cfg.learner.world_size = cfg.rollout.num_workers = 1
    assert learner_bundles(cfg) == ([{"CPU": 1.5, "GPU": 1.0, "n": 2}], "STRICT_PACK")
    assert cfg.resources.colocated_shares() == (0.5, 0.5)
    cfg.resources.gpus_per_learner = 0.0  # the engine on the GPU, the learner on the CPU: the worker asks for it all
    assert cfg.resources.colocated_shares() == (0.0, 1.0)
    plain = _cfg(colocate=False, gpus_per_learner=1.0)
    assert learner_bundles(plain) == ([{"CPU": 1.0, "GPU": 1.0}] * 2, "PACK")


def test_ranks_without_a_worker_get_a_learner_bundle_so_the_cluster_is_asked_for_what_runs():
    """The real-model recipe: 2 learner ranks, 1 worker. Only bundle 0 holds a worker's share: the bundles ask for
    what resource_needs counts (a local Ray is started with that many CPUs)."""
    cfg = _cfg(colocate=True)
    cfg.rollout.num_workers = 1
    bundles, _ = learner_bundles(cfg)
    assert bundles == [{"CPU": 2.0}, {"CPU": 1.0}]
    assert sum(b["CPU"] for b in bundles) == resource_needs(cfg).cpus_max == 3.0


def test_colocated_needs_count_one_gpu_per_pair_and_a_fixed_fleet():
    cfg = _cfg(colocate=True, gpus_per_learner=1.0, gpus_per_rollout_worker=1.0)
    cfg.learner.world_size = cfg.rollout.num_workers = 1
    cfg.rollout.max_workers = 4
    need = resource_needs(cfg)
    assert (need.gpus_start, need.gpus_max, need.rollout_cpus_max) == (1.0, 1.0, 1.0)
    assert "colocated:       yes" in resource_plan(cfg)


def test_auto_colocates_on_a_one_gpu_cluster_only_when_the_run_asks_for_gpus():
    cpu_run = _cfg()
    assert resolve_colocate(cpu_run, 1) is None and cpu_run.resources.colocate is False
    two = _cfg(gpus_per_learner=1.0, gpus_per_rollout_worker=1.0)
    assert resolve_colocate(two, 2) is None and two.resources.colocate is False
    one = _cfg(gpus_per_learner=1.0, gpus_per_rollout_worker=1.0)
    one.learner.world_size = one.rollout.num_workers = 1
    assert "share it (num_gpus 0.5 + 0.5)" in resolve_colocate(one, 1) and one.resources.colocate is True
    assert resolve_colocate(one, 1) is None  # decided once
    unpaired = _cfg(gpus_per_learner=1.0, gpus_per_rollout_worker=1.0)  # 2 learner ranks, 2 workers, one GPU
    with pytest.raises(ConfigError, match=r"colocate=auto: the cluster has one GPU.*learner.world_size=1"):
        resolve_colocate(unpaired, 1)
    assert unpaired.resources.colocate == "auto"


def test_colocate_true_is_refused_with_an_unpaired_or_elastic_fleet():
    cfg = _cfg(colocate=True)
    cfg.rollout.num_workers = 3
    cfg.rollout.max_workers = 4
    with pytest.raises(ConfigError, match=r"rollout.num_workers \(3\) must be <= learner.world_size \(2\)"):
        cfg.validate()
    cfg.rollout.num_workers = 2
    cfg.validate()
    cfg.rollout.num_workers = 1  # (the SmolLM2 recipe's one worker beside rank 0)
    cfg.validate()
    cfg.rollout.autoscale = True
    with pytest.raises(ConfigError, match="rollout.autoscale"):
        cfg.validate()


def test_the_check_compares_what_was_learned_and_leaves_out_times_speeds_and_memory():
    from benchmarks.colocated_check import compare_steps, is_measurement

    assert [is_measurement(k) for k in ("sync_s", "step_s_mean10", "tokens_per_s", "engine_cache_freed_mb")] == [
        True
    ] * 4
    assert not any(is_measurement(k) for k in ("reward", "reward_mean10", "update/grad_norm", "staleness/lag0"))
    a = [{"step": 1, "reward": 0.5, "sync_s": 0.1}, {"step": 2, "reward": 0.7, "sync_s": 0.2}]
    b = [{"step": 1, "reward": 0.5, "sync_s": 0.3}, {"step": 2, "reward": 0.6, "sync_s": 0.2, "entropy": 1.0}]
    assert compare_steps(a, b) == {"steps": 2, "keys_compared": ["entropy", "reward", "step"],
                                   "differ": {"reward": [2], "entropy": [2]}}  # fmt: skip
    assert compare_steps(a, b[:1])["differ"] == {"(step count)": [2, 1]}


def test_the_handoff_imports_without_ray():
    """The GPU box has no Ray before benchmarks/gpu_job.py installs it, and gpu_check.py runs the handoff there:
    colocated.py and the layout it shares with the network sync must import with torch alone."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'ray': raise ImportError('no Ray on this box')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import rapo_ray.workers.colocated, rapo_ray.engines.torch_engine\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
