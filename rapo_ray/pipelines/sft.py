"""Warm start: supervised training of the small model on a deliberately limited set of expert demos.

Demonstrations are produced by the scripted expert running through the real agent loop and tools, so
they are token-exact protocol trajectories. A share of them are hybrid rollouts that contain a
``<retrieve>`` block from another question (loss-masked), so the policy learns to read past retrieved
context and keep going: a small model never shown the format breaks right after it (TASK_DESIGN_NOTES).
Loss is on generated tokens only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from pathlib import Path

import torch

from rapo_ray.agent.loop import AgentLoop, LoopSettings
from rapo_ray.agent.retriever import InMemoryStepRetriever, steps_of
from rapo_ray.algos.rapo import HybridRollout
from rapo_ray.core.devices import machine_record
from rapo_ray.envs.suite import build_tools, task_difficulty, task_splits
from rapo_ray.model.factory import load_model, load_tokenizer, resolve_model_dir, save_model
from rapo_ray.model.target_logits import logits_at
from rapo_ray.pipelines.expert import ScriptedExpertEngine
from rapo_ray.retrieval.search_index import search_index_for
from rapo_ray.types.trajectory import Trajectory


def expert_trajectories(
    cfg,
    tokenizer,
    tools,
    tasks,
    hybrid_fraction: float = 0.0,
    retriever=None,
    seed: int = 0,
    error_rate: float = 0.0,
    samples: int = 1,
) -> list[Trajectory]:
    """Expert rollouts through the real loop; with ``hybrid_fraction`` > 0 and a retriever, that share of
    them run as hybrid slots (retrieved blocks inserted, the expert continuing on its own)."""
    settings = LoopSettings.from_config(cfg, evaluation=True)
    settings.seed = seed
    loop = AgentLoop(
        ScriptedExpertEngine(tokenizer, error_rate=error_rate, seed=seed),
        tokenizer,
        tools,
        settings,
        retriever=retriever,
    )
    rng = random.Random(seed)
    hybrid = [t for t in tasks if rng.random() < hybrid_fraction] if retriever is not None else []
    hybrid_ids = {t.id for t in hybrid}
    plain = [t for t in tasks if t.id not in hybrid_ids]
    out: list[Trajectory] = []
    if plain:
        out += loop.run_groups(plain, group_size=samples)[0]
    if hybrid:  # the same loop (its RNG goes on), every slot hybrid, retrieving before half of its steps
        loop.rollout = HybridRollout(n_hybrid=samples, retrieve_prob=0.5)
        out += loop.run_groups(hybrid, group_size=samples)[0]
    return out


def _batches(examples, batch_size, rng):
    idx = list(range(len(examples)))
    while True:
        rng.shuffle(idx)
        for i in range(0, len(idx) - batch_size + 1, batch_size):
            yield [examples[j] for j in idx[i : i + batch_size]]


def train_sft(
    model,
    examples: list[tuple[list[int], list[int]]],
    steps: int,
    lr: float = 2e-3,
    batch_size: int = 16,
    seed: int = 0,
    log=print,
    warmup: int = 50,
    logits_only_at_targets: bool = True,
) -> list[float]:
    """Next-token loss on positions whose mask is 1. ``examples``: (token ids, loss mask) pairs. The learning rate
    rises linearly for ``warmup`` steps, then follows a cosine to 0 at ``steps``. ``logits_only_at_targets``: the
    LM head runs only at those positions (``learner.logits_only_at_targets``, rapo_ray/model/target_logits.py)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    # The warm start runs before any actor exists: use every core for it.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    losses = []
    pad = model.config.pad_token_id or 0
    batches = _batches(examples, min(batch_size, len(examples)), rng)
    t0 = time.perf_counter()
    for step in range(steps):
        batch = next(batches)
        L = max(len(x) for x, _ in batch)
        ids = torch.full((len(batch), L), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.float32)
        attn = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (x, m) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
            attn[i, : len(x)] = 1
        at = mask[:, 1:] > 0  # the targets the loss trains: the LM head runs only there
        logits = logits_at(model, ids, attn, at, logits_only_at_targets).float()
        loss = torch.nn.functional.cross_entropy(logits, ids[:, 1:][at], reduction="sum") / max(int(at.sum()), 1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log and (step % 100 == 0 or step == steps - 1):
            log(f"sft step {step:5d}/{steps} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)")
    model.eval()
    torch.set_num_threads(threads)
    return losses


def sft_examples(trajs: list[Trajectory]) -> list[tuple[list[int], list[int]]]:
    return [(t.token_ids(), [0] * len(t.prompt_ids) + t.loss_mask.tolist()) for t in trajs if t.correct]


def sft_tasks(cfg, tasks: list, family: str = "") -> list:
    """The warm-start questions of one family: the first ``sft_examples`` 2-step ones and the first
    ``sft_hard_examples`` 3-step ones, or the first ``sft_family_examples[family]`` of any kind (taken from the
    start of the training split; RL uses later ones)."""
    head = tasks[: sft_span(cfg)]
    if family in cfg.trainer.sft_family_examples:
        return head[: cfg.trainer.sft_family_examples[family]]
    easy = [t for t in head if task_difficulty(t) <= 2][: cfg.trainer.sft_examples]
    hard = [t for t in head if task_difficulty(t) > 2][: cfg.trainer.sft_hard_examples]
    return easy + hard


def sft_span(cfg) -> int:
    """How many training questions (from the start) the warm start may draw from."""
    return 2 * cfg.trainer.sft_examples + 2 * cfg.trainer.sft_hard_examples


def warm_start_dir(cfg) -> Path:
    t = cfg.trainer
    key = json.dumps(
        [
            str(resolve_model_dir(cfg)),
            t.sft_examples,
            t.sft_hard_examples,
            t.sft_steps,
            t.sft_lr,
            t.sft_batch_size,
            t.sft_hybrid_fraction,
            *([t.sft_retrieval_scope] if t.sft_retrieval_scope != "other" else []),
            # only the families in use: a default run keeps the folder it had before this setting existed
            *(
                [per_family]
                if (per_family := sorted((f, n) for f, n in t.sft_family_examples.items() if f in cfg.tasks.families))
                else []
            ),
            sorted(cfg.tasks.families),
            cfg.tasks.seed,
            cfg.tasks.system_prompt,
            t.sft_seed,
            cfg.rollout.max_response_tokens,
        ]
    )
    return Path(cfg.run.artifacts_dir) / f"warm-start-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def built_warm_start(cfg) -> Path | None:
    """The bundled model's warm start if it is built already, else None (``warm_start`` builds it)."""
    out = warm_start_dir(cfg)
    return out if (out / "config.json").is_file() else None


def warm_start(cfg, log=print, force: bool = False) -> Path:
    """Build (once per config) the warm-started HF checkpoint the RL run starts from."""
    out = warm_start_dir(cfg)
    if not force and (out / "config.json").is_file():
        return out
    base = resolve_model_dir(cfg)
    tok = load_tokenizer(base)
    model = load_model(base)
    train, _ = task_splits(cfg.tasks)
    tools = build_tools(cfg.tasks, cfg.rollout, search_index_for(cfg.tasks))
    try:
        demos_tasks, pool_tasks = {}, {}
        for fam, tasks in train.items():
            demos_tasks[fam] = sft_tasks(cfg, tasks, fam)
            used = {t.id for t in demos_tasks[fam]}
            pool_tasks[fam] = [t for t in tasks if t.id not in used][-200:]  # other questions: the retrieve-format pool
        demo_list = [t for ts in demos_tasks.values() for t in ts]
        scope = cfg.trainer.sft_retrieval_scope
        pool = [t for ts in pool_tasks.values() for t in ts] if scope == "other" else demo_list
        pool_steps = [
            s for tr in expert_trajectories(cfg, tok, tools, pool, seed=cfg.trainer.sft_seed) for s in steps_of(tok, tr)
        ]
        retriever = InMemoryStepRetriever(pool_steps, question_scope=scope)
        demos = expert_trajectories(
            cfg,
            tok,
            tools,
            demo_list,
            hybrid_fraction=cfg.trainer.sft_hybrid_fraction,
            retriever=retriever,
            seed=cfg.trainer.sft_seed,
        )
        examples = sft_examples(demos)
        log(
            f"warm start: {len(examples)} expert demonstrations ({sum(1 for d in demos if d.num_retrievals)} with retrieved blocks), "
            f"{cfg.trainer.sft_steps} steps"
        )
        train_sft(
            model,
            examples,
            cfg.trainer.sft_steps,
            lr=cfg.trainer.sft_lr,
            batch_size=cfg.trainer.sft_batch_size,
            seed=cfg.trainer.sft_seed,
            log=log,
            logits_only_at_targets=cfg.learner.logits_only_at_targets,
        )
        save_model(model, tok, out)
        (out / "built_on.json").write_text(json.dumps(machine_record(), indent=1))
    finally:
        tools.close()
    return out
