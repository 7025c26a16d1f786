"""How often a checkpoint solves a recipe's training prompts when it samples: the pass@k distribution over prompts.

    .venv/bin/python benchmarks/pass_at_k.py --config configs/smollm2_gsm8k.yaml --checkpoint cold-start \
        --prompts 100 --samples 8 [--override tasks.calc_steps=[1,2]] [--label NAME]

RL learns only from groups whose rewards differ. For each of the first ``--prompts`` RL questions of the config (the
prompts a run trains on, after the cold start's), ``--samples`` rollouts at the rollout temperature through the real
agent loop, engine and sandbox (no Ray). Reported: mean sampled success, the histogram of successes per prompt
(how many prompts were solved c times of k), unbiased pass@k for k = 1, 2, 4, ..., the expected share of groups of
size G = 2, 4, 8 (drawn from the k samples) whose rewards are not all equal, success by the number of steps a
solution takes (a GSM8K solution's calculator notes; a bundled problem's tool steps), tokens per rollout and rollouts
per minute. Results are merged into
benchmarks/results/pass_at_k.json under ``--label`` (default: the checkpoint's name).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from math import comb
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def unbiased_pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, of which c are correct, is correct)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def group_signal_probability(n: int, c: int, g: int) -> float:
    """P(a group of g drawn without replacement from n samples, c of them correct, holds both outcomes): the chance
    that a GRPO group of size g on this prompt has a non-zero advantage."""
    if g > n:
        raise ValueError(f"a group of {g} needs at least {g} samples, got {n}")
    return 1.0 - comb(c, g) / comb(n, g) - comb(n - c, g) / comb(n, g)


def summarize(successes: list[int], samples: int, group_sizes=(2, 4, 8)) -> dict:
    """The pass@k summary of ``successes`` (correct samples per prompt, each out of ``samples``)."""
    if not successes:
        raise ValueError("no prompts to summarize")
    if any(not 0 <= c <= samples for c in successes):
        raise ValueError(f"successes must lie in [0, {samples}], got {sorted(set(successes))}")
    n = len(successes)
    ks = [k for k in (1, 2, 4, 8, 16, 32) if k <= samples]
    return {
        "prompts": n,
        "samples": samples,
        "mean_success": sum(successes) / (n * samples),
        "histogram": {str(c): Counter(successes)[c] for c in range(samples + 1)},
        "pass_at": {str(k): sum(unbiased_pass_at_k(samples, c, k) for c in successes) / n for k in ks},
        "group_signal": {
            str(g): sum(group_signal_probability(samples, c, g) for c in successes) / n
            for g in group_sizes
            if g <= samples
        },
        "never_solved": sum(c == 0 for c in successes) / n,
        "always_solved": sum(c == samples for c in successes) / n,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "smollm2_gsm8k.yaml"))
    ap.add_argument("--checkpoint", default="cold-start", help="base | cold-start | an HF model folder")
    ap.add_argument("--prompts", type=int, default=100, help="the first N RL questions of the config")
    ap.add_argument("--samples", type=int, default=8, help="sampled rollouts per prompt (the rollout temperature)")
    ap.add_argument("--override", action="append", default=[], help="config overrides (key=value), repeatable")
    ap.add_argument("--label", default="", help="the entry's name in --out (default: the checkpoint's)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "pass_at_k.json"))
    args = ap.parse_args()
    if args.prompts < 1 or args.samples < 1:
        ap.error("--prompts and --samples must be >= 1")

    from rapo_ray.agent.loop import AgentLoop, LoopSettings
    from rapo_ray.config import load_config
    from rapo_ray.core.devices import machine_record
    from rapo_ray.core.errors import DataError
    from rapo_ray.core.files import merge_json_entry
    from rapo_ray.engines import make_engine
    from rapo_ray.envs.loaders import calc_note_count, gsm8k_solutions
    from rapo_ray.envs.suite import build_tools, task_difficulty
    from rapo_ray.model.factory import context_length, load_model_and_tokenizer, load_tokenizer
    from rapo_ray.pipelines.cold_start import checkpoint_named
    from rapo_ray.training.trainer import rl_task_pool

    cfg = load_config(args.config, args.override)
    model_dir = checkpoint_named(cfg, args.checkpoint)
    pool, _ = rl_task_pool(cfg)
    tasks = [t for ts in pool.values() for t in ts][: args.prompts]
    if len(tasks) < args.prompts:
        print(f"only {len(tasks)} RL questions in the config's pool (asked for {args.prompts})")
    steps_of = {t.id: steps for t in tasks if (steps := task_difficulty(t))}  # bundled problems: tool steps
    notes = {}  # question id -> calculator notes of its GSM8K solution, where the data file has them
    for path in cfg.tasks.data_files:
        try:
            notes.update({ex.id: calc_note_count(r) for ex, r in gsm8k_solutions(path, None)})
        except DataError as exc:  # not a GSM8K-format file: no breakdown by notes
            print(f"{path}: no success by calculator notes ({exc})")
    tok = load_tokenizer(model_dir)
    engine = make_engine(
        cfg.rollout, model_dir, load_model_and_tokenizer, max_model_len=context_length(model_dir), device="cpu"
    )
    tools = build_tools(cfg.tasks, cfg.rollout, search_index=None)
    settings = LoopSettings.from_config(cfg)
    settings.seed = cfg.trainer.seed
    t0 = time.perf_counter()
    try:
        trajs, _ = AgentLoop(engine, tok, tools, settings).run_groups(tasks, args.samples)
    finally:
        tools.close()
        engine.close()
    seconds = time.perf_counter() - t0
    per_prompt: dict[str, int] = {t.id: 0 for t in tasks}
    for t in trajs:
        per_prompt[t.group_id] += int(t.correct)
    summary = summarize(list(per_prompt.values()), args.samples)
    steps_of.update(notes)
    by_notes: dict[int, list[int]] = defaultdict(list)
    for tid, c in per_prompt.items():
        if tid in steps_of:
            by_notes[steps_of[tid]].append(c)
    summary["success_by_steps"] = {
        str(k): {"prompts": len(v), "mean_success": sum(v) / (len(v) * args.samples)}
        for k, v in sorted(by_notes.items())
    }
    summary.update(
        {
            "format_valid": sum(t.format_ok for t in trajs) / len(trajs),
            "boxed_answer": sum(bool(t.answer) for t in trajs) / len(trajs),
            "tool_calls_per_rollout": sum(t.tool_calls for t in trajs) / len(trajs),
            "generated_tokens_per_rollout": sum(t.num_generated_tokens for t in trajs) / len(trajs),
            "sequence_tokens_per_rollout": sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs) / len(trajs),
            "rollouts_per_minute": 60 * len(trajs) / seconds,
            "seconds": round(seconds, 1),
        }
    )
    print(json.dumps(summary, indent=1))
    record = {
        "config": args.config,
        "overrides": args.override,
        "model_dir": str(model_dir),
        "engine": engine.name,
        "temperature": settings.temperature,
        "result": summary,
        "machine": machine_record(),
    }
    label = args.label or (args.checkpoint if args.checkpoint in ("base", "cold-start") else str(model_dir))
    print(f"wrote {merge_json_entry(args.out, label, record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
