"""The held-out evaluation of a starting policy, computed once and shared by every run that starts from it.

Every arm and seed of a comparison starts from the same checkpoint and evaluates it greedily on the same held-out
problems before training: on the real model that is ~4 min of a ~35-min run, the same answer each time. The result
is stored under ``run.artifacts_dir/eval_before/<key>.json``, where the key hashes everything the answer depends
on: the starting weights (SHA-256), the loop's evaluation settings (greedy, budgets, system prompt), the rollout
engine's settings, the held-out problems themselves (ids, questions, answers), and this package's source code (a
scorer or loop change is a new key). A cached entry is used only when every one of those is equal.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from rapo_ray.agent.turns import LoopSettings
from rapo_ray.core.files import file_sha256, write_json_atomic

PACKAGE = Path(__file__).resolve().parents[1]  # rapo_ray/


def weights_sha256(model_dir: str | Path) -> str:
    """SHA-256 over a model folder's weight files (``*.safetensors``, else ``*.bin``), in name order."""
    files = sorted(Path(model_dir).glob("*.safetensors")) or sorted(Path(model_dir).glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors or *.bin weight files")
    return hashlib.sha256("".join(f"{f.name}:{file_sha256(f)}" for f in files).encode()).hexdigest()


def source_sha256() -> str:
    """SHA-256 of this package's Python source (every ``rapo_ray/**/*.py``, by relative path)."""
    h = hashlib.sha256()
    for f in sorted(PACKAGE.rglob("*.py")):
        h.update(str(f.relative_to(PACKAGE)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def eval_key(cfg, model_dir: str | Path, groups: list[tuple]) -> str:
    """The cache key of a held-out evaluation of ``model_dir`` on ``groups`` ((group id, Task) pairs)."""
    rollout = dataclasses.asdict(cfg.rollout)
    for fleet_size in ("num_workers", "min_workers", "max_workers"):  # who runs a problem, not what it answers
        rollout.pop(fleet_size, None)
    parts = {
        "weights": weights_sha256(model_dir),
        "loop": dataclasses.asdict(LoopSettings.from_config(cfg, evaluation=True)),
        "rollout": rollout,
        "problems": [[gid, t.id, t.question, list(t.answers), t.kind] for gid, t in groups],
        "source": source_sha256(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_path(cfg, key: str) -> Path:
    return Path(cfg.run.artifacts_dir) / "eval_before" / f"{key}.json"


def load_cached(path: Path) -> tuple[dict, dict] | None:
    """(metrics, problem id -> solved) from a cache entry, or None when there is none or it is unreadable."""
    try:
        saved = json.loads(path.read_text())
        return saved["metrics"], saved["problems"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(path: Path, metrics: dict, problems: dict, model_dir: str | Path) -> None:
    """Write a cache entry atomically: a reader never sees half a file."""
    write_json_atomic(path, {"model_dir": str(model_dir), "metrics": metrics, "problems": problems})


__all__ = ["cache_path", "eval_key", "load_cached", "source_sha256", "store", "weights_sha256"]
