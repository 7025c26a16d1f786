"""What a run will ask the cluster for, computed from the config alone (``jobs/train.py --dry-run``)."""

from __future__ import annotations

from pathlib import Path

from rapo_ray.algos.registry import get_algorithm
from rapo_ray.config import Config


def _res(cpus: float, gpus: float, custom: dict) -> str:
    parts = [f"{cpus:g} CPU"] + ([f"{gpus:g} GPU"] if gpus else []) + [f"{v:g} {k}" for k, v in custom.items()]
    return ", ".join(parts)


def resource_plan(cfg: Config) -> str:
    rc, lc, ro, a = cfg.resources, cfg.learner, cfg.rollout, cfg.algo
    n_hybrid = get_algorithm(a.name).hybrid_slots(a)
    learner_cpu, learner_gpu = lc.world_size * rc.cpus_per_learner, lc.world_size * rc.gpus_per_learner
    retrieval_gpu = cfg.retrieval.num_gpus if n_hybrid else 0.0  # per replica
    lines = [
        f"algorithm: {a.name} (G={a.group_size}, N_hybrid={n_hybrid}, clip {a.clip_low}/{a.clip_high}, "
        + (f"m={a.rapo.shaping_weight}, a={a.rapo.advantage_weight}, " if n_hybrid else "")
        + f"KL {a.kl_coef})",
        f"model: {cfg.model.path or 'bundled small Qwen2 (built and warm-started locally)'} ({cfg.model.dtype}"
        + (", bf16 mixed precision on GPU (fp32 master weights)" if lc.bf16 else "")
        + (", gradient checkpointing" if lc.gradient_checkpointing else "")
        + ")",
        f"batch: {cfg.trainer.prompts_per_step} prompts x {a.group_size} rollouts = {cfg.trainer.prompts_per_step * a.group_size} "
        f"trajectories per step; PPO mini-batch {lc.mini_batch_size}, {lc.ppo_epochs} epoch(s), lr {lc.lr:g}; {cfg.trainer.total_steps} steps",
        "resources:",
        f"  learners:        {lc.world_size} x ({_res(rc.cpus_per_learner, rc.gpus_per_learner, rc.learner_custom_resources)}) "
        f"in one placement group (PACK), torch.distributed {lc.backend}, FSDP2={lc.fsdp}",
        f"  rollout workers: {ro.num_workers} at start, {ro.min_workers}..{ro.max_workers} "
        f"({'autoscaled' if ro.autoscale else 'fixed unless scaled'}) x ({_res(rc.cpus_per_rollout_worker, rc.gpus_per_rollout_worker, rc.rollout_custom_resources)}), "
        f"engine {ro.engine}",
        f"  retrieval:       Serve StepRetriever {cfg.retrieval.min_replicas}..{cfg.retrieval.max_replicas} replicas "
        f"({cfg.retrieval.num_gpus:g} GPU each) over Milvus "
        f"{cfg.retrieval.milvus_uri or '(embedded milvus-lite server)'}"
        if n_hybrid
        else "  retrieval:       none",
        f"  total at start:  {learner_cpu + ro.num_workers * rc.cpus_per_rollout_worker:g} CPU, "
        f"{learner_gpu + ro.num_workers * rc.gpus_per_rollout_worker + retrieval_gpu * cfg.retrieval.min_replicas:g} GPU; "
        f"at most {learner_cpu + ro.max_workers * rc.cpus_per_rollout_worker:g} CPU, "
        f"{learner_gpu + ro.max_workers * rc.gpus_per_rollout_worker + retrieval_gpu * cfg.retrieval.max_replicas:g} GPU",
        "data:",
    ]
    if cfg.tasks.families:
        lines.append(
            f"  bundled families {cfg.tasks.families}: {cfg.trainer.rl_questions} RL questions each, {cfg.tasks.test_size} held-out"
        )
    for kind, files in (("train", cfg.tasks.data_files), ("eval", cfg.tasks.eval_files)):
        for f in files:
            lines.append(f"  {kind}: {f}" + ("" if Path(f).exists() else "  (NOT FOUND on this machine)"))
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        lines.append(f"note: model.path {cfg.model.path} is not on this machine; the run needs it on every node")
    return "\n".join(lines)
