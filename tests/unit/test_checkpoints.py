"""Checkpoint manifests: a cut-short checkpoint is found by its manifest and a resume falls back to the newest
complete one."""

from __future__ import annotations

import pytest

from rapo_ray.core.errors import CheckpointError
from rapo_ray.training.checkpoints import MANIFEST, newest_complete, problem
from tests.helpers import write_checkpoint


def test_the_manifest_names_what_is_wrong_and_resume_falls_back(tmp_path):
    ck = tmp_path / "checkpoints"
    assert newest_complete(ck) is None  # nothing saved yet: a fresh start
    old, new = write_checkpoint(ck, 4), write_checkpoint(ck, 8)
    assert problem(old) is None and problem(new) is None and newest_complete(ck) == new

    (new / "optimizer.pt").write_bytes(b"o" * 100)  # truncated: a driver killed mid-write, a full disk
    assert problem(new) == "optimizer.pt is 100 bytes, the manifest says 5000 (truncated or rewritten)"
    warnings = []
    assert newest_complete(ck, warnings.append) == old
    assert len(warnings) == 1 and "step-000008" in warnings[0] and "optimizer.pt is 100 bytes" in warnings[0]

    (old / "model.safetensors").write_bytes(bytes(reversed(range(256))) * 40)  # same size, other bytes
    assert problem(old) == "model.safetensors does not match its SHA-256 in the manifest (corrupted)"
    assert problem(old, hashes=False) is None  # sizes alone (what pruning checks) cannot see it
    with pytest.raises(CheckpointError, match="no complete checkpoint to resume") as err:
        newest_complete(ck)
    assert "step-000004" in str(err.value) and "step-000008" in str(err.value)

    cut = ck / "step-000012"
    cut.mkdir()
    (cut / "trainer_state.json").write_text("{}")
    assert problem(cut) == f"no {MANIFEST} (the save did not finish)"
    (new / "optimizer.pt").write_bytes(b"o" * 5000)
    (new / "trainer_state.json").unlink()
    assert problem(new) == "trainer_state.json is missing"

    legacy = tmp_path / "legacy" / "step-000002"  # saved before manifests: its COMPLETE marker is trusted
    legacy.mkdir(parents=True)
    (legacy / "COMPLETE").write_text("ok\n")
    assert newest_complete(legacy.parent) == legacy


def test_merge_json_entry_keeps_the_other_entries(tmp_path):
    import json

    from rapo_ray.core.files import merge_json_entry

    out = tmp_path / "results" / "bench.json"
    assert merge_json_entry(out, "cpu", {"gap": 1}) == out
    merge_json_entry(out, "cuda", {"gap": 2})
    merge_json_entry(out, "cpu", {"gap": 3})
    assert json.loads(out.read_text()) == {"cpu": {"gap": 3}, "cuda": {"gap": 2}}
    assert list(out.parent.iterdir()) == [out]  # no temporary file left behind


def test_write_json_atomic_keeps_the_previous_file_when_the_new_one_cannot_be_written(tmp_path):
    import json

    from rapo_ray.core.files import write_json_atomic

    out = tmp_path / "summary.json"
    write_json_atomic(out, {"steps": 3})
    with pytest.raises(TypeError):
        write_json_atomic(out, {"steps": object()})  # not JSON: fails before anything is written
    assert json.loads(out.read_text()) == {"steps": 3}
    assert list(tmp_path.iterdir()) == [out]
