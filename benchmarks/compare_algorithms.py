"""GRPO vs ARPO vs RAPO (and RAPO's two main ablations) under one compute budget, several seeds each.

    python benchmarks/compare_algorithms.py [--steps 30] [--prompts 4] [--seeds 0,1,2] [--artifacts artifacts]
    python benchmarks/compare_algorithms.py --config configs/smollm2_gsm8k.yaml --seeds 0,1,2 \
        --report benchmarks/results/compare_smollm2.json          # the real model: the recipe's own batch and steps

Every run is `jobs/train.py` with the same model, warm start (or cold start), buffer, data, steps, prompts per
step and rollouts per prompt; only the algorithm differs. Without --config, the bundled default job with
--steps 30 --prompts 4 --eval-size 100; with it, the config's own values unless given. Runs already finished
(summary.json present) are reused, so an interrupted comparison continues where it stopped; --include-report adds
the runs of an earlier report of the same experiment (seeds run elsewhere). Writes the JSON report, the curves (per
step and per wall-clock second) and prints the markdown tables that docs/RESULTS.md holds.

Each run's step time is also given in units of the box's speed, timed by a small fixed workload every second while
the run goes (box_load.BoxLoad's probe): on a shared VM the host's speed drifts enough within minutes to swamp a
step-time ratio between two runs. The probe shares the cores with the run, so it is a record of the box's speed to
read beside the raw ratio, not a correction of it: the matmul probe slows with the run's own load (docs/RESULTS.md,
Performance by component).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from benchmarks.box_load import BoxLoad
from rapo_ray.agent.evaluation import paired_change, sign_test_p
from rapo_ray.agent.turns import answer_handed
from rapo_ray.config import load_config
from rapo_ray.config.load import diff_configs, flat_config, from_dict, to_dict
from rapo_ray.core.devices import machine_record
from rapo_ray.core.files import write_json_atomic
from rapo_ray.envs import tasks as bundled
from rapo_ray.model.factory import load_tokenizer, resolve_model_dir
from rapo_ray.pipelines.sft import warm_start_dir
from rapo_ray.training.reporting import read_metrics
from rapo_ray.types import protocol

REPO = Path(__file__).resolve().parents[1]
BOX_LOAD = "box_load.json"  # in a run's folder: the box's CPU states and other processes while it ran
PROBE_INTERVAL_S = 1.0  # how often the box's speed is timed during a run (box_load.speed_round, small)
PROBES = ("python_s", "matmul_s")  # the probe's two timings: a Python loop and float32 matmuls on one thread

METHODS = {
    "grpo": ["algo.name=grpo"],
    "arpo": ["algo.name=arpo"],  # N full samples = the config's algo.arpo.initial_rollouts (half the group)
    "rapo": ["algo.name=rapo"],
    "rapo w/o RR": ["algo.name=rapo", "algo.rapo.use_retrieval_reward=false"],
    "rapo w/o RIS": ["algo.name=rapo", "algo.rapo.use_importance_shaping=false"],
    # not a paper arm: retrieval restricted to the querying question's own stored steps (a diagnosis of
    # what nearest-by-history retrieval returns on templated problems; see docs/RESULTS.md)
    "rapo own-question": ["algo.name=rapo", "retrieval.question_scope=own"],
    # not a paper arm: only other questions' steps, so a retrieved step can help only by a move that transfers
    "rapo other-question": ["algo.name=rapo", "retrieval.question_scope=other"],
    # not a paper arm: an answer that only a retrieved step showed earns 0 (algo.rapo.reward_retrieved_answers)
    "rapo handed-unpaid": ["algo.name=rapo", "algo.rapo.reward_retrieved_answers=false"],
    # the buffer's source (data-file tasks only): human GSM8K calculator steps instead of the policy's own samples
    "rapo solutions-buffer": ["algo.name=rapo", "retrieval.buffer_source=solutions"],
    # the step-retrieval backend (retrieval.embedder): "rapo" runs the default (bm25), these name theirs
    "rapo minilm": ["algo.name=rapo", "retrieval.embedder=minilm"],
    "rapo onnx-int8": ["algo.name=rapo", "retrieval.embedder=minilm-onnx-int8"],
    "rapo bm25": ["algo.name=rapo", "retrieval.embedder=bm25"],
    # bounded staleness (algo.max_staleness=1): the next step rolls out during the update, with the decoupled loss
    "grpo async-1": ["algo.name=grpo", "algo.max_staleness=1", "algo.behaviour_correction=truncate"],
    "rapo async-1": ["algo.name=rapo", "algo.max_staleness=1", "algo.behaviour_correction=truncate"],
}
TOOL_OPEN_TAGS = (protocol.PYTHON[0], protocol.SEARCH[0])
DEFAULT_METHODS = ["grpo", "arpo", "rapo", "rapo w/o RR", "rapo w/o RIS"]
PIPELINE_KEYS = ("ahead_rollout_s", "learner_wait_s", "staleness_mean")
REWARD_KEYS = ("on_policy_reward", "hybrid_reward", "retrieval_reward")  # means over the run's steps
STEP_KEYS = (
    "step_s",
    "rollout_s",
    "retrieve_s",
    "old_logprob_s",
    "update_s",
    "sync_s",
    "rollout_tokens",
    "tool_calls",
    "retrievals",
    "learner_tokens_per_s",
)


def train_once(name: str, overrides: list[str], seed: int, args, out: Path) -> Path | None:
    """``jobs/train.py`` as run ``name`` under ``out/runs`` with the comparison's budget (``args``: config, steps,
    prompts, eval_size, artifacts, overrides) and ``overrides``; a finished run (summary.json) is reused when its
    saved config is the one this call asks for (a run from before a default changed is refused, not mixed in), an
    interrupted one started again. Returns the run folder, None when the job failed (its log is named)."""
    run_dir = out / "runs" / name
    run_overrides = [
        *overrides,
        f"trainer.seed={seed}",
        *([f"trainer.total_steps={args.steps}"] if args.steps else []),
        *([f"trainer.prompts_per_step={args.prompts}"] if args.prompts else []),
        # the bundled job is compared on its end points only; a recipe keeps its own held-out curve (trainer.eval_every)
        *([] if args.config else ["trainer.eval_every=0"]),
        *([f"trainer.eval_size={args.eval_size}"] if args.eval_size else []),
        "checkpoint.every=0",
        f"run.output_dir={out / 'runs'}",
        f"run.name={name}",
        f"run.artifacts_dir={args.artifacts}",
        "run.progress=false",
        "run.tensorboard=false",
        *args.overrides,
    ]
    if (run_dir / "summary.json").is_file():
        stale = config_change(run_dir, args.config, run_overrides)
        if stale:
            sys.exit(f"{run_dir} is a finished run of another config ({stale}); remove it or give --out another folder")
        return run_dir
    cmd = [sys.executable, str(REPO / "jobs" / "train.py"), *(["--config", args.config] if args.config else [])]
    if run_dir.exists():  # an interrupted run: start it again from scratch
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # what else ran meanwhile (leftovers of the run before, the box's steal), and the box's own speed each second
    load = BoxLoad(probe_interval=PROBE_INTERVAL_S).start()
    with open(log, "w") as f:
        rc = subprocess.run([*cmd, *run_overrides], stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    box = load.stop()
    if rc != 0:
        print(f"{name}: FAILED (exit {rc}); see {log}", flush=True)
        return None
    write_json_atomic(run_dir / BOX_LOAD, box)
    print(
        f"{name}: {time.perf_counter() - t0:.0f} s (CPU time stolen {box['states']['steal']:.1%}; "
        f"processes older than the run {box['older_cpu_s']:.0f} CPU-s)",
        flush=True,
    )
    return run_dir


def config_change(run_dir: Path, config: str | None, overrides: list[str]) -> str:
    """How the config saved in finished run ``run_dir`` differs from the one ``config`` + ``overrides`` gives today
    ("key: saved -> now", ...), ignoring where runs go, checkpointing and the CPU shares a launch fits to the
    machine; empty when they agree."""
    want = load_config(config, overrides)
    try:
        saved = from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    except (OSError, ValueError, yaml.YAMLError) as exc:  # (ConfigError is a ValueError) a run from an older schema
        return f"its config.yaml does not load today: {exc}"
    was, now = flat_config(to_dict(saved)), flat_config(to_dict(want))
    keys = diff_configs(saved, want, ignore=("run.", "checkpoint.", "resources."))
    return ", ".join(f"{k}: {was[k]!r} -> {now.get(k)!r}" for k in keys)


def run_order(methods: list[str], turn: int) -> list[str]:
    """The arms in the order seed number ``turn`` (0, 1, ...) runs them: rotated by one per seed, so that no arm
    always runs first or last (on a shared box the stages of later runs in a round were measured slower)."""
    k = turn % len(methods)
    return methods[k:] + methods[:k]


def run_one(method: str, seed: int, args, out: Path) -> dict | None:
    run_dir = train_once(f"{method.replace(' ', '_').replace('/', '')}-s{seed}", METHODS[method], seed, args, out)
    if run_dir is None:
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "reward" in m]
    box_record = json.loads(box.read_text()) if (box := run_dir / BOX_LOAD).is_file() else {}
    return {
        "method": method,
        "seed": seed,
        "before": summary["before"],
        "after": summary["after"],
        "paired_change": summary.get("paired_change", {}),
        "curve": [(m["step"], m["reward"]) for m in steps],
        # held-out accuracy at step 0 (before), every trainer.eval_every steps, and after
        "eval_curve": eval_curve(metrics, summary["before"]),
        "wall": list(itertools.accumulate(m["step_s"] for m in steps)),  # seconds of training after each step
        "group_size": yaml.safe_load((run_dir / "config.yaml").read_text())["algo"]["group_size"],
        "per_step": {k: statistics.median(m[k] for m in steps) for k in STEP_KEYS if steps and k in steps[0]},
        # the step's seconds divided by the box's speed probe while it ran: a record beside step_s, not a correction
        "per_step_in_probes": speed_normalized(steps, box_record.get("speed_rounds", [])),
        # algo.max_staleness >= 1: the rollouts made during updates and the wait for the learners after them
        "pipelining": {
            k: statistics.median(m[k] for m in steps if k in m) for k in PIPELINE_KEYS if any(k in m for m in steps)
        },
        "staleness_lags": summary.get("staleness_lags", {}),  # trajectories per policy-version lag at their update
        "rewards": {k: statistics.mean(m[k] for m in steps) for k in REWARD_KEYS if steps and k in steps[0]},
        "slot_success": slot_success(run_dir),
        "retrieved_wins": retrieved_wins(run_dir),
        "retrieved_steps": retrieved_step_use(run_dir),
        "box": {k: v for k, v in box_record.items() if k != "speed_rounds"} or None,
        # problem id -> solved after training (greedy, held-out): the paired test between methods
        "after_problems": json.loads(after.read_text()).get("problems", {})
        if (after := run_dir / "eval_after.json").is_file()
        else {},
    }


def eval_curve(metrics: list[dict], before: dict) -> list[tuple[int, float]]:
    """(step, held-out mean accuracy) of a run from its metrics, starting at step 0 with ``before`` (its summary's:
    runs before the launcher logged it at step 0 have it only there)."""
    curve = [(m["step"], m["eval/mean_accuracy"]) for m in metrics if "eval/mean_accuracy" in m]
    return curve if curve and curve[0][0] == 0 else [(0, before["eval/mean_accuracy"]), *curve]


def speed_normalized(steps: list[dict], rounds: list[dict]) -> dict[str, float]:
    """The run's median step in units of the box's speed probe: for each step (``time``: when it ended, ``step_s``)
    its seconds over the mean probe time of the rounds that started within it (the nearest round where none did),
    per probe (``PROBES``): identical work measures the same on a host that ran it slower as far as the probe slowed
    alike, and a run's own load slows the probe too. Empty without probe rounds or step times (older runs)."""
    timed = [m for m in steps if "time" in m]
    if not rounds or not timed:
        return {}
    out = {}
    for probe in PROBES:
        ratios = []
        for m in timed:
            start, end = m["time"] - m["step_s"], m["time"]
            inside = [r[probe] for r in rounds if start <= r["wall"] <= end]
            if not inside:
                inside = [min(rounds, key=lambda r: abs(r["wall"] - (start + end) / 2))[probe]]
            ratios.append(m["step_s"] / statistics.mean(inside))
        out[probe] = round(statistics.median(ratios), 2)
    return out


def slot_success(run_dir: Path) -> dict:
    """Training-rollout success rate per task family and slot kind over the whole run, with hybrid slots split
    by whether a step was actually retrieved into them (from the run's trajectories/*.parquet)."""
    counts: dict[str, list[int]] = {}
    for f in sorted((run_dir / "trajectories").glob("step-*.parquet")):
        for r in pq.read_table(f, columns=["problem_id", "slot_kind", "correct", "num_retrievals"]).to_pylist():
            kind = (
                "retrieved"
                if r["num_retrievals"]
                else ("hybrid, none retrieved" if r["slot_kind"] == "hybrid" else r["slot_kind"])
            )
            c = counts.setdefault(f"{r['problem_id'].split('-')[0]} {kind}", [0, 0])
            c[0], c[1] = c[0] + int(r["correct"]), c[1] + 1
    return {k: c / n for k, (c, n) in sorted(counts.items())}


def run_tokenizer(run_dir: Path, cfg):
    """The tokenizer that wrote a run's trajectories: its last checkpoint's, else its starting model's."""
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    if checkpoints:
        return load_tokenizer(checkpoints[-1])
    return load_tokenizer(warm_start_dir(cfg) if cfg.model.bundled else resolve_model_dir(cfg, log=lambda *_: None))


def retrieved_wins(run_dir: Path) -> dict:
    """What the rewarded training rollouts with a retrieved step did themselves, per search family (multihop,
    alias: a problem's expert path is its list of searches). ``answer_in_retrieved``: the answer is an entity
    that a retrieved block showed; ``own_wrong_search``: the rollout made a search of its own that is off the
    expert's path, so the reward credited a wrong step (the answer-leak trap of TASK_DESIGN_NOTES)."""
    cfg = load_config(run_dir / "config.yaml", [])
    expert = {
        p.id: {call for _, _, call, _ in p.expert_steps}
        for fam in cfg.tasks.families
        if bundled.TASK_FAMILIES[fam].tool == "search"
        for p in bundled.generate(fam, "train", cfg.tasks.train_size, cfg.tasks.seed)
    }
    if not expert:
        return {}
    tok = run_tokenizer(run_dir, cfg)
    cols = ["problem_id", "response_ids", "segments", "correct", "num_retrievals", "answer"]
    counts: dict[str, list[int]] = {}
    for f in sorted((run_dir / "trajectories").glob("step-*.parquet")):
        for r in pq.read_table(f, columns=cols).to_pylist():
            if not (r["correct"] and r["num_retrievals"] and r["problem_id"] in expert):
                continue
            text = segment_texts(tok, r)
            shown, off_path = leak_flags(text["generated"], text["retrieved"], r["answer"], expert[r["problem_id"]])
            c = counts.setdefault(r["problem_id"].split("-")[0], [0, 0, 0])
            c[0], c[1], c[2] = c[0] + 1, c[1] + int(shown), c[2] + int(off_path)
    return {
        fam: {"rewarded": n, "answer_in_retrieved": a / n, "own_wrong_search": w / n}
        for fam, (n, a, w) in sorted(counts.items())
    }


def segment_texts(tok, row: dict) -> dict[str, str]:
    """A trajectory row's response text by segment kind (generated, tool_result, retrieved), each in order."""
    text = {"generated": "", "tool_result": "", "retrieved": ""}
    for seg in row["segments"]:
        if seg["kind"] in text:
            text[seg["kind"]] += tok.decode(row["response_ids"][seg["start"] : seg["end"]])
    return text


def retrieved_step_use(run_dir: Path) -> dict:
    """How the training rollouts with a retrieved step used it, per task family (any task, the real model's
    GSM8K included): ``next_steps`` generated steps directly after a retrieved block, ``next_step_tool_call``
    the share of them that open a tool call which then ran (a tool result follows), ``answered`` those rollouts
    that gave an answer, and ``answer_handed`` the share of those whose answer a retrieved block showed and none
    of their own tool results produced (``agent.turns.answer_handed``, the leak), correct or not."""
    cfg = load_config(run_dir / "config.yaml", [])
    tok = None
    cols = ["problem_id", "response_ids", "segments", "num_retrievals", "answer"]
    counts: dict[str, list[int]] = {}
    for f in sorted((run_dir / "trajectories").glob("step-*.parquet")):
        for r in pq.read_table(f, columns=cols).to_pylist():
            if not r["num_retrievals"]:
                continue
            tok = tok or run_tokenizer(run_dir, cfg)
            c = counts.setdefault(r["problem_id"].split("-")[0], [0, 0, 0, 0])
            nxt, call = next_step_calls(tok, r)
            c[0], c[1] = c[0] + nxt, c[1] + call
            if r["answer"]:
                text = segment_texts(tok, r)
                c[2] += 1
                c[3] += int(answer_handed(r["answer"], text["retrieved"], text["tool_result"]))
    return {
        fam: {
            "next_steps": n,
            "next_step_tool_call": call / n if n else 0.0,
            "answered": a,
            "answer_handed": h / a if a else 0.0,
        }
        for fam, (n, call, a, h) in sorted(counts.items())
    }


def next_step_calls(tok, row: dict) -> tuple[int, int]:
    """(generated steps that directly follow a retrieved block, how many of them open a tool call that ran)."""
    segs, nxt, call = row["segments"], 0, 0
    for i, seg in enumerate(segs[:-1]):
        if seg["kind"] == "retrieved" and segs[i + 1]["kind"] == "generated":
            nxt += 1
            step = tok.decode(row["response_ids"][segs[i + 1]["start"] : segs[i + 1]["end"]])
            ran = i + 2 < len(segs) and segs[i + 2]["kind"] == "tool_result"
            call += int(ran and any(tag in step for tag in TOOL_OPEN_TAGS))
    return nxt, call


def leak_flags(generated: str, retrieved: str, answer: str, expert_calls: set[str]) -> tuple[bool, bool]:
    """For one rollout: (its answer is text that a retrieved block showed, one of its own searches is not among
    the expert's ``expert_calls``). ``generated`` / ``retrieved``: the rollout's own and retrieved text."""
    own = re.findall(r"<search>(.*?)</search>", generated, flags=re.S)
    return bool(answer) and answer in retrieved, any(q.strip() not in expert_calls for q in own)


def paired_vs(results: list[dict], method: str, baseline: str, family: str) -> dict | None:
    """Held-out problems of ``family`` solved by ``method`` but not ``baseline`` and the reverse, pooled over the
    seeds both ran (a problem under seed s is paired with itself under seed s), with the exact sign test."""
    by = {(r["method"], r["seed"]): r["after_problems"] for r in results if r.get("after_problems")}
    seeds = sorted({s for m, s in by if m == method} & {s for m, s in by if m == baseline})
    if not seeds:
        return None

    def solved(m):
        return {f"{s}:{pid}": ok for s in seeds for pid, ok in by[(m, s)].items() if pid.startswith(f"{family}-")}

    change = paired_change(solved(baseline), solved(method))  # "fixed": method right where the baseline was wrong
    return {"seeds": seeds, **change}


def baselines(results: list[dict]) -> list[tuple[str, str]]:
    """The (method, baseline) pairs the held-out test compares: every method against GRPO, and each RAPO variant
    (``rapo <variant>``: an ablation, a backend, a schedule) against RAPO itself, where both ran."""
    ran = {r["method"] for r in results}
    pairs = [(m, "grpo") for m in METHODS if m in ran and m != "grpo" and "grpo" in ran]
    return pairs + [(m, "rapo") for m in METHODS if m in ran and m.startswith("rapo ") and "rapo" in ran]


def held_out_change(results: list[dict], fams: list[str]) -> list[str]:
    """Markdown rows: each run's held-out change from its starting policy (its summary's paired test), then per
    method and family the flips pooled over its seeds with the exact sign test (a problem under each seed is a pair)."""
    lines = [
        "",
        "| method | family | seed | before | after | fixed | broken | sign test p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method in METHODS:
        rs = sorted((r for r in results if r["method"] == method), key=lambda r: r["seed"])
        for fam in fams:
            runs = [(r, r["paired_change"][fam]) for r in rs if fam in r.get("paired_change", {})]
            for r, c in runs:
                before, after = r["before"][f"eval/{fam}/accuracy"], r["after"][f"eval/{fam}/accuracy"]
                lines.append(
                    f"| {method} | {fam} | {r['seed']} | {before:.3f} | {after:.3f} | {c['fixed']} | {c['broken']} | "
                    f"{c['p_value']:.2g} |"
                )
            if len(runs) > 1:
                fixed, broken = sum(c["fixed"] for _, c in runs), sum(c["broken"] for _, c in runs)
                lines.append(
                    f"| {method} | {fam} | pooled ({len(runs)}) | | | {fixed} | {broken} | {sign_test_p(fixed, broken):.2g} |"
                )
    return lines


def _ms(xs) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def tables(results: list[dict]) -> str:
    fams = sorted(
        {k.split("/")[1] for r in results for k in r["after"] if k.endswith("/accuracy") and k != "eval/mean_accuracy"}
    )
    lines = [
        "| method | " + " | ".join(f"{f} acc" for f in fams) + " | mean acc | Δ mean vs before |",
        "|---|" + "---|" * (len(fams) + 2),
    ]
    for method in METHODS:
        rs = [r for r in results if r["method"] == method]
        if not rs:
            continue
        cells = [_ms([r["after"][f"eval/{f}/accuracy"] for r in rs]) for f in fams]
        mean = [r["after"]["eval/mean_accuracy"] for r in rs]
        delta = [r["after"]["eval/mean_accuracy"] - r["before"]["eval/mean_accuracy"] for r in rs]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {_ms(mean)} | {_ms(delta)} |")
    lines += held_out_change(results, fams)
    pairs = [
        f"| {method} | {baseline} | {fam} | {pv['n']} | {pv['fixed']} | {pv['broken']} | "
        f"{pv['gain']:+.3f} | {pv['p_value']:.3f} |"
        for method, baseline in baselines(results)
        for fam in fams
        if (pv := paired_vs(results, method, baseline, fam))
    ]
    if pairs:  # methods against each other, where two ran
        lines += [
            "",
            "| method | vs | family | problems x seeds | method only | baseline only | gain | sign test p |",
            "|---|---|---|---|---|---|---|---|",
            *pairs,
        ]
    lines += [
        "",
        "| method | step s | vs grpo | rollout s | retrieval s | old-logprob s | update s | sync s | rollout tokens | "
        "tool calls | retrievals | learner tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    grpo_step = [r["per_step"].get("step_s", 0.0) for r in results if r["method"] == "grpo"]
    for method in METHODS:
        rs = [r for r in results if r["method"] == method]
        if rs:
            cell = [statistics.mean(r["per_step"].get(k, 0.0) for r in rs) for k in STEP_KEYS]
            ratio = f"{cell[0] / statistics.mean(grpo_step):.2f}x" if grpo_step and min(grpo_step) > 0 else "-"
            lines.append(
                f"| {method} | {cell[0]:.2f} | {ratio} | "
                + " | ".join(f"{c:.2f}" for c in cell[1:6])
                + " | "
                + " | ".join(f"{c:.0f}" for c in cell[6:])
                + " |"
            )
    lines += probe_table(results)
    lines += ["", "| method | on-policy slot reward | hybrid slot reward | retrieval reward Z |", "|---|---|---|---|"]
    for method in METHODS:
        rs = [r for r in results if r["method"] == method and r.get("rewards")]
        if rs:
            cell = [_ms([r["rewards"].get(k, 0.0) for r in rs]) for k in REWARD_KEYS]
            lines.append(f"| {method} | " + " | ".join(cell) + " |")
    kinds = sorted({k for r in results for k in r.get("slot_success", {})})
    if kinds:
        lines += ["", "| method | " + " | ".join(f"{k} success" for k in kinds) + " |", "|---|" + "---|" * len(kinds)]
        for method in METHODS:
            rs = [r for r in results if r["method"] == method and r.get("slot_success")]
            if rs:
                cells = [
                    _ms([r["slot_success"][k] for r in rs if k in r["slot_success"]])
                    if any(k in r["slot_success"] for r in rs)
                    else "-"
                    for k in kinds
                ]
                lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += family_table(
        results,
        "retrieved_wins",
        [
            ("rewarded", "rewarded rollouts with a retrieved step", True),
            ("answer_in_retrieved", "answer shown by a retrieved block", False),
            ("own_wrong_search", "a search of its own off the expert's path", False),
        ],
    )
    lines += family_table(
        results,
        "retrieved_steps",
        [
            ("next_steps", "steps after a retrieved block", True),
            ("next_step_tool_call", "of them a tool call that ran", False),
            ("answered", "answers given after one", True),
            ("answer_handed", "answer shown only by a retrieved block", False),
        ],
    )
    return "\n".join(lines)


def probe_table(results: list[dict]) -> list[str]:
    """The step in units of the box's speed probe (``speed_normalized``), per method, and its ratio to GRPO's, beside
    the raw step: the probe slows with the run's own load too, so these ratios are read with the raw one, not instead
    of it. Only the runs with probe rounds count."""
    probed = [r for r in results if r.get("per_step_in_probes")]
    if not probed:
        return []
    lines = [
        "",
        "| method | runs with a probe | step s | vs grpo | step / Python-loop probe | vs grpo | step / matmul probe | "
        "vs grpo |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cols = [lambda r: r["per_step"]["step_s"], *(lambda r, p=p: r["per_step_in_probes"][p] for p in PROBES)]
    grpo = [r for r in probed if r["method"] == "grpo"]
    for method in METHODS:
        rs = [r for r in probed if r["method"] == method]
        if not rs:
            continue
        cells = []
        for col in cols:
            value = statistics.mean(col(r) for r in rs)
            ratio = f"{value / statistics.mean(col(r) for r in grpo):.2f}x" if grpo else "-"
            cells += [f"{value:.2f}", ratio]
        lines.append(f"| {method} | {len(rs)} | " + " | ".join(cells) + " |")
    return lines


def family_table(results: list[dict], field: str, columns: list[tuple[str, str, bool]]) -> list[str]:
    """Markdown rows of one per-family run reading (``field``: family -> values) per method and family; each column
    is (key, title, is a count): counts are summed over seeds, shares given as mean ± std over seeds."""
    rows = [(r["method"], fam, v) for r in results for fam, v in r.get(field, {}).items()]
    if not rows:
        return []
    out = [
        "",
        "| method | family | " + " | ".join(t for _, t, _ in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for method in METHODS:
        for fam in sorted({f for m, f, _ in rows if m == method}):
            vs = [v for m, f, v in rows if m == method and f == fam]
            cells = [str(sum(v[k] for v in vs)) if count else _ms([v[k] for v in vs]) for k, _, count in columns]
            out.append(f"| {method} | {fam} | " + " | ".join(cells) + " |")
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time, held_out) = plt.subplots(1, 3, figsize=(17, 4))
    by_time.sharey(by_step)
    for method in METHODS:
        rs = [r for r in results if r["method"] == method]
        if not rs:
            continue
        steps = sorted({s for r in rs for s, _ in r["curve"]})
        mean = [statistics.mean(v for r in rs for s2, v in r["curve"] if s2 == s) for s in steps]
        (line,) = by_step.plot(steps, mean, label=f"{method} ({len(rs)} seeds)")
        # held-out accuracy: each seed thin, the mean over the seeds that evaluated at a step thick
        for r in rs:
            if r.get("eval_curve"):
                held_out.plot(*zip(*r["eval_curve"]), color=line.get_color(), alpha=0.3, lw=0.8)
        at = sorted({s for r in rs for s, _ in r.get("eval_curve", [])})
        if at:
            means = [statistics.mean(v for r in rs for s2, v in r.get("eval_curve", []) if s2 == s) for s in at]
            held_out.plot(at, means, color=line.get_color(), marker="o", label=method)
        # equal wall time: the same mean reward against the mean training seconds spent up to each step
        walls = [r["wall"] for r in rs if len(r.get("wall", [])) == len(r["curve"])]
        if walls and all(len(w) == len(steps) for w in walls):
            by_time.plot([statistics.mean(w[i] for w in walls) / 60 for i in range(len(steps))], mean, label=method)
    by_step.set_xlabel("RL step")
    by_step.set_ylabel("mean training reward")
    by_time.set_xlabel("training wall time (min, steps only)")
    held_out.set_xlabel("RL step")
    held_out.set_ylabel("held-out accuracy (greedy)")
    by_step.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def included_runs(paths: list[str], args, results: list[dict]) -> list[dict]:
    """The runs of the earlier reports ``paths`` that ``results`` lacks (by method and seed). A report of another
    config, budget or overrides than ``args`` is refused: its runs are not the same experiment."""
    have = {(r["method"], r["seed"]) for r in results}
    ours = {"config": args.config, "steps": args.steps, "prompts_per_step": args.prompts}
    ours |= {"eval_size": args.eval_size, "overrides": args.overrides}
    out = []
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
            runs = report["runs"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"--include-report {path}: not a compare_algorithms report ({exc})") from None
        differ = {k: report.get(k) for k, v in ours.items() if report.get(k) != v}
        if differ:
            raise SystemExit(f"--include-report {path}: another experiment ({differ}; this one: {ours})")
        for run in runs:
            if (run["method"], run["seed"]) not in have:
                have.add((run["method"], run["seed"]))
                out.append(run)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="a recipe for every run (jobs/train.py --config)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: 30, or the config's)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default: 4, or the config's)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--eval-size", type=int, default=None, help="held-out problems (default: 100, or the config's)")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated, of: {', '.join(METHODS)}")
    ap.add_argument("--artifacts", default=str(REPO / "artifacts"), help="shared warm start + buffer (built once)")
    ap.add_argument("--out", default=str(REPO / "runs" / "compare"))
    ap.add_argument(
        "--report",
        default=str(REPO / "benchmarks" / "results" / "compare.json"),
        help="where the JSON report goes; the curves PNG goes beside it unless it is the default (docs/)",
    )
    ap.add_argument(
        "--include-report",
        action="append",
        default=[],
        help="an earlier report of the same config whose runs join this one's tables (repeatable; a method and seed "
        "run here replaces the earlier one): seeds run elsewhere, or before the run folders were lost",
    )
    ap.add_argument("overrides", nargs="*", help="extra config overrides applied to every run")
    args = ap.parse_args()
    if not args.config:  # the bundled default job's comparison budget
        args.steps, args.prompts, args.eval_size = args.steps or 30, args.prompts or 4, args.eval_size or 100
    out = Path(args.out)
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; valid: {list(METHODS)}")
    results, failed = [], []
    for turn, seed in enumerate(int(s) for s in args.seeds.split(",")):
        for method in run_order(methods, turn):
            r = run_one(method, seed, args, out)
            (results.append(r) if r is not None else failed.append(f"{method} seed {seed}"))
    results += included_runs(args.include_report, args, results)
    report = {
        "config": args.config,
        "machine": machine_record(),
        "steps": args.steps,  # None: the config's own
        "prompts_per_step": args.prompts,
        "group_size": sorted({r["group_size"] for r in results}),
        "eval_size": args.eval_size,
        "overrides": args.overrides,
        "failed": failed,
        "runs": results,
    }
    dest = Path(args.report)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(report, indent=1))
    default = dest.resolve() == (REPO / "benchmarks" / "results" / "compare.json").resolve()
    curves = REPO / "docs" / "compare_curves.png" if default else dest.with_suffix(".png")
    plot(results, curves)
    print(tables(results))
    print(f"wrote {dest} and {curves}" + (f"; FAILED runs: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
