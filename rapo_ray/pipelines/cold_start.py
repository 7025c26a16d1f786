"""The cold start of a real instruction model: a short SFT on GSM8K gold solutions written in the tool protocol.

Tried with the paper's system prompt, SmolLM2-135M-Instruct writes prose arithmetic and never a ``<python>`` call
or a ``\\boxed{}`` answer, so RL from it has no reward to learn from. ARPO and Tool-Star start from a cold-start
SFT for the same reason. Here each demonstration is a GSM8K training question in the model's own chat template,
its calculator annotations (``<<48/2=24>>``) turned into ``<python>print(48/2)</python>`` steps followed by the
sandbox's real output (loss-masked, as in a rollout), and a final ``\\boxed{}`` answer. It is kept small
(``cold_start.examples``) so that sampled success stays in the exploration band rather than at the ceiling.
With ``cold_start.source=families`` the demonstrations are instead the scripted expert's solutions of bundled
problems (``tasks.families``) in the same chat template: a task a 135M model can learn within an hour here
(docs/RESULTS.md, The real model).

The result is cached under ``run.artifacts_dir`` by everything that shapes it (the base model's fingerprint, the
examples, the optimiser settings), so every arm of a comparison starts from the same checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from rapo_ray.agent.loop import LoopSettings
from rapo_ray.agent.turns import AgentTurns
from rapo_ray.core.devices import machine_record
from rapo_ray.envs import tasks as bundled
from rapo_ray.envs.loaders import gsm8k_solutions, gsm8k_trajectory_parts
from rapo_ray.envs.suite import build_tools, to_task
from rapo_ray.model.factory import load_model, load_tokenizer, resolve_model_dir, save_model
from rapo_ray.pipelines.sft import train_sft


def cold_start_dir(cfg, base: Path) -> Path:
    c = cfg.cold_start
    source = base / "converted_from.json"
    key = json.dumps(
        [
            str(base.resolve()),  # the same folder named relatively or absolutely is the same cold start
            json.loads(source.read_text()).get("sha256") if source.is_file() else None,
            c.examples,
            str(c.file),
            c.steps,
            c.lr,
            c.batch_size,
            c.seed,
            cfg.tasks.system_prompt,
            cfg.rollout.max_response_tokens,
            *([cfg.tasks.calc_steps] if cfg.tasks.calc_steps else []),  # (absent when unset: older caches stay valid)
            *(["families", cfg.tasks.families, cfg.tasks.seed, cfg.tasks.train_size] if c.source == "families" else []),
        ]
    )
    return Path(cfg.run.artifacts_dir) / f"cold-start-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def demonstration_source(cfg) -> str:
    """Where ``cold_start.source`` takes the demonstrations from, in words (for the log and errors)."""
    return cfg.cold_start.file if cfg.cold_start.source == "file" else f"the scripted expert of {cfg.tasks.families}"


def demonstrations(cfg, run_python) -> list[tuple[object, list[tuple[bool, str]] | None]]:
    """(problem, its solution as ``(is_policy_step, text)`` segments, or None when the tool does not reproduce one of
    its values) of every demonstration ``cold_start.source`` names.

    file: the first ``cold_start.examples`` GSM8K solutions of ``cold_start.file`` (``tasks.calc_steps`` applies),
    each calculator note a python call answered by ``run_python``. families: the scripted expert's solutions of the
    first ``cold_start.examples`` training problems of each ``tasks.families`` family, each step with the tool
    result the generator recorded (as the bundled model's warm start has them)."""
    c = cfg.cold_start
    out = []
    if c.source == "file":
        for example, rationale in gsm8k_solutions(c.file, c.examples, tuple(cfg.tasks.calc_steps)):
            parts, matches = gsm8k_trajectory_parts(rationale, example.answers[0], run_python)
            out.append((example, parts if all(matches) else None))
        return out
    for fam in cfg.tasks.families:
        for problem in bundled.generate(fam, "train", cfg.tasks.train_size, cfg.tasks.seed)[: c.examples]:
            out.append((problem, bundled.expert_parts(problem)))
    return out


def cold_start_examples(cfg, tokenizer, tools) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """(token ids, loss mask) of each usable demonstration, and counts of what was kept and why not.

    The prompt is what the agent loop sends (chat template, system prompt); policy steps are trained (mask 1), tool
    results are not (mask 0); an end-of-turn token closes the answer. A solution is dropped when the sandbox does not
    reproduce one of its annotated values, or when it is longer than ``rollout.max_response_tokens``."""
    turns = AgentTurns(None, tokenizer, None, LoopSettings.from_config(cfg, evaluation=True))
    out, counts = [], {"read": 0, "kept": 0, "tool_mismatch": 0, "too_long": 0}
    for problem, parts in demonstrations(cfg, lambda code: tools.call("python", code)):
        counts["read"] += 1
        if parts is None:
            counts["tool_mismatch"] += 1
            continue
        prompt = turns.task_prompt_ids(to_task(problem))
        ids, mask = list(prompt), [0] * len(prompt)
        for is_policy_step, text in parts:
            seg = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += seg
            mask += [int(is_policy_step)] * len(seg)
        ids.append(tokenizer.eos_token_id)
        mask.append(1)
        if len(ids) - len(prompt) > cfg.rollout.max_response_tokens:
            counts["too_long"] += 1
            continue
        out.append((ids, mask))
        counts["kept"] += 1
    return out, counts


def _cold_start_target(cfg, log=print) -> tuple[Path, Path | None, bool]:
    """(the base model folder, its cold start's folder or None when ``cold_start.examples`` is 0, whether the
    starting policy is there already). Converts a GGUF model on first use."""
    base = resolve_model_dir(cfg, log=log)
    if not cfg.cold_start.examples:
        return base, None, True
    out = cold_start_dir(cfg, base)
    return base, out, (out / "COMPLETE").is_file()


def built_cold_start(cfg, log=print) -> Path | None:
    """The real model's starting policy if nothing is left to train (the model itself when ``cold_start.examples``
    is 0, or a finished cold start), else None."""
    base, out, done = _cold_start_target(cfg, log)
    return (out or base) if done else None


def cold_start(cfg, log=print) -> Path:
    """The real model's starting policy: the model itself when ``cold_start.examples`` is 0, else its cold-start
    SFT, built once and cached (``cold_start_dir``)."""
    base, out, done = _cold_start_target(cfg, log)
    if done:
        return out or base
    c = cfg.cold_start
    t0 = time.perf_counter()
    tok = load_tokenizer(base)
    tools = build_tools(cfg.tasks, cfg.rollout, search_index=None)
    try:
        examples, counts = cold_start_examples(cfg, tok, tools)
    finally:
        tools.close()
    where = demonstration_source(cfg)
    if not examples:
        raise ValueError(
            f"cold_start.source={c.source}: none of the first {c.examples} solutions of {where} is usable ({counts})"
        )
    log(f"cold start: {counts['kept']} demonstrations from {where} ({counts}); {c.steps} SFT steps")
    model = load_model(base)
    warmup = max(1, c.steps // 10)  # a short run reaches its peak rate
    losses = train_sft(
        model,
        examples,
        c.steps,
        lr=c.lr,
        batch_size=c.batch_size,
        seed=c.seed,
        log=log,
        warmup=warmup,
        logits_only_at_targets=cfg.learner.logits_only_at_targets,
    )
    save_model(model, tok, out)
    record = {
        "base": str(base),
        "demonstrations": counts,
        "steps": c.steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": machine_record(),
    }
    (out / "built_on.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "COMPLETE").write_text("ok\n")
    log(f"cold start written to {out} in {record['seconds']} s (loss {losses[0]:.3f} -> {losses[-1]:.3f})")
    return out


def checkpoint_named(cfg, name: str) -> Path:
    """``base`` (the converted model), ``cold-start`` (its cold start, built if needed) or an HF folder's path."""
    if name == "base":
        return resolve_model_dir(cfg)
    if name == "cold-start":
        return cold_start(cfg)
    return Path(name)
