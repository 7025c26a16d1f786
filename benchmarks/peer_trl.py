"""Peer comparison on CPU: TRL's GRPOTrainer and our GRPO on the same model, task, batch and step count.

    pip install -e '.[peer]'      # trl (optional)
    python benchmarks/peer_trl.py [--steps 6] [--prompts 4] [--group 16] [--max-tokens 96] [--repeats 3]
    python benchmarks/peer_trl.py --config configs/smollm2_gsm8k.yaml --prompts 2 --group 4 --max-tokens 320 \
        --lr 1e-6 --out benchmarks/results/peer_trl_smollm2.json      # the real model on GSM8K, single turn
    python benchmarks/peer_trl.py --config configs/smollm2_arith.yaml --tool-loop --prompts 2 --group 8 \
        --lr 1e-5 --steps 30 --repeats 1 --held-out 500 --out benchmarks/results/peer_trl_arith.json
                                                                      # the recipe as it trains: multi-turn, tool

--tool-loop (with a recipe's --config): both trainers train the recipe itself, the multi-turn python-tool loop. TRL
has no runner for the paper's ``<python>`` text protocol (its ``tools`` go through the chat template's own tool
format), so it gets the one a TRL user would write: GRPOTrainer's ``rollout_func`` running our agent loop
(``AgentLoop``, the python sandbox, the reward) on TRL's own model in its process, through our torch engine
(continuous batching; faster than ``generate``, TRL's CPU default), with tool-result tokens masked out of its loss
(``env_mask``). Both: the recipe's prompt, response budget and tool limit, its optimiser and learning-rate
schedule (TRL is handed ours: AdamW, ``lr_factor``'s warm-up), clip 0.28 both sides, no KL, token-mean loss,
group-std advantages, no activation checkpointing (TRL's default is on), no dynamic sampling (TRL has none; ours is
off, so a step has the same rollouts).
``--held-out N`` evaluates both trainers' final weights and their common start on the recipe's first N held-out
problems with ``jobs/evaluate.py`` (greedy, our fleet, the same for all), and reports the gain per hour of
training (the summed step times).

The task is what both trainers can run: single-turn generation (TRL's tool mode calls functions through the
model's own chat-template tool format, not the paper's ``<python>`` text protocol, so the multi-turn loop has
no TRL counterpart). Without --config: the bundled warm-started model on bundled training questions (the
protocol's prompt), each sample ending at the first tool call, answer or EOS, or after ``--max-tokens``; TRL
stops at the same tags (single tokens of the bundled tokenizer, set as the model's EOS ids). With --config (a
real model's recipe): the recipe's starting checkpoint (its cold start) on the recipe's training questions,
through the model's chat template, with a system prompt that asks for reasoning and a boxed answer and no tool
calls (``NO_TOOL_PROMPT``); a sample ends at EOS or after ``--max-tokens`` on TRL's side, and ours also at
``</answer>`` or a tool call's closing tag (multi-token strings that TRL's generate cannot stop at; how often
ours ended that way is reported as ``ended_at_tag``). Ours is ``jobs/train.py`` with ``rollout.max_tool_calls=0``
(the loop ends a trajectory at its first tool call), GRPO, no retrieval. Both: the same prompts in the same order
(TRL is fed the questions our run drew, step by step, unshuffled), G rollouts per prompt, ``--prompts`` prompts
per step, temperature 1, one optimizer step per batch (our mini-batch = the whole batch; TRL's batch = the whole
generation batch), KL coefficient 0, the same learning rate and the same reward function
(``rapo_ray.envs.rewards.score``).

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
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from benchmarks.trl_rollout import tool_loop_rollout
from rapo_ray.config import load_config
from rapo_ray.core.devices import machine_record
from rapo_ray.pipelines.cold_start import checkpoint_named
from rapo_ray.pipelines.sft import warm_start
from rapo_ray.training.reporting import read_metrics

REPO = Path(__file__).resolve().parents[1]
NO_TOOL_PROMPT = (
    "Solve the problem step by step inside <think> </think>, then give the final answer as "
    "<answer>\\boxed{...}</answer>. Do not call tools."
)


def common_overrides(args) -> list[str]:
    if getattr(args, "tool_loop", False):  # the recipe as it is: its own prompt and tools
        budget = [f"rollout.max_response_tokens={args.max_tokens}"] if args.max_tokens else []
        return [f"run.artifacts_dir={args.artifacts}", *budget] + list(args.overrides)
    prompt = f"tasks.system_prompt={NO_TOOL_PROMPT}" if args.config else "tasks.system_prompt=short"
    return [f"run.artifacts_dir={args.artifacts}", prompt] + list(args.overrides)


def prompt_order(run_dir: Path) -> list[str]:
    """The problem ids a run drew, step by step, each step's in the order its groups were stored."""
    ids = []
    for f in sorted((run_dir / "trajectories").glob("step-*.parquet")):
        ids += dict.fromkeys(pq.read_table(f, columns=["problem_id"]).column("problem_id").to_pylist())
    return ids


def ours(args, out: Path, repeat: int, model_dir: str) -> dict:
    name = f"ours-r{repeat}"
    run_dir = out / "runs" / name
    cmd = [
        sys.executable,
        str(REPO / "jobs" / "train.py"),
        *(["--config", args.config] if args.config else []),
        "algo.name=grpo",
        f"algo.group_size={args.group}",
        *(
            ["trainer.dynamic_sampling=false"]  # TRL refills nothing: the same rollouts a step on both sides
            if args.tool_loop
            else [
                "rollout.max_tool_calls=0",
                f"rollout.max_response_tokens={args.max_tokens}",
                f"rollout.max_step_tokens={args.max_tokens}",
            ]
        ),
        f"trainer.total_steps={args.steps}",
        f"trainer.prompts_per_step={args.prompts}",
        f"learner.mini_batch_size={args.prompts * args.group}",
        "learner.ppo_epochs=1",
        f"learner.lr={args.lr}",
        "trainer.eval_every=0",
        "trainer.eval_size=4",
        "tasks.eval_limit=4",
        "checkpoint.every=0",
        f"trainer.seed={repeat}",
        f"run.output_dir={out / 'runs'}",
        f"run.name={name}",
        "run.progress=false",
        "run.tensorboard=false",
        f"model.path={model_dir}",
        # a recipe's model is its preset plus a cold start: both sides start from that cold start as it is
        *(["model.preset=", "cold_start.examples=0"] if args.config else []),
        *common_overrides(args),
    ]
    if run_dir.exists():
        shutil.rmtree(run_dir)
    log = out / f"{name}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if rc != 0:
        raise SystemExit(f"our run failed (exit {rc}); see {log}")
    steps = read_metrics(run_dir, steps_only=True)
    reasons = [
        r
        for f in sorted((run_dir / "trajectories").glob("step-*.parquet"))
        for r in pq.read_table(f, columns=["finish_reason"]).column("finish_reason").to_pylist()
    ]
    return {
        "step_s": [m["step_s"] for m in steps[1:]],  # the first step warms up engines and learners
        "train_s": sum(m["step_s"] for m in steps),
        "model": str(run_dir),
        "tokens": [m["rollout_tokens"] for m in steps[1:]],
        "samples": args.prompts * args.group,
        "reward": statistics.mean(m["reward"] for m in steps[1:]),
        "reward_curve": [m["reward"] for m in steps],
        "finish_reasons": {k: reasons.count(k) for k in sorted(set(reasons))},
        "prompt_order": prompt_order(run_dir),
    }


def trl_worker(args, model_dir: str, repeat: int, order: list[str]) -> dict:
    """One TRL run in this process, on the questions ``order`` (our run's problem ids, step by step)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rapo_ray.algos.lr_schedule import lr_factor
    from rapo_ray.config import load_config
    from rapo_ray.envs.rewards import score
    from rapo_ray.envs.suite import task_splits
    from rapo_ray.model.factory import load_model, load_tokenizer
    from rapo_ray.types import protocol

    cfg = load_config(args.config, overrides=common_overrides(args))
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir)
    system = protocol.system_prompt_for(cfg.tasks.system_prompt, bundled=cfg.model.bundled)
    if cfg.model.bundled:  # the protocol's tags are single tokens here: TRL stops at them as EOS ids
        stop_ids = [tok.convert_tokens_to_ids(t) for t in (*protocol.TOOL_STOPS, protocol.ANSWER_STOP)]
        model.generation_config.eos_token_id = [tok.eos_token_id, *stop_ids]
    model.generation_config.pad_token_id = tok.pad_token_id
    train, _ = task_splits(cfg.tasks)
    by_id = {t.id: t for fam in train.values() for t in fam}
    missing = [i for i in order if i not in by_id]
    if missing:
        raise SystemExit(f"our run drew problems that the config's tasks do not hold: {missing[:3]}")

    def prompt(t):
        if args.tool_loop:  # the rollout function renders the recipe's own prompt from the task
            return t.id
        if cfg.model.bundled:
            return protocol.render_prompt(t.question, system)
        return [{"role": "system", "content": system}, {"role": "user", "content": t.question}]  # chat template

    rows = [by_id[i] for i in order]
    data = Dataset.from_list([{"prompt": prompt(t), "answers": list(t.answers), "kind": t.kind} for t in rows])
    generated = []

    def reward(prompts, completions, completion_ids, answers, kind, loop_reward=None, **_):
        generated.append(sum(len(ids) for ids in completion_ids))
        if loop_reward is not None:  # --tool-loop: the agent loop scored each trajectory as our trainer does
            return list(loop_reward)
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
    extra, optimizers = {}, (None, None)
    if args.tool_loop:
        extra["rollout_func"] = tool_loop_rollout(cfg, tok, by_id, seed=repeat)
        # our learner's optimiser and schedule (rapo_ray/workers/learner.py), so both sides take the same steps
        lc = cfg.learner
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=lc.weight_decay, betas=(0.9, 0.999))
        total = args.steps
        schedule = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda k: lr_factor(k, total, lc.warmup_steps, lc.lr_schedule, lc.lr_min_ratio)
        )
        optimizers = (opt, schedule)
    conf = GRPOConfig(
        output_dir=str(Path(args.artifacts) / "peer_trl" / "trl_output"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_tokens or cfg.rollout.max_response_tokens,
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
        # TRL turns activation checkpointing on by default; ours is off (learner.gradient_checkpointing), and at this
        # model's size on a CPU it only recomputes activations: off on both sides
        gradient_checkpointing=False,
        epsilon=0.28,
        epsilon_high=0.28,
        shuffle_dataset=False,  # the questions in our run's order
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=conf,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Timer()],
        optimizers=optimizers,
        **extra,
    )
    trainer.train()
    if "rollout_func" in extra:
        extra["rollout_func"].close()
    saved = None
    if args.held_out:  # the final weights, for jobs/evaluate.py in the parent
        saved = Path(args.artifacts) / "peer_trl" / f"trl-r{repeat}-model"
        trainer.save_model(str(saved))
        tok.save_pretrained(str(saved))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "step_s": step_times[1:],
        "train_s": sum(step_times),
        "model": str(saved) if saved else None,
        "tokens": generated[1 : len(step_times)],
        "samples": batch,
        "reward": statistics.mean(rewards[1:]) if len(rewards) > 1 else float("nan"),
        "reward_curve": rewards,
        "torch_threads": torch.get_num_threads(),
    }


def held_out(args, checkpoint: str, dest: Path, baseline: Path | None) -> dict:
    """``jobs/evaluate.py`` on the recipe's first ``--held-out`` test problems (greedy, our fleet): its JSON."""
    cmd = [
        sys.executable,
        str(REPO / "jobs" / "evaluate.py"),
        "--config",
        args.config,
        "--checkpoint",
        checkpoint,
        "--datasets",
        "bundled",
        "--limit",
        str(args.held_out),
        "--out",
        str(dest),
        *(["--baseline", str(baseline)] if baseline else []),
        *common_overrides(args),
    ]
    log = dest.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if rc != 0:
        raise SystemExit(f"the held-out evaluation of {checkpoint} failed (exit {rc}); see {log}")
    return json.loads(dest.read_text())


def gain_per_hour(before: dict, after: dict, train_s: float) -> dict:
    """Held-out accuracy before and after (the mean over the evaluation's datasets), the paired change against the
    start, and the gain per hour of training (``train_s``: the summed step times)."""
    acc = lambda e: statistics.mean(r["accuracy"] for r in e["results"].values())  # noqa: E731
    change = next(iter(after.get("paired_change", {}).values()), {})
    gain = acc(after) - acc(before)
    return {
        "before": acc(before),
        "after": acc(after),
        "gain": gain,
        "fixed": change.get("fixed"),
        "broken": change.get("broken"),
        "p_value": change.get("p_value"),
        "train_h": train_s / 3600,
        "gain_per_hour": gain / (train_s / 3600) if train_s > 0 else float("nan"),
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
                **({"held_out": r["held_out"]} if "held_out" in r else {}),
            }
        )
    numbers = [k for k in per_run[0] if k != "held_out"]
    out = {k: statistics.median(p[k] for p in per_run) for k in numbers}
    if "held_out" in per_run[0]:
        out["gain_per_hour"] = statistics.median(p["held_out"]["gain_per_hour"] for p in per_run)
    return out | {"runs": per_run}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="a real model's recipe (both sides start from its cold start)")
    ap.add_argument("--checkpoint", default="cold-start", help="with --config: base | cold-start | an HF folder")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="response budget of a sample (default: 96; with --tool-loop, the recipe's rollout.max_response_tokens)",
    )
    ap.add_argument(
        "--tool-loop",
        action="store_true",
        help="with --config: both trainers run the recipe's multi-turn python-tool loop (TRL through rollout_func)",
    )
    ap.add_argument(
        "--held-out",
        type=int,
        default=0,
        help="evaluate the start and each trainer's final weights on this many of the recipe's held-out problems",
    )
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--artifacts", default=str(REPO / "artifacts"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "peer_trl.json"))
    ap.add_argument("--trl-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--order", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="rapo_ray config overrides for both sides (model and task settings)")
    args = ap.parse_args()
    if args.tool_loop and not args.config:
        raise SystemExit("--tool-loop runs a recipe's own loop: give its --config")
    if args.max_tokens is None and not args.tool_loop:
        args.max_tokens = 96

    if args.trl_worker is not None:
        order = json.loads(Path(args.order).read_text())
        print("RESULT " + json.dumps(trl_worker(args, args.model, args.trl_worker, order)))
        return 0
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -e '.[peer]'") from None

    out = Path(args.artifacts) / "peer_trl"  # run directories and logs; the JSON report goes to --out
    out.mkdir(parents=True, exist_ok=True)
    # the checkpoint both trainers start from: the recipe's cold start, or the bundled model's warm start
    cfg = load_config(args.config, [f"run.artifacts_dir={args.artifacts}"])
    model_dir = str(checkpoint_named(cfg, args.checkpoint) if args.config else warm_start(cfg))
    results = {"ours": [], "trl": []}
    before_json = out / "eval-start.json"
    before = held_out(args, model_dir, before_json, None) if args.held_out else None
    for r in range(args.repeats):
        t0 = time.perf_counter()
        results["ours"].append(ours(args, out, r, model_dir))
        print(f"ours repeat {r}: {time.perf_counter() - t0:.0f} s", flush=True)
        order = out / f"order-r{r}.json"
        order.write_text(json.dumps(results["ours"][-1]["prompt_order"]))
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--trl-worker",
                str(r),
                "--model",
                model_dir,
                "--order",
                str(order),
                *(["--config", args.config] if args.config else []),
                "--steps",
                str(args.steps),
                "--prompts",
                str(args.prompts),
                "--group",
                str(args.group),
                *(["--max-tokens", str(args.max_tokens)] if args.max_tokens else []),
                *(["--tool-loop"] if args.tool_loop else []),
                "--held-out",
                str(args.held_out),
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
        for side in ("ours", "trl") if before else ():
            run = results[side][-1]
            after = held_out(args, run["model"], out / f"eval-{side}-r{r}.json", before_json)
            run["held_out"] = gain_per_hour(before, after, run["train_s"])
            h = run["held_out"]
            print(
                f"{side} repeat {r}: held-out {h['before']:.3f} -> {h['after']:.3f} in {h['train_h']:.2f} h of "
                f"training ({h['gain_per_hour']:+.3f} per hour; {h['fixed']} fixed / {h['broken']} broken, "
                f"p = {h['p_value']})",
                flush=True,
            )
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
    if before:
        ratio["gain_per_hour"] = (
            table["ours"]["gain_per_hour"] / table["trl"]["gain_per_hour"]
            if table["trl"]["gain_per_hour"]
            else float("nan")
        )
        for k in ("ours", "trl"):
            print(f"{k}: held-out gain per hour of training {table[k]['gain_per_hour']:+.3f} (median over repeats)")
    for k in ("ours", "trl"):
        for r, run in enumerate(results[k]):
            print(f"{k} repeat {r} reward per step: " + " ".join(f"{x:+.3f}" for x in run["reward_curve"]))
    reasons = [run["finish_reasons"] for run in results["ours"]]
    kinds = sorted({k for r in reasons for k in r})
    print("ours, how samples ended: " + ", ".join(f"{k} {sum(r.get(k, 0) for r in reasons)}" for k in kinds))
    Path(args.out).write_text(
        json.dumps(
            {
                "config": vars(args),
                "model": model_dir,
                "machine": machine_record(),
                "table": table,
                "ratio": ratio,
                "raw": results,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
