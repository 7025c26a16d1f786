"""Peer comparison on CPU: TRL's GRPOTrainer and our GRPO on the same model, task, batch and step count.

    pip install -e '.[peer]'      # trl (optional)
    python benchmarks/peer_trl.py [--steps 6] [--prompts 4] [--group 16] [--max-tokens 96] [--repeats 3]

The task is what both trainers can run: single-turn generation. Each sample is one completion of the
bundled warm-started model on a bundled training question (the protocol's prompt), ending at the first
tool call, answer or EOS, or after ``--max-tokens``. TRL stops at the same tags (they are single tokens
of the bundled tokenizer, set as the model's EOS ids). Ours is ``jobs/train.py`` with
``rollout.max_tool_calls=0`` (the loop ends a trajectory at its first tool call), GRPO, no retrieval. Both:
G rollouts per prompt, ``--prompts`` prompts per step, temperature 1, one optimizer step per batch (our
mini-batch = the whole batch; TRL's batch = the whole generation batch), KL coefficient 0, the same
learning rate and the same reward function (``rapo_ray.envs.rewards.score``).

Measured per trainer: the wall time of each training step after the first (warm-up), samples/s =
samples per step / median step time, generated tokens/s = generated tokens (counted from the completion
ids, stop tag included) / step time; each trainer runs ``--repeats`` times and the table reports the
median over repeats. Our runs use the configured fleet (2 rollout workers with vLLM where it imports,
2 learners); TRL runs in one process with transformers' ``generate``, its default on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def common_overrides(args) -> list[str]:
    return [f"run.artifacts_dir={args.artifacts}", "tasks.system_prompt=short"] + list(args.overrides)


def ours(args, out: Path, repeat: int, model_dir: str) -> dict:
    name = f"ours-r{repeat}"
    run_dir = out / "runs" / name
    cmd = [
        sys.executable,
        str(REPO / "jobs" / "train.py"),
        "algo.name=grpo",
        f"algo.group_size={args.group}",
        "rollout.max_tool_calls=0",
        f"rollout.max_response_tokens={args.max_tokens}",
        f"rollout.max_step_tokens={args.max_tokens}",
        f"trainer.total_steps={args.steps}",
        f"trainer.prompts_per_step={args.prompts}",
        f"learner.mini_batch_size={args.prompts * args.group}",
        "learner.ppo_epochs=1",
        f"learner.lr={args.lr}",
        "trainer.eval_every=0",
        "trainer.eval_size=4",
        "checkpoint.every=0",
        f"trainer.seed={repeat}",
        f"run.output_dir={out / 'runs'}",
        f"run.name={name}",
        "run.progress=false",
        "run.tensorboard=false",
        f"model.path={model_dir}",
        *common_overrides(args),
    ]
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    log = out / f"{name}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if rc != 0:
        raise SystemExit(f"our run failed (exit {rc}); see {log}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "step_s" in m][1:]  # the first step warms up engines and learners
    return {
        "step_s": [m["step_s"] for m in steps],
        "tokens": [m["rollout_tokens"] for m in steps],
        "samples": args.prompts * args.group,
        "reward": statistics.mean(m["reward"] for m in steps),
    }


def trl_worker(args, model_dir: str, repeat: int) -> dict:
    """One TRL run in this process."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rapo_ray.config import load_config
    from rapo_ray.envs.rewards import score
    from rapo_ray.envs.suite import task_splits
    from rapo_ray.model.factory import load_model, load_tokenizer
    from rapo_ray.types import protocol

    cfg = load_config(overrides=common_overrides(args))
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir)
    stop_ids = [tok.convert_tokens_to_ids(t) for t in (*protocol.TOOL_STOPS, protocol.ANSWER_STOP)]
    model.generation_config.eos_token_id = [tok.eos_token_id, *stop_ids]
    model.generation_config.pad_token_id = tok.pad_token_id
    system = protocol.system_prompt_for(cfg.tasks.system_prompt, bundled=True)
    train, _ = task_splits(cfg.tasks)
    rows = [t for fam in sorted(train) for t in train[fam][:200]]
    data = Dataset.from_list(
        [
            {"prompt": protocol.render_prompt(t.question, system), "answers": list(t.answers), "kind": t.kind}
            for t in rows
        ]
    ).shuffle(seed=repeat)
    generated = []

    def reward(prompts, completions, completion_ids, answers, kind, **_):
        generated.append(sum(len(ids) for ids in completion_ids))
        return [
            score(tok.decode(ids, skip_special_tokens=False), a, k).reward
            for ids, a, k in zip(completion_ids, answers, kind)
        ]

    step_times, last = [], [None]

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            last[0] = time.perf_counter()

        def on_step_end(self, *_, **__):
            step_times.append(time.perf_counter() - last[0])

    batch = args.prompts * args.group
    conf = GRPOConfig(
        output_dir=str(Path(args.artifacts) / "peer_trl" / "trl_output"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        beta=0.0,
        num_iterations=1,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=repeat,
        disable_dropout=True,
        epsilon=0.28,
        epsilon_high=0.28,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=conf, train_dataset=data, processing_class=tok, callbacks=[Timer()]
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "step_s": step_times[1:],
        "tokens": generated[1 : len(step_times)],
        "samples": batch,
        "reward": statistics.mean(rewards[1:]) if len(rewards) > 1 else float("nan"),
        "torch_threads": torch.get_num_threads(),
    }


def summarize(runs: list[dict]) -> dict:
    per_run = []
    for r in runs:
        step = statistics.median(r["step_s"])
        per_run.append(
            {
                "step_s": step,
                "samples_per_s": r["samples"] / step,
                "tokens_per_s": statistics.median(t / s for t, s in zip(r["tokens"], r["step_s"])),
                "tokens_per_sample": statistics.mean(r["tokens"]) / r["samples"],
                "reward": r["reward"],
            }
        )
    return {k: statistics.median(p[k] for p in per_run) for k in per_run[0]} | {"runs": per_run}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--artifacts", default=str(REPO / "artifacts"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "peer_trl.json"))
    ap.add_argument("--trl-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="rapo_ray config overrides for both sides (model and task settings)")
    args = ap.parse_args()

    if args.trl_worker is not None:
        print("RESULT " + json.dumps(trl_worker(args, args.model, args.trl_worker)))
        return 0
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -e '.[peer]'") from None

    from rapo_ray.config import load_config
    from rapo_ray.pipelines.sft import warm_start

    out = Path(args.artifacts) / "peer_trl"  # run directories and logs; the JSON report goes to --out
    out.mkdir(parents=True, exist_ok=True)
    # the checkpoint both trainers start from: the bundled model's warm start of the default config
    model_dir = str(warm_start(load_config(overrides=[f"run.artifacts_dir={args.artifacts}"])))
    results = {"ours": [], "trl": []}
    for r in range(args.repeats):
        t0 = time.perf_counter()
        results["ours"].append(ours(args, out, r, model_dir))
        print(f"ours repeat {r}: {time.perf_counter() - t0:.0f} s", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--trl-worker",
                str(r),
                "--model",
                model_dir,
                "--steps",
                str(args.steps),
                "--prompts",
                str(args.prompts),
                "--group",
                str(args.group),
                "--max-tokens",
                str(args.max_tokens),
                "--lr",
                str(args.lr),
                "--artifacts",
                args.artifacts,
                "--out",
                args.out,
                *args.overrides,
            ],
            capture_output=True,
            text=True,
            env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            (out / f"trl-r{r}.log").write_text(proc.stdout + proc.stderr)
            raise SystemExit(f"TRL run failed (exit {proc.returncode}); see {out / f'trl-r{r}.log'}")
        results["trl"].append(json.loads(line[-1][7:]))
        print(f"trl repeat {r}: {time.perf_counter() - t0:.0f} s", flush=True)
    table = {k: summarize(v) for k, v in results.items()}
    ratio = {
        "samples_per_s": table["ours"]["samples_per_s"] / table["trl"]["samples_per_s"],
        "tokens_per_s": table["ours"]["tokens_per_s"] / table["trl"]["tokens_per_s"],
    }
    print(f"\n{'trainer':8} {'step s':>7} {'samples/s':>10} {'gen tok/s':>10} {'tok/sample':>10} {'reward':>7}")
    for k in ("ours", "trl"):
        t = table[k]
        print(
            f"{k:8} {t['step_s']:7.2f} {t['samples_per_s']:10.2f} {t['tokens_per_s']:10.1f} {t['tokens_per_sample']:10.1f} {t['reward']:7.3f}"
        )
    print(f"ours / TRL: samples/s {ratio['samples_per_s']:.2f}x, generated tokens/s {ratio['tokens_per_s']:.2f}x")
    Path(args.out).write_text(
        json.dumps({"config": vars(args), "model": model_dir, "table": table, "ratio": ratio, "raw": results}, indent=1)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
