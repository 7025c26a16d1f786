"""Our policy loss with a behaviour correction (algo.behaviour_correction) against AReaL's decoupled PPO loss.

    pip download --no-deps areal==1.0.4 -d /tmp/areal && unzip -q /tmp/areal/areal-*.whl -d /tmp/areal/src
    python benchmarks/loss_oracle.py --areal-dir /tmp/areal/src [--out benchmarks/results/loss_oracle.json]

AReaL's ``ppo_actor_loss_fn`` (``areal/utils/functional/functional.py``) takes the current, proximal and behaviour
log-probs; its ``RejectionSamplingConfig`` with ``action=clamp`` is our ``truncate`` and ``action=mask`` our
``mask`` (token level, ratio metric). The installed package needs a long dependency chain that does not build
here, so the one module is loaded from the unpacked wheel, with the two names it imports from elsewhere given
minimal stand-ins: the config's fields (level, action, metric, agg, upper, lower) and ``KLEstimator`` (unused
by the ratio metric). Random batches in float64: loss and gradient differences are reported; AReaL computes the
behaviour weight in float32, so agreement is to float32 precision.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from rapo_ray.algos.loss import PolicyLossConfig, policy_loss
from rapo_ray.core.devices import machine_record
from rapo_ray.core.files import write_json_atomic

ACTIONS = {"truncate": "clamp", "mask": "mask"}  # ours -> AReaL's


@dataclass
class RejectionSamplingStandIn:
    level: str = "token"
    action: str = "mask"
    metric: str = "ratio"
    agg: str = "mean"
    upper: float = 5.0
    lower: float | None = None


def load_areal(areal_dir: Path):
    path = areal_dir / "areal" / "utils" / "functional" / "functional.py"
    if not path.is_file():
        sys.exit(f"--areal-dir {areal_dir}: no {path.relative_to(areal_dir)} (unpack AReaL's wheel there)")
    for name in ("areal", "areal.api", "areal.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    cli_args, data = types.ModuleType("areal.api.cli_args"), types.ModuleType("areal.utils.data")
    cli_args.RejectionSamplingConfig, data.KLEstimator = RejectionSamplingStandIn, object
    sys.modules["areal.api.cli_args"], sys.modules["areal.utils.data"] = cli_args, data
    spec = importlib.util.spec_from_file_location("areal_functional", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(areal, trials: int, cap: float, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    worst = {mode: {"loss": 0.0, "grad": 0.0} for mode in ACTIONS}
    for _ in range(trials):
        B, T = 4, 7
        proximal = -torch.rand(B, T, dtype=torch.float64, generator=gen) * 3
        behaviour = proximal + torch.randn(B, T, dtype=torch.float64, generator=gen) * 0.8
        logp = (proximal + torch.randn(B, T, dtype=torch.float64, generator=gen) * 0.3).requires_grad_(True)
        adv = torch.randn(B, 1, dtype=torch.float64, generator=gen).expand(B, T).contiguous()
        mask = torch.rand(B, T, generator=gen) > 0.2
        for mode, action in ACTIONS.items():
            cfg = PolicyLossConfig(
                clip_low=0.2, clip_high=0.28, dual_clip=3.0, behaviour_correction=mode, behaviour_cap=cap
            )
            ours, _ = policy_loss(logp, proximal, adv, mask.double(), cfg, behaviour_logp=behaviour)
            (g_ours,) = torch.autograd.grad(ours, logp)
            theirs, _ = areal.ppo_actor_loss_fn(
                logp, proximal, behaviour, adv, 0.2, mask, eps_clip_higher=0.28, c_clip=3.0,
                rejection_sampling=RejectionSamplingStandIn(action=action, upper=cap),
            )  # fmt: skip
            (g_theirs,) = torch.autograd.grad(theirs, logp)
            worst[mode]["loss"] = max(worst[mode]["loss"], abs(ours.item() - theirs.item()))
            worst[mode]["grad"] = max(worst[mode]["grad"], float((g_ours - g_theirs).abs().max()))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--areal-dir", type=Path, required=True, help="an unpacked AReaL wheel")
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--cap", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON report")
    args = ap.parse_args()
    worst = compare(load_areal(args.areal_dir), args.trials, args.cap, args.seed)
    for mode, diff in worst.items():
        print(
            f"{mode:8s} (AReaL {ACTIONS[mode]}): max |loss diff| {diff['loss']:.2e}, max |grad diff| {diff['grad']:.2e}"
        )
    if args.out:
        report = {"areal_dir": str(args.areal_dir), "trials": args.trials, "cap": args.cap, "max_abs_diff": worst}
        write_json_atomic(args.out, {**report, "machine": machine_record()})
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
