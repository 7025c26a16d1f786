"""Acceptance numbers of the agent environment (issue: agent environment).

    python benchmarks/check_env.py [--problems 1000] [--gsm8k 1000]

- the scripted expert's success per bundled family, through the real loop and tools;
- the python tool's reproduction of GSM8K calculator annotations (first N training problems);
- gold answers of the shared gsm8k / hotpotqa / bamboogle sets scored when boxed (must be 1.0), and a
  wrong answer (must be 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=1000)
    ap.add_argument("--gsm8k", type=int, default=1000)
    ap.add_argument("--artifacts", default=str(REPO / "artifacts"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from rapo_ray.agent.loop import AgentLoop, LoopSettings
    from rapo_ray.config import load_config
    from rapo_ray.envs.loaders import gsm8k_to_trajectory_text, load_examples
    from rapo_ray.envs.rewards import score
    from rapo_ray.envs.suite import build_tools, task_splits
    from rapo_ray.envs.tools import PythonSandbox
    from rapo_ray.model.factory import ensure_bundled_model, load_tokenizer
    from rapo_ray.pipelines.expert import ScriptedExpertEngine
    from rapo_ray.retrieval.search_index import search_index_for

    cfg = load_config(overrides=[f"run.artifacts_dir={args.artifacts}", f"tasks.test_size={args.problems}"])
    tok = load_tokenizer(ensure_bundled_model(cfg))
    tools = build_tools(cfg.tasks, cfg.rollout, search_index_for(cfg.tasks))
    _, test = task_splits(cfg.tasks)
    loop = AgentLoop(ScriptedExpertEngine(tok), tok, tools, LoopSettings.from_config(cfg, evaluation=True))
    for fam, tasks in test.items():
        t0 = time.perf_counter()
        trajs, _ = loop.run_groups(tasks, 1)
        ok = sum(t.correct for t in trajs)
        print(
            f"expert {fam:9} {ok}/{len(trajs)} = {ok / len(trajs):.4f} solved through real tools ({time.perf_counter() - t0:.0f} s)"
        )
    tools.close()
    if SHARED.is_dir():
        sb = PythonSandbox(max_concurrency=2)
        rows = [json.loads(x) for x in open(SHARED / "gsm8k_openai" / "train.jsonl")][: args.gsm8k]
        total = ok = 0
        t0 = time.perf_counter()
        for r in rows:
            _, m = gsm8k_to_trajectory_text(r["answer"], r["answer"].rsplit("####", 1)[1].strip(), sb.run)
            total, ok = total + len(m), ok + sum(m)
        print(
            f"gsm8k annotations reproduced by the python tool: {ok}/{total} = {ok / max(total, 1):.4f} "
            f"(first {len(rows)} problems, {time.perf_counter() - t0:.0f} s)"
        )
        sb.close()
        for name in ("gsm8k", "hotpotqa", "bamboogle"):
            ex, _ = load_examples(SHARED / "eval" / name / "test.jsonl")
            gold = sum(
                score(f"<think>t</think><answer>\\boxed{{{e.answers[0]}}}</answer>", e.answers, e.kind).reward == 1.0
                for e in ex
            )
            wrong = sum(
                score("<think>t</think><answer>\\boxed{zq 98765 xw}</answer>", e.answers, e.kind).reward == 0.0
                for e in ex
            )
            print(f"{name:9} gold boxed -> 1.0: {gold}/{len(ex)}; wrong -> 0: {wrong}/{len(ex)}")
    else:
        print(f"{SHARED} not found: GSM8K and gold-answer checks skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
