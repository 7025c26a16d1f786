"""Rollout benchmark: the two turn schedules of the agent loop on the warm-started model, real tools.

    python benchmarks/bench_rollout.py --artifacts /tmp/art                     # vLLM and torch, both schedules
    python benchmarks/bench_rollout.py --engines torch --repeats 3

One process, one engine (one thread, as a rollout worker has), the default config's rollout: G = 16
rollouts for each of ``--prompts`` RL questions per batch, temperature 1, the python sandbox and the search
tool; ``--hybrid`` of the 16 slots are RAPO hybrid slots retrieving from an in-memory buffer of the expert's
steps (the same questions) with the hashing embedder: retrieval is nearly free here (no MiniLM, no Serve
hop), so the numbers isolate the engine, the tools and the turn schedule. Each
(engine, schedule) pair runs the same batches with the same seeds; the first batch is a warm-up. Reports
the median wall time per batch, generated tokens/s and tool calls; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_pair(cfg, model_dir, engine_name: str, schedule: str, batches: list, hybrid: int, retriever) -> dict:
    from rapo_ray.agent.loop import AgentLoop, LoopSettings
    from rapo_ray.algos.rapo import HybridRollout
    from rapo_ray.engines import make_engine
    from rapo_ray.envs.suite import build_tools
    from rapo_ray.model.factory import load_model_and_tokenizer, load_tokenizer
    from rapo_ray.retrieval.search_index import search_index_for

    cfg.rollout.engine = engine_name
    tok = load_tokenizer(model_dir)
    engine = make_engine(
        cfg.rollout, model_dir, load_model_and_tokenizer, max_model_len=cfg.model.max_position_embeddings
    )
    tools = build_tools(cfg.tasks, cfg.rollout, search_index_for(cfg.tasks))
    try:
        rows = []
        for k, tasks in enumerate(batches):
            settings = LoopSettings.from_config(cfg)
            settings.schedule, settings.seed = schedule, k
            rollout = HybridRollout(hybrid, cfg.algo.rapo.retrieve_prob)
            loop = AgentLoop(engine, tok, tools, settings, retriever=retriever, rollout=rollout)
            t0 = time.perf_counter()
            trajs, stats = loop.run_groups(tasks, cfg.algo.group_size)
            wall = time.perf_counter() - t0
            generated = sum(t.num_generated_tokens for t in trajs)
            rows.append(
                {
                    "wall_s": wall,
                    "generated_tokens": generated,
                    "tool_calls": sum(t.tool_calls for t in trajs),
                    "retrievals": sum(t.num_retrievals for t in trajs),
                    "reward": statistics.mean(t.reward for t in trajs),
                    "generate_s": stats.generate_s,
                    "tool_s": stats.tool_s,
                    "retrieve_s": stats.retrieve_s,
                }
            )
            print(
                f"  {engine_name:6} {schedule:15} batch {k}: {wall:6.2f} s, {generated} generated tokens, "
                f"{rows[-1]['tool_calls']} tool calls",
                flush=True,
            )
        timed = rows[1:] or rows
        wall = statistics.median(r["wall_s"] for r in timed)
        return {
            "engine": engine_name,
            "schedule": schedule,
            "median_wall_s": wall,
            "generated_tok_per_s": statistics.median(r["generated_tokens"] / r["wall_s"] for r in timed),
            "tool_calls": statistics.mean(r["tool_calls"] for r in timed),
            "retrievals": statistics.mean(r["retrievals"] for r in timed),
            "summed_tool_s": statistics.mean(r["tool_s"] for r in timed),
            "batches": rows,
        }
    finally:
        tools.close()
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="vllm,torch")
    ap.add_argument("--schedules", default="lockstep,per_trajectory")
    ap.add_argument("--prompts", type=int, default=4, help="RL questions per batch (groups of 16)")
    ap.add_argument("--repeats", type=int, default=4, help="timed batches per pair (after one warm-up batch)")
    ap.add_argument("--hybrid", type=int, default=8, help="hybrid slots per group (0: GRPO rollouts)")
    ap.add_argument("--artifacts", default=str(REPO / "artifacts"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rollout.json"))
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args()

    from rapo_ray.agent.retriever import InMemoryStepRetriever, steps_of
    from rapo_ray.config import load_config
    from rapo_ray.envs.suite import build_tools
    from rapo_ray.model.factory import load_tokenizer, set_torch_threads
    from rapo_ray.pipelines.sft import expert_trajectories, warm_start
    from rapo_ray.retrieval.search_index import search_index_for
    from rapo_ray.training.trainer import rl_task_pool

    set_torch_threads(1)
    cfg = load_config(overrides=[f"run.artifacts_dir={args.artifacts}"] + args.overrides)
    model_dir = warm_start(cfg)
    pool, _ = rl_task_pool(cfg)
    questions = [t for pair in zip(*pool.values()) for t in pair]  # families interleaved
    batches = [questions[k * args.prompts : (k + 1) * args.prompts] for k in range(args.repeats + 1)]
    retriever = None
    if args.hybrid:
        tok, tools = load_tokenizer(model_dir), build_tools(cfg.tasks, cfg.rollout, search_index_for(cfg.tasks))
        try:
            steps = [
                s
                for tr in expert_trajectories(cfg, tok, tools, [t for b in batches for t in b])
                for s in steps_of(tok, tr)
            ]
        finally:
            tools.close()
        retriever = InMemoryStepRetriever(steps, question_scope=cfg.retrieval.question_scope)
    results = []
    for engine_name in args.engines.split(","):
        for schedule in args.schedules.split(","):
            results.append(run_pair(cfg, model_dir, engine_name, schedule, batches, args.hybrid, retriever))
    print(f"\n{'engine':8} {'schedule':16} {'batch s':>8} {'gen tok/s':>10} {'tool calls':>10} {'retrievals':>10}")
    for r in results:
        print(
            f"{r['engine']:8} {r['schedule']:16} {r['median_wall_s']:8.2f} {r['generated_tok_per_s']:10.0f} "
            f"{r['tool_calls']:10.1f} {r['retrievals']:10.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"prompts": args.prompts, "group_size": cfg.algo.group_size, "hybrid": args.hybrid, "results": results},
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
