"""File helpers shared by layers that must not import each other (checkpoint manifests, converted models)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 4 MiB blocks (a multi-GB checkpoint never sits in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: str | Path, data, **dumps_kwargs) -> Path:
    """Write ``data`` as JSON to ``path`` through a temporary name and a rename, so a reader (or a crash) sees the
    previous file or the new one, never half of one; the temporary name is the writing process's own, so two
    processes writing the same file at once do not write into one temporary file. ``dumps_kwargs`` go to
    ``json.dumps`` (default ``indent=1``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, **{"indent": 1, **dumps_kwargs}) + "\n")
    tmp.replace(path)
    return path


def merge_json_entry(path: str | Path, key: str, value) -> Path:
    """Set ``key`` to ``value`` in the JSON object at ``path`` (created if missing), keeping its other entries: the
    results file a benchmark shares across checkpoints or devices."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = value
    return write_json_atomic(path, data)
