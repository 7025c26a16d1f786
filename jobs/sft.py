"""Warm start: supervised training of the small model on a limited set of expert demonstrations.

    python jobs/sft.py [--force] [section.key=value ...]

Writes an HF checkpoint under run.artifacts_dir (reused by jobs/train.py) and prints held-out success
(greedy and sampled) with format validity per family.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from rapo_ray.launch.cli import parse  # noqa: E402


def main(argv=None) -> int:
    cfg, args = parse(
        __doc__,
        argv,
        extra=lambda p: (
            p.add_argument("--force", action="store_true", help="retrain even if cached"),
            p.add_argument("--eval-size", type=int, default=100),
            p.add_argument(
                "--samples",
                type=int,
                default=4,
                help="sampled rollouts per problem (temperature 1): how often the policy finds what RL rewards",
            ),
        ),
    )
    import torch

    torch.set_num_threads(cfg.rollout.threads_per_worker)
    from rapo_ray.agent.evaluation import evaluate, format_table
    from rapo_ray.engines.torch_engine import TorchEngine
    from rapo_ray.envs.suite import build_tools, task_splits
    from rapo_ray.model.factory import load_model, load_tokenizer
    from rapo_ray.pipelines.sft import warm_start
    from rapo_ray.retrieval.search_index import search_index_for

    t0 = time.perf_counter()
    path = warm_start(cfg, force=args.force)
    print(f"warm-start checkpoint: {path} ({time.perf_counter() - t0:.0f} s)")
    tok = load_tokenizer(path)
    engine = TorchEngine(load_model(path), tok)
    _, test = task_splits(cfg.tasks)
    tools = build_tools(cfg.tasks, cfg.rollout, search_index_for(cfg.tasks))
    try:
        print(format_table(evaluate(engine, tok, tools, test, cfg, limit=args.eval_size), "held-out, greedy:"))
        print(
            format_table(
                evaluate(engine, tok, tools, test, cfg, limit=args.eval_size, temperature=1.0, samples=args.samples),
                f"held-out, sampled (temperature 1, {args.samples} samples per problem):",
            )
        )
    finally:
        tools.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
