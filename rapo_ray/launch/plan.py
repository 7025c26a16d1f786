"""What a run will ask the cluster for, computed from the config alone: the numbers the launcher checks and fits
(``check_resources``, ``init_ray``) and the plan ``jobs/train.py --dry-run`` prints."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rapo_ray.algos.registry import algorithm_of
from rapo_ray.config import Config
from rapo_ray.core.errors import ConfigError
from rapo_ray.pipelines.buffer import BUILD_CPUS


@dataclass(frozen=True)
class ResourceNeeds:
    """CPUs and GPUs of the learners, the rollout fleet and the retrieval replicas, at start and at most."""

    learner_cpus: float
    learner_gpus: float
    learner_group_cpus: float  # what the learners' placement group reserves: colocated, also the paired workers'
    rollout_cpus_start: float  # rollout.num_workers workers
    rollout_cpus_max: float  # rollout.max_workers workers
    gpus_start: float  # learners + rollout.num_workers workers + retrieval.min_replicas replicas
    gpus_max: float

    @property
    def cpus_start(self) -> float:
        return self.learner_cpus + self.rollout_cpus_start

    @property
    def cpus_max(self) -> float:
        return self.learner_cpus + self.rollout_cpus_max


def hybrid_slots(cfg: Config) -> int:
    """Slots per group the algorithm fills from RAPO's buffer (0: it retrieves nothing, so no buffer and no Serve)."""
    return algorithm_of(cfg.algo).rollout(cfg.algo).hybrid_slots


def resource_needs(cfg: Config) -> ResourceNeeds:
    """Colocated (``resources.colocate`` true), each learner rank's bundle holds its rollout worker and the pair's
    one GPU share: the fleet adds CPUs but no GPUs, and never grows."""
    rc, lc, ro = cfg.resources, cfg.learner, cfg.rollout
    retrieval_gpu = cfg.retrieval.num_gpus if hybrid_slots(cfg) else 0.0
    colocated = rc.colocate is True
    learner_gpus = lc.world_size * (rc.colocated_gpus if colocated else rc.gpus_per_learner)
    worker_gpus = 0.0 if colocated else rc.gpus_per_rollout_worker
    max_workers = ro.num_workers if colocated else ro.max_workers
    return ResourceNeeds(
        learner_cpus=lc.world_size * rc.cpus_per_learner,
        learner_group_cpus=lc.world_size * rc.cpus_per_learner + cfg.colocated_pairs * rc.cpus_per_rollout_worker,
        learner_gpus=learner_gpus,
        rollout_cpus_start=ro.num_workers * rc.cpus_per_rollout_worker,
        rollout_cpus_max=max_workers * rc.cpus_per_rollout_worker,
        gpus_start=learner_gpus + ro.num_workers * worker_gpus + retrieval_gpu * cfg.retrieval.min_replicas,
        gpus_max=learner_gpus + max_workers * worker_gpus + retrieval_gpu * cfg.retrieval.max_replicas,
    )


def resolve_colocate(cfg: Config, cluster_gpus: float) -> str | None:
    """Decide ``resources.colocate=auto`` for a cluster with ``cluster_gpus`` GPUs: on where there is exactly one
    GPU and the run asks for GPUs (a learner and an engine can then only share it). Sets the field to True or
    False; returns what was decided when auto turned it on (None otherwise). ConfigError when auto would colocate
    a run whose fleet cannot be paired with the learner ranks."""
    rc = cfg.resources
    if rc.colocate != "auto":
        return None
    asks_gpus = rc.gpus_per_learner > 0 or rc.gpus_per_rollout_worker > 0
    rc.colocate = bool(cluster_gpus == 1 and asks_gpus)
    if not rc.colocate:
        return None
    try:
        cfg.validate()
    except ConfigError as exc:
        rc.colocate = "auto"
        raise ConfigError(
            f"resources.colocate=auto: the cluster has one GPU, so the learner and the rollout engine share it; {exc}"
            " (or set resources.colocate=false and give each its own GPU on a larger cluster)"
        ) from None
    share = rc.colocated_shares()
    return (
        f"resources.colocate=auto: one GPU in the cluster, so learner and rollout engine share it "
        f"(num_gpus {share[0]:g} + {share[1]:g}); weights go by CUDA IPC"
    )


def learners_start_before_buffer(cfg: Config, free_cpus: float) -> bool:
    """Whether the learner ranks may start before RAPO's buffer is built (the launcher's overlap): only where the
    build's actors (``BUILD_CPUS``) still fit beside them in ``free_cpus``; on a cluster sized for the run alone
    they may not, and the build would wait for CPUs that the learners hold. Colocated, the learners' bundles hold
    their paired workers' CPUs from the start. Always, for an algorithm without a buffer."""
    if not hybrid_slots(cfg):
        return True
    return free_cpus - resource_needs(cfg).learner_group_cpus >= BUILD_CPUS


def fit_cpus(cfg: Config, cluster_cpus: float) -> str | None:
    """Make the learners and the starting fleet fit ``cluster_cpus`` (``resources.fit_cpus``): scale both CPU shares
    by one factor, rounded down to 0.01. Returns what was changed (None: it fitted already); raises ConfigError
    naming the overrides that would fit when fitting is off or impossible."""
    rc, need = cfg.resources, resource_needs(cfg)
    if need.cpus_start <= cluster_cpus:
        return None
    scale = cluster_cpus / need.cpus_start
    learner = math.floor(rc.cpus_per_learner * scale * 100) / 100
    worker = math.floor(rc.cpus_per_rollout_worker * scale * 100) / 100
    asked = (
        f"learner.world_size={cfg.learner.world_size} x resources.cpus_per_learner={rc.cpus_per_learner:g} + "
        f"rollout.num_workers={cfg.rollout.num_workers} x resources.cpus_per_rollout_worker="
        f"{rc.cpus_per_rollout_worker:g} = {need.cpus_start:g} CPUs, but the cluster has {cluster_cpus:g}"
    )
    overrides = f"resources.cpus_per_learner={learner:g} resources.cpus_per_rollout_worker={worker:g}"
    if (learner <= 0 and rc.cpus_per_learner > 0) or (worker <= 0 and rc.cpus_per_rollout_worker > 0):
        raise ConfigError(f"resources: {asked}; too few CPUs to share between the learners and the fleet")
    if not rc.fit_cpus:
        raise ConfigError(f"resources: {asked}; {overrides} would fit (or resources.fit_cpus=true)")
    rc.cpus_per_learner, rc.cpus_per_rollout_worker = learner, worker
    return f"resources: {asked}; CPU shares are logical, so the run uses {overrides} (resources.fit_cpus)"


def _res(cpus: float, gpus: float, custom: dict) -> str:
    parts = [f"{cpus:g} CPU"] + ([f"{gpus:g} GPU"] if gpus else []) + [f"{v:g} {k}" for k, v in custom.items()]
    return ", ".join(parts)


def model_name(cfg: Config) -> str:
    if cfg.model.preset:
        return f"{cfg.model.preset} (model.preset, converted once from its packaged GGUF)"
    return cfg.model.path or "bundled small Qwen2 (built and warm-started locally)"


def _colocated_line(rc) -> str:
    if rc.colocate is True:
        share = rc.colocated_shares()
        return (
            f"yes: learner rank r and rollout worker r share bundle r (num_gpus {share[0]:g} + {share[1]:g}); "
            "weights by shared memory (CUDA IPC on a GPU)"
        )
    if rc.colocate == "auto":
        return "auto: yes when the cluster has exactly one GPU and the run asks for GPUs; else the network sync"
    return "no: weights by the network sync (gloo, learner ranks to engines)"


def resource_plan(cfg: Config) -> str:
    rc, lc, ro, a = cfg.resources, cfg.learner, cfg.rollout, cfg.algo
    need = resource_needs(cfg)
    own = algorithm_of(a).describe(a)  # the algorithm's own settings (RAPO: hybrid slots, m, a)
    lines = [
        f"algorithm: {a.name} (G={a.group_size}, "
        + (f"{own}, " if own else "")
        + f"clip {a.clip_low}/{a.clip_high}, KL {a.kl_coef})",
        f"model: {model_name(cfg)} ({cfg.model.dtype}"
        + (", bf16 mixed precision on GPU (fp32 master weights)" if lc.bf16 else "")
        + (", gradient checkpointing" if lc.gradient_checkpointing else "")
        + ")",
        f"batch: {cfg.trainer.prompts_per_step} prompts x {a.group_size} rollouts = {cfg.trainer.prompts_per_step * a.group_size} "
        f"trajectories per step; PPO mini-batch {lc.mini_batch_size}, {lc.ppo_epochs} epoch(s), lr {lc.lr:g}; {cfg.trainer.total_steps} steps",
        "resources:",
        f"  learners:        {lc.world_size} x ({_res(rc.cpus_per_learner, rc.gpus_per_learner, rc.learner_custom_resources)}) "
        f"in one placement group ({'STRICT_PACK' if rc.colocate is True else 'PACK'}), torch.distributed "
        f"{lc.backend}, FSDP2={lc.fsdp}",
        f"  colocated:       {_colocated_line(rc)}",
        f"  rollout workers: {ro.num_workers} at start, {ro.min_workers}..{ro.max_workers} "
        f"({'autoscaled' if ro.autoscale else 'fixed unless scaled'}) x ({_res(rc.cpus_per_rollout_worker, rc.gpus_per_rollout_worker, rc.rollout_custom_resources)}), "
        f"engine {ro.engine}",
        f"  retrieval:       Serve StepRetriever {cfg.retrieval.min_replicas}..{cfg.retrieval.max_replicas} replicas "
        f"({cfg.retrieval.num_gpus:g} GPU each) over Milvus "
        f"{cfg.retrieval.milvus_uri or '(embedded milvus-lite server)'}"
        if hybrid_slots(cfg)
        else "  retrieval:       none",
        f"  total at start:  {need.cpus_start:g} CPU, {need.gpus_start:g} GPU; "
        f"at most {need.cpus_max:g} CPU, {need.gpus_max:g} GPU",
        "data:",
    ]
    if cfg.tasks.families:
        lines.append(
            f"  bundled families {cfg.tasks.families}: {cfg.trainer.rl_questions} RL questions each, {cfg.tasks.test_size} held-out"
        )
    for kind, files in (("train", cfg.tasks.data_files), ("eval", cfg.tasks.eval_files)):
        for f in files:
            lines.append(f"  {kind}: {f}" + ("" if Path(f).exists() else "  (NOT FOUND on this machine)"))
    if (
        cfg.model.path
        and not Path(cfg.model.path).suffix == ".gguf"
        and not (Path(cfg.model.path) / "config.json").is_file()
    ):
        lines.append(f"note: model.path {cfg.model.path} is not on this machine; the run needs it on every node")
    return "\n".join(lines)
