"""Checkpoint completeness: a manifest of every file's size and SHA-256, written last, so a resume can tell a
complete checkpoint from one cut short (a killed driver, a full disk) before any process starts.

``Trainer.save`` writes a checkpoint into a temporary folder, calls ``write_manifest`` on it and renames it into
place; ``newest_complete`` is what a resume loads: the newest checkpoint whose files match its manifest, skipping
(with a warning naming the file and the problem) any that do not.
"""

from __future__ import annotations

import json
from pathlib import Path

from rapo_ray.core.errors import CheckpointError
from rapo_ray.core.files import file_sha256, write_json_atomic

MANIFEST = "MANIFEST.json"


def write_manifest(folder: Path) -> None:
    """Record every file under ``folder`` (size, SHA-256); written to a temporary name and renamed, so the
    manifest is either whole or absent."""
    folder = Path(folder)
    files = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    write_json_atomic(folder / MANIFEST, {"files": files})


def problem(folder: Path, hashes: bool = True) -> str | None:
    """Why ``folder`` is not a complete checkpoint (None if it is): no manifest, a missing file, a size or (with
    ``hashes``) content that differs from the manifest."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        if (folder / "COMPLETE").is_file():
            return None  # written before manifests existed: its COMPLETE marker is all there is to check
        return f"no {MANIFEST} (the save did not finish)"
    except (ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__})"
    for name, want in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{name} is {size} bytes, the manifest says {want['bytes']} (truncated or rewritten)"
        if hashes and file_sha256(path) != want["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest (corrupted)"
    return None


def newest_complete(checkpoints_dir: Path, warn=print) -> Path | None:
    """The newest ``step-*`` checkpoint that passes ``problem``; each newer one that does not is reported through
    ``warn``. None when there is no checkpoint at all; ``CheckpointError`` when there are some and none is
    complete."""
    found = sorted(Path(checkpoints_dir).glob("step-*"), reverse=True)
    skipped = []
    for path in found:
        why = problem(path)
        if why is None:
            if skipped:
                warn(f"resuming from {path.name}, the newest complete checkpoint (skipped: {'; '.join(skipped)})")
            return path
        skipped.append(f"{path}: {why}")
    if found:
        raise CheckpointError(f"no complete checkpoint to resume in {checkpoints_dir}: {'; '.join(skipped)}")
    return None
