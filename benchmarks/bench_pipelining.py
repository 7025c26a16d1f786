"""How much of the rollout the bounded-staleness step hides behind the update (algo.max_staleness), on a fleet whose
engines model their decode time instead of using a core (rollout.engine=simulated).

    python benchmarks/bench_pipelining.py                    # k = 0, 1, 2; 12 steps each; GRPO on the bundled job
    python benchmarks/bench_pipelining.py --token-ms 6.5 --min-tokens 128 --max-tokens 256 --steps 12

On this 2-core box a real engine and the learners compete for the same cores, so overlapping them cannot gain much
(measure that with `compare_algorithms.py --methods "grpo,grpo async-1"`). Here the engines sleep for
longest-sequence tokens x --token-ms per batched call (the default 6.5 ms: vLLM's own latency benchmark, Llama-3.1-8B
on one H200, batch 8, 128 output tokens in 833 ms), so the rollout costs wall time but no core, as a GPU fleet
costs the driver nothing; the learners are the real ones on the bundled model. Each run is `jobs/train.py`
(compare_algorithms.train_once; a finished run in --work is reused). Per k, over the steps after the first (the first has no rollout made ahead):

    step        the measured step wall time (median)
    rollout     the wall time of the rollout that fed the step
    learners    old-policy pass + advantages + update
    sync        the weight push
    sequential  rollout + learners + sync: what the synchronous step costs
    ideal       max(rollout, learners) + sync: a perfect overlap
    hidden      (sequential - step) / (sequential - ideal): the share of the overlappable time the scheduler hid

Results: --out (JSON) and a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks.compare_algorithms import train_once
from rapo_ray.core.devices import machine_record
from rapo_ray.core.files import write_json_atomic
from rapo_ray.training.reporting import read_metrics

REPO = Path(__file__).resolve().parents[1]


def step_times(metrics: list[dict]) -> dict:
    """Medians over the steps after the first, and what a sequential and a perfectly overlapped step would take."""
    steps = [m for m in metrics if "reward" in m][1:]
    if not steps:
        raise ValueError("bench_pipelining: a run needs at least 2 steps")

    def med(f) -> float:
        return statistics.median(f(m) for m in steps)

    rollout = med(lambda m: m["rollout_s"])
    learners = med(lambda m: m["old_logprob_s"] + m["advantages_s"] + m["update_s"])
    sync = med(lambda m: m["sync_s"])
    step = med(lambda m: m["step_s"])
    sequential, ideal = rollout + learners + sync, max(rollout, learners) + sync
    overlappable = sequential - ideal
    return {
        "step_s": step,
        "rollout_s": rollout,
        "learners_s": learners,
        "sync_s": sync,
        "sequential_s": sequential,
        "ideal_s": ideal,
        "hidden": (sequential - step) / overlappable if overlappable > 0 else 0.0,
        "staleness_mean": med(lambda m: m.get("staleness_mean", 0.0)),
        "steps": len(steps),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="0,1,2", help="algo.max_staleness values, comma-separated")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--token-ms", type=float, default=6.5, help="modelled decode time per token step")
    ap.add_argument("--min-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--artifacts", default=str(REPO / "artifacts"), help="the bundled job's warm start (built once)")
    ap.add_argument("--work", default=str(REPO / "runs" / "bench_pipelining"), help="the runs' folder")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "pipelining.json"))
    args = ap.parse_args()
    overrides = [
        "algo.name=grpo",
        "rollout.engine=simulated",
        f"rollout.simulated_token_ms={args.token_ms}",
        f"rollout.simulated_min_tokens={args.min_tokens}",
        f"rollout.simulated_max_tokens={args.max_tokens}",
        f"rollout.max_step_tokens={args.max_tokens}",
        f"rollout.max_response_tokens={args.max_tokens}",
    ]
    budget = SimpleNamespace(
        config=None,
        steps=args.steps,
        prompts=args.prompts,
        eval_size=8,  # the engines emit filler: held-out accuracy means nothing here
        artifacts=args.artifacts,
        overrides=overrides,
    )
    rows = []
    for k in [int(x) for x in args.ks.split(",")]:
        extra = [f"algo.max_staleness={k}"] + (["algo.behaviour_correction=truncate"] if k else [])
        run_dir = train_once(f"k{k}-s{args.seed}", extra, args.seed, budget, Path(args.work))
        if run_dir is None:
            return 1
        metrics = read_metrics(run_dir)
        rows.append({"max_staleness": k, **step_times(metrics)})
    report = {
        "engine": {"token_ms": args.token_ms, "min_tokens": args.min_tokens, "max_tokens": args.max_tokens},
        "steps": args.steps,
        "prompts": args.prompts,
        "rows": rows,
        "machine": machine_record(),
    }
    write_json_atomic(Path(args.out), report)
    print("| k | step | rollout | learners | sync | sequential | ideal | hidden | mean lag |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['max_staleness']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['learners_s']:.2f} | "
            f"{r['sync_s']:.2f} | {r['sequential_s']:.2f} | {r['ideal_s']:.2f} | {r['hidden']:.2f} | "
            f"{r['staleness_mean']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
