"""Plain helpers several test files share (fixtures are in conftest.py)."""

from __future__ import annotations

import importlib
from pathlib import Path

from rapo_ray.agent.loop import LoopSettings
from rapo_ray.training.checkpoints import write_manifest
from rapo_ray.types import protocol

REPO = Path(__file__).resolve().parents[1]


def settings(**kw) -> LoopSettings:
    """Greedy loop settings for the tiny model, with ``kw`` set on top."""
    s = LoopSettings(
        temperature=0.0,
        max_response_tokens=400,
        max_step_tokens=64,
        max_tool_calls=3,
        seed=0,
        system_prompt=protocol.SHORT_SYSTEM_PROMPT,
    )
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def write_checkpoint(root, step: int) -> Path:
    """A complete checkpoint folder ``root/step-NNNNNN`` with small made-up files and its manifest."""
    path = root / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (path / "optimizer.pt").write_bytes(b"o" * 5000)
    (path / "trainer_state.json").write_text('{"step": %d}' % step)
    write_manifest(path)
    (path / "COMPLETE").write_text("ok\n")
    return path


def benchmark_module(name: str):
    """``benchmarks/<name>.py`` as the module ``benchmarks.<name>`` (the package is installed with rapo_ray)."""
    return importlib.import_module(f"benchmarks.{name}")


def compare_module():
    """benchmarks/compare_algorithms.py."""
    return benchmark_module("compare_algorithms")
