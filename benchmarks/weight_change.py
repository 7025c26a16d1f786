"""How far training moved a model: each run's checkpoint against the weights it started from.

    .venv/bin/python benchmarks/weight_change.py --base <artifacts>/cold-start-<hash> \
        --runs <out>/runs/grpo-s0 <out>/runs/rapo-s0

For each run, its newest complete checkpoint (``checkpoints/step-*`` with its COMPLETE marker, found as
``resolve_checkpoint`` finds it for serving and evaluation) against ``--base``'s ``model.safetensors``: the
relative L2 change ||w - w0|| / ||w0|| over all parameters and the largest single change max |w - w0|. With Adam
every parameter moves at most about ``lr`` per optimizer step, so after S steps max |w - w0| <= ~S x lr: a value at
that bound says the run moved its weights as far as its steps allowed, and a comparison of arms whose weights moved
1e-5 of their norm can only differ where greedy decoding sits on a knife
edge. Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from rapo_ray.core.errors import ModelLoadError
from rapo_ray.model.factory import resolve_checkpoint


def weight_change(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict:
    """``relative_l2``: ||new - base|| / ||base|| over every tensor of ``base``; ``max_abs``: max |new - base|.
    A tensor missing from ``new`` or of another shape is an error that names it."""
    diff_sq = base_sq = 0.0
    max_abs = 0.0
    for name, w0 in base.items():
        if name not in new:
            raise KeyError(f"weight_change: {name!r} is in the base model but not in the checkpoint")
        if new[name].shape != w0.shape:
            raise ValueError(f"weight_change: {name!r} has shape {tuple(new[name].shape)}, base {tuple(w0.shape)}")
        d = new[name].double() - w0.double()
        diff_sq += float(d.pow(2).sum())
        base_sq += float(w0.double().pow(2).sum())
        max_abs = max(max_abs, float(d.abs().max()) if d.numel() else 0.0)
    return {"relative_l2": (diff_sq**0.5) / (base_sq**0.5) if base_sq else 0.0, "max_abs": max_abs}


def load_weights(path: str | Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The folder ``path`` resolves to (a model folder, or a run's newest complete checkpoint) and its weights."""
    folder = resolve_checkpoint(path)
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise ModelLoadError(f"{folder}: no model.safetensors (weight_change reads single-file checkpoints)")
    return folder, load_file(str(weights))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the starting model's folder (holds model.safetensors)")
    ap.add_argument("--runs", nargs="+", required=True, help="run folders (each with checkpoints/step-*)")
    args = ap.parse_args()
    _, base = load_weights(args.base)
    for run in args.runs:
        folder, weights = load_weights(run)
        print(json.dumps({"run": run, "checkpoint": folder.name, **weight_change(base, weights)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
