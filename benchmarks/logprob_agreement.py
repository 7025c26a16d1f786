"""Engine / learner log-prob agreement on a real model, per engine and dtype.

    .venv/bin/python benchmarks/logprob_agreement.py --config configs/smollm2_gsm8k.yaml --checkpoint cold-start

Each engine (``--engines``: torch, vllm) in each engine dtype (``--dtypes``: float32, bfloat16) samples (T=1) one
rollout per question of the config's first eval file through the real agent loop and python tool, and reports the
log-prob of every token it sampled. The learner's function (``algos.loss.target_logprobs``) then scores the same
token ids on the whole sequence, in the learner's two compute modes:
- ``fp32``: the learner on a CPU (fp32 weights and compute);
- ``bf16``: the GPU learner's compute (``learner.bf16``: fp32 master weights, bf16 autocast), here autocast on
  ``--device``.
It prints |log pi_engine - log pi_learner| over the generated tokens (mean, p99, max) for every pair, the figure
the run logs every step as ``logprob_gap_mean/max``. A gap beyond numerical noise means the PPO ratios of the
first update are biased. Results are merged into benchmarks/results/logprob_agreement.json under the device.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "smollm2_gsm8k.yaml"))
    ap.add_argument("--checkpoint", default="cold-start", help="base | cold-start | an HF model folder")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--engines", default="torch,vllm")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--device", default="cpu", help="where the torch engine and the learner's scoring run")
    ap.add_argument("--override", action="append", default=[], help="config overrides (key=value), repeatable")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "logprob_agreement.json"))
    args = ap.parse_args()

    import torch

    from rapo_ray.agent.loop import AgentLoop, LoopSettings
    from rapo_ray.algos.loss import target_logprobs
    from rapo_ray.config import load_config
    from rapo_ray.core.devices import machine_record
    from rapo_ray.core.files import merge_json_entry
    from rapo_ray.engines import make_engine
    from rapo_ray.engines.vllm_engine import vllm_available
    from rapo_ray.envs.loaders import load_examples
    from rapo_ray.envs.suite import build_tools, to_task
    from rapo_ray.model.factory import (
        context_length,
        load_model,
        load_model_and_tokenizer,
        load_tokenizer,
    )
    from rapo_ray.pipelines.cold_start import checkpoint_named

    torch.set_num_threads(2)
    cfg = load_config(args.config, args.override)
    model_dir = checkpoint_named(cfg, args.checkpoint)
    examples, _ = load_examples(cfg.tasks.eval_files[0], limit=args.questions)
    tasks = [to_task(e) for e in examples]
    tools = build_tools(cfg.tasks, cfg.rollout, search_index=None)
    tok = load_tokenizer(model_dir)
    device = torch.device(args.device)
    learner = load_model(model_dir).to(device).eval()  # fp32 weights, as the learner keeps them

    def learner_logprobs(traj, bf16: bool) -> torch.Tensor:
        ids = torch.tensor([list(traj.prompt_ids) + list(traj.response_ids)], device=device)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = learner(input_ids=ids).logits[:, :-1].float()
        return target_logprobs(logits, ids)[0, len(traj.prompt_ids) - 1 :].cpu()

    rows = []
    for engine_name in args.engines.split(","):
        if engine_name == "vllm" and not vllm_available():
            print("vllm: does not import here, skipped")
            continue
        for dtype in args.dtypes.split(","):
            rollout = replace(cfg.rollout, engine=engine_name)
            t0 = time.perf_counter()
            try:
                engine = make_engine(
                    rollout,
                    model_dir,
                    load_model_and_tokenizer,
                    dtype=dtype,
                    max_model_len=context_length(model_dir),
                    device=args.device,
                )
            except Exception as exc:  # an engine that cannot run this dtype here is a result too
                rows.append({"engine": engine_name, "engine_dtype": dtype, "error": f"{type(exc).__name__}: {exc}"})
                print(f"{engine_name} {dtype}: {rows[-1]['error']}")
                continue
            try:
                settings = LoopSettings.from_config(cfg)
                settings.seed, settings.max_context = 0, context_length(model_dir)
                trajs, _ = AgentLoop(engine, tok, tools, settings).run_groups(tasks, 1)
            finally:
                engine.close()
            for learner_mode in ("fp32", "bf16"):
                gaps = []
                for t in trajs:
                    generated = torch.tensor(t.loss_mask, dtype=torch.bool)
                    mine = learner_logprobs(t, learner_mode == "bf16")[generated]
                    gaps.append((mine - torch.tensor(t.logprobs, dtype=torch.float32)[generated]).abs())
                gap = torch.cat(gaps)
                row = {
                    "engine": engine_name,
                    "engine_dtype": dtype,
                    "learner": learner_mode,
                    "tokens": int(gap.numel()),
                    "gap_mean": float(gap.mean()),
                    "gap_p99": float(torch.quantile(gap, 0.99)),
                    "gap_max": float(gap.max()),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
                rows.append(row)
                print(
                    f"{engine_name:6s} {dtype:9s} learner {learner_mode}: {row['tokens']} tokens, gap mean "
                    f"{row['gap_mean']:.2e} p99 {row['gap_p99']:.2e} max {row['gap_max']:.2e}"
                )
    tools.close()
    record = {
        "model_dir": str(model_dir),
        "checkpoint": args.checkpoint,
        "questions": len(tasks),
        "rows": rows,
        "machine": machine_record(),
    }
    print(f"wrote {merge_json_entry(args.out, args.device, record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
