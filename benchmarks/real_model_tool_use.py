"""How a real model uses the python tool on GSM8K, before and after its cold start.

    .venv/bin/python benchmarks/real_model_tool_use.py --config configs/smollm2_gsm8k.yaml --checkpoint base
    .venv/bin/python benchmarks/real_model_tool_use.py --config configs/smollm2_gsm8k.yaml --checkpoint cold-start
    python benchmarks/real_model_tool_use.py --checkpoint DIR --device cuda [--dtype bfloat16]   # the torch engine on a GPU

On the first ``--questions`` problems of the config's first eval file, through the real agent loop, engine and
sandbox (no Ray): greedy pass@1 and sampled (T=1, ``--samples`` per question) pass@1, each with the tool (the
config's system prompt, up to ``rollout.max_tool_calls`` calls) and without it (a prompt that asks for a boxed
answer, no tool calls allowed). A step may run to ``rollout.max_response_tokens`` (not ``max_step_tokens``), so
prose answers are measured whole. Also: how many rollouts wrote a boxed answer, how many tool calls they made, and how
many of those ran cleanly (not malformed, no error from the sandbox). ``--checkpoint``: base (the converted
model), cold-start (``cold_start.*`` of the config, built if needed) or an HF folder. ``--device``/``--dtype`` place
the torch engine (the config's engine otherwise runs on the CPU, vLLM where it imports; on a GPU box without vLLM the
torch engine is what runs). Results are merged into benchmarks/results/real_model_tool_use.json under the checkpoint's
label, suffixed ``@device/dtype`` off the CPU's float32.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_TOOL_PROMPT = "Solve the problem step by step. Give the final answer in \\boxed{}."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "smollm2_gsm8k.yaml"))
    ap.add_argument("--checkpoint", default="base", help="base | cold-start | an HF model folder")
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--samples", type=int, default=4, help="sampled rollouts per question (T=1)")
    ap.add_argument("--device", default="cpu", help="where the torch engine runs: cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the torch engine's dtype")
    ap.add_argument("--override", action="append", default=[], help="config overrides (key=value), repeatable")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "real_model_tool_use.json"))
    args = ap.parse_args()

    from rapo_ray.agent.loop import AgentLoop, LoopSettings
    from rapo_ray.config import load_config
    from rapo_ray.core.devices import machine_record
    from rapo_ray.core.files import merge_json_entry
    from rapo_ray.engines import make_engine
    from rapo_ray.envs.loaders import load_examples
    from rapo_ray.envs.suite import build_tools, to_task
    from rapo_ray.model.factory import context_length, load_model_and_tokenizer, load_tokenizer
    from rapo_ray.pipelines.cold_start import checkpoint_named

    cfg = load_config(args.config, args.override)
    if not cfg.tasks.eval_files:
        sys.exit(f"{args.config}: tasks.eval_files is empty")
    model_dir = checkpoint_named(cfg, args.checkpoint)
    examples, _ = load_examples(cfg.tasks.eval_files[0], limit=args.questions)
    tasks = [to_task(e) for e in examples]
    tok = load_tokenizer(model_dir)
    engine = make_engine(
        cfg.rollout,
        model_dir,
        load_model_and_tokenizer,
        max_model_len=context_length(model_dir),
        dtype=args.dtype,
        device=args.device,
    )
    tools = build_tools(cfg.tasks, cfg.rollout, search_index=None)
    base = LoopSettings.from_config(cfg, evaluation=True)
    # a step may use the whole response budget: prose that does not close a tag is measured, not cut at a step
    base.max_step_tokens, base.max_context = base.max_response_tokens, context_length(model_dir)
    rows = {}
    t_start = time.perf_counter()
    try:
        for mode in ("tool", "no_tool"):
            s = base if mode == "tool" else replace(base, system_prompt=NO_TOOL_PROMPT, max_tool_calls=0)
            for kind, temperature, n in (("greedy", 0.0, 1), ("sampled", 1.0, args.samples)):
                t0 = time.perf_counter()
                loop = AgentLoop(engine, tok, tools, replace(s, temperature=temperature, seed=0))
                trajs, _ = loop.run_groups(tasks, n)
                calls = sum(t.tool_calls for t in trajs)
                rows[f"{mode}/{kind}"] = {
                    "rollouts": len(trajs),
                    "pass@1": sum(t.correct for t in trajs) / len(trajs),
                    "boxed_answer": sum(bool(t.answer) for t in trajs) / len(trajs),
                    "format_ok": sum(t.format_ok for t in trajs) / len(trajs),
                    "tool_calls_per_rollout": calls / len(trajs),
                    "clean_tool_calls": (calls - sum(t.tool_errors for t in trajs)) / calls if calls else None,
                    "generated_tokens_per_rollout": sum(t.num_generated_tokens for t in trajs) / len(trajs),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
                print(f"{mode:8s} {kind:8s} " + json.dumps(rows[f"{mode}/{kind}"]))
    finally:
        tools.close()
        engine.close()
    key = args.checkpoint if args.checkpoint in ("base", "cold-start") else str(model_dir)
    if (args.device, args.dtype) != ("cpu", "float32"):  # one entry per device and dtype, none overwriting another
        key = f"{key}@{args.device}/{args.dtype}"
    record = {
        "model_dir": str(model_dir),
        "eval_file": cfg.tasks.eval_files[0],
        "questions": len(tasks),
        "samples": args.samples,
        "engine": engine.name,
        "device": args.device,
        "dtype": args.dtype,
        "results": rows,
        "seconds": round(time.perf_counter() - t_start, 1),
        "machine": machine_record(),
    }
    print(f"wrote {merge_json_entry(args.out, key, record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
