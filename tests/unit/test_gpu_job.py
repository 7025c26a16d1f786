"""benchmarks/gpu_job.py's preparation on the CPU (issue #65): which packages a job needs that the GPU box lacks,
and files split into loads that fit one device call and joined back, checked."""

from __future__ import annotations

import json
import sys
from importlib import metadata

import pytest

from benchmarks.gpu_job import box_job_command, needed_distributions, pack, trace_imports, unpack


def test_files_split_into_loads_come_back_whole_and_each_load_fits(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = {"empty.whl": b"", "small.whl": b"0123456789", "big.whl": bytes(range(256)) * 3 + b"tail"}
    for name, data in files.items():
        (src / name).write_bytes(data)
    manifest = pack([src / n for n in files], tmp_path / "loads", part_bytes=100, load_bytes=250)
    loads = sorted((tmp_path / "loads").iterdir())
    assert manifest["loads"] == len(loads) == 4  # 782 bytes in parts of <= 100, loads of <= 250
    for load in loads:
        parts = [p for p in load.iterdir() if p.name != "manifest.json"]
        assert sum(p.stat().st_size for p in parts) <= 250
        assert json.loads((load / "manifest.json").read_text()) == manifest  # every load can start the join
    big = next(f for f in manifest["files"] if f["name"] == "big.whl")
    assert len(big["parts"]) == 8 and len({load for load, _ in big["parts"]}) > 1  # a file spans loads
    joined = unpack(tmp_path / "loads", tmp_path / "out")
    assert {p.name: p.read_bytes() for p in joined} == files
    with pytest.raises(ValueError, match="must fit in a load"):
        pack([src / "small.whl"], tmp_path / "x", part_bytes=10, load_bytes=5)


def test_a_missing_load_or_a_corrupt_part_is_named_and_nothing_half_joined_is_left(tmp_path):
    src = tmp_path / "a.whl"
    src.write_bytes(b"x" * 300)
    pack([src], tmp_path / "loads", part_bytes=100, load_bytes=100)
    (tmp_path / "loads" / "load2" / "a.whl.part001").write_bytes(b"y" * 100)
    with pytest.raises(SystemExit, match="a.whl: the joined parts do not match the manifest"):
        unpack(tmp_path / "loads", tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
    (tmp_path / "loads" / "load3" / "a.whl.part002").unlink()
    (tmp_path / "loads" / "load3" / "manifest.json").rename(tmp_path / "manifest.json")
    (tmp_path / "loads" / "load3").rmdir()
    with pytest.raises(SystemExit, match=r"loads \['load3'\] of 3 are not here"):
        unpack(tmp_path / "loads", tmp_path / "out")
    with pytest.raises(SystemExit, match="no load"):
        unpack(tmp_path / "nothing", tmp_path / "out")


def test_imports_are_traced_in_child_processes_too(tmp_path):
    """A module that only a process started by the command imports (as Ray's workers do) is recorded; one that is
    only probed for (an optional package) is not."""
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import csv'], check=True); import yaml"
    modules = trace_imports([[sys.executable, "-c", child]], cwd=tmp_path)
    assert {"csv", "yaml", "subprocess"} <= modules
    probe = "import importlib.util; assert importlib.util.find_spec('yaml') is not None; import csv"
    assert "yaml" not in trace_imports([[sys.executable, "-c", probe]], cwd=tmp_path)  # looked up, never imported
    with pytest.raises(SystemExit, match="traced command failed"):
        trace_imports([[sys.executable, "-c", "raise SystemExit(3)"]], cwd=tmp_path)


def test_only_what_the_box_lacks_is_carried():
    """The standard library, our own code and the box's packages (torch, PyYAML) stay; Ray goes, at the installed
    version."""
    need = needed_distributions({"json", "rapo_ray", "torch", "yaml", "ray"})
    assert need == {"ray": metadata.version("ray")}


def test_the_box_runs_the_recipes_grpo_colocated_on_one_gpu():
    cmd = box_job_command("python3", 3, "/tmp/o", 20)
    assert "configs/smollm2_arith.yaml" in cmd[cmd.index("--config") + 1]
    for arg in ("algo.name=grpo", "resources.colocate=auto", "resources.gpus_per_learner=1", "learner.world_size=1",
                "rollout.engine=torch", "trainer.total_steps=3"):  # fmt: skip
        assert arg in cmd
