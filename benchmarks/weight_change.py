"""How far training moved a model: each run's checkpoint against the weights it started from.

    .venv/bin/python benchmarks/weight_change.py --base <artifacts>/cold-start-<hash> \
        --runs <out>/runs/grpo-s0 <out>/runs/rapo-s0

For each run, its last checkpoint (``checkpoints/step-*/model.safetensors``) against ``--base``'s
``model.safetensors``: the relative L2 change ||w - w0|| / ||w0|| over all parameters and the largest single
change max |w - w0|. With Adam every parameter moves at most about ``lr`` per optimizer step, so after S steps
max |w - w0| <= ~S x lr: a value at that bound says the run moved its weights as far as its steps allowed, and a
comparison of arms whose weights moved 1e-5 of their norm can only differ where greedy decoding sits on a knife
edge. Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


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


def last_checkpoint(run_dir: Path) -> Path:
    found = sorted((run_dir / "checkpoints").glob("step-*/model.safetensors"))
    if not found:
        raise FileNotFoundError(f"{run_dir}: no checkpoints/step-*/model.safetensors (was checkpointing on?)")
    return found[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the starting model's folder (holds model.safetensors)")
    ap.add_argument("--runs", nargs="+", required=True, help="run folders (each with checkpoints/step-*)")
    args = ap.parse_args()
    base_file = Path(args.base) / "model.safetensors"
    if not base_file.is_file():
        print(f"--base {args.base}: no model.safetensors there", file=sys.stderr)
        return 2
    base = load_file(str(base_file))
    for run in args.runs:
        ckpt = last_checkpoint(Path(run))
        print(json.dumps({"run": run, "checkpoint": ckpt.parent.name, **weight_change(base, load_file(str(ckpt)))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
