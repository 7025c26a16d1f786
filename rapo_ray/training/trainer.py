"""``Trainer``: one RL step, top to bottom, over the learner group, the rollout fleet and the weight sync.

    step:  sample prompts -> rollout (fleet) -> old-policy pass (learners: log-probs, entropies)
           -> advantages (the algorithm's estimator) -> PPO update (learners) -> weight sync (collective)

Every stage reads and fills the same ``TrajectoryBatch`` (rapo_ray/types/batch.py). The Ray topology around it
(Ray start-up, warm start, buffer, Serve, the training loop) is in rapo_ray/launch/launcher.py.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rapo_ray.agent.evaluation import family_result
from rapo_ray.agent.retriever import steps_of
from rapo_ray.algos.registry import get_algorithm
from rapo_ray.config import Config
from rapo_ray.core.errors import WORKER_DIED
from rapo_ray.core.metrics import RunMetrics
from rapo_ray.envs.loaders import source_name
from rapo_ray.envs.suite import family_of, task_difficulty, task_splits
from rapo_ray.model.factory import load_tokenizer
from rapo_ray.pipelines.sft import sft_span
from rapo_ray.training.checkpoints import problem, write_manifest
from rapo_ray.training.data_flow import compute_advantages
from rapo_ray.training.reporting import step_metrics, write_trajectories
from rapo_ray.types.batch import TrajectoryBatch
from rapo_ray.workers.learner import LearnerGroup
from rapo_ray.workers.rollout import RolloutFleet
from rapo_ray.workers.sync import WeightSync

log = logging.getLogger("rapo_ray.training.trainer")


@dataclass
class EvalResult:
    """Held-out pass@1: ``metrics`` (``eval/<family>/accuracy``, ``eval/<family>/format_valid``,
    ``eval/mean_accuracy``) and ``problems`` (problem id -> solved, for the paired before/after test)."""

    metrics: dict[str, float]
    problems: dict[str, bool]


class Trainer:
    def __init__(
        self,
        cfg: Config,
        model_dir: Path,
        checkpoints_dir: Path,
        retrieval_app: str | None,
        tasks: tuple[dict, dict] | None = None,
    ):
        """``tasks``: ``rl_task_pool(cfg)`` when the caller has it already (computed here otherwise)."""
        self.cfg, self.model_dir, self.checkpoints_dir = cfg, Path(model_dir), Path(checkpoints_dir)
        self.algorithm = get_algorithm(cfg.algo.name)
        self.retrieval_app = retrieval_app
        self.tok = load_tokenizer(model_dir)
        self.train_tasks, self.test_tasks = tasks if tasks is not None else rl_task_pool(cfg)
        self.step_idx, self.version = 0, 0
        self.run_metrics = RunMetrics(cfg.run.metrics_window)  # moving means and lifetime totals across steps
        self.rng = random.Random(cfg.trainer.seed)
        self.learners = LearnerGroup(cfg, model_dir)
        self.sync = WeightSync(cfg.sync.bucket_mb, cfg.sync.timeout_s, cfg.sync.wire_dtype(cfg.model.dtype))
        self.fleet = RolloutFleet(model_dir, cfg, retrieval_app, on_new_workers=self._bring_up_to_date)

    # ------------------------------------------------------------ one RL step, top to bottom

    def step(self, trajectories_dir: Path | None = None) -> dict:
        """One RL step; returns its metrics. ``trajectories_dir``: write the step's batch there as parquet."""
        cfg = self.cfg
        seconds: dict[str, float] = {}
        t_step = time.perf_counter()
        # 1. sample prompts (one group per prompt)
        groups = self._sample_groups(cfg.trainer.prompts_per_step)
        # 2. rollout on the fleet (resized to the backlog first when autoscaling is on)
        if cfg.rollout.autoscale:
            self.fleet.autoscale(len(groups), cfg.rollout.groups_per_worker)
        t0 = time.perf_counter()
        batch, rollout_stats = self.fleet.run_step(
            groups, cfg.algo.group_size, seed=cfg.trainer.seed * 7919 + self.step_idx
        )
        seconds["rollout_s"] = time.perf_counter() - t0
        check_staleness(batch, self.version, cfg.algo)
        # 3. old-policy pass: exact log-probs and full-vocabulary entropies
        t0 = time.perf_counter()
        self.learners.forward_old(batch)
        seconds["old_logprob_s"] = time.perf_counter() - t0
        # 4. advantages: the algorithm's estimator (GRPO outcome advantage; RAPO adds retrieval reward and shaping)
        t0 = time.perf_counter()
        compute_advantages(batch, self.algorithm, cfg.algo, on=cfg.trainer.advantages_on)
        seconds["advantages_s"] = time.perf_counter() - t0
        # 5. PPO update with global denominators per mini-batch
        t0 = time.perf_counter()
        update_stats = self.learners.update(batch, self.step_idx)
        seconds["update_s"] = time.perf_counter() - t0
        # 6. weight sync to every rollout engine
        t0 = time.perf_counter()
        self.version += 1
        rollout_stats["replaced_workers"] += self.sync_weights()
        seconds["sync_s"] = time.perf_counter() - t0
        self.step_idx += 1
        # 7. optional buffer growth, trajectories to parquet, metrics
        inserted = self._insert_on_policy(batch) if cfg.retrieval.insert_on_policy and self.retrieval_app else None
        if trajectories_dir is not None:
            write_trajectories(trajectories_dir, self.step_idx, batch)
        seconds["step_s"] = time.perf_counter() - t_step
        m = step_metrics(
            self.step_idx,
            self.version,
            batch,
            rollout_stats,
            update_stats,
            seconds,
            cfg.learner.ppo_epochs,
            workers=len(self.fleet.workers),
        )
        if inserted is not None:
            m["inserted_steps"] = max(inserted, 0)
            m["insert_errors"] = int(inserted < 0)
        m.update(self.run_metrics.update(m))
        return m

    # ------------------------------------------------------------ pieces of the step

    def _sample_groups(self, n: int) -> list[tuple]:
        fams = list(self.train_tasks)
        out = []
        for k in range(n):
            fam = fams[(self.step_idx * n + k) % len(fams)]
            task = self.rng.choice(self.train_tasks[fam])
            out.append((f"s{self.step_idx}-g{k}-{task.id}", task))
        return out

    def _insert_on_policy(self, batch: TrajectoryBatch) -> int:
        """Optional buffer growth: the steps of the trajectories that the algorithm picks (RAPO: successful
        on-policy ones) go into the buffer. Returns how many were stored, -1 when the service failed (counted
        as ``insert_errors``)."""
        from ray import serve

        good = self.algorithm.buffer_candidates(batch, self.cfg.retrieval.insert_min_reward)
        steps = [asdict(st) for t in good for st in steps_of(self.tok, t, source="on_policy")]
        if not steps:
            return 0
        handle = serve.get_deployment_handle("StepRetriever", app_name=self.retrieval_app)
        try:
            return handle.insert.remote(steps).result(timeout_s=self.cfg.retrieval.timeout_s)
        except Exception as exc:  # a dead replica or a timeout: this step's steps are not added; the run goes on
            log.warning(
                "buffer insertion failed (%s: %s); step %d's steps were not added",
                type(exc).__name__,
                exc,
                self.step_idx,
            )
            return -1

    def sync_weights(self) -> int:
        """Push the learners' current weights to every rollout engine, stamped with ``self.version``. Returns
        how many dead rollout workers were replaced on the way (``push_weights``)."""
        return push_weights(self.sync, self.fleet, self.learners.workers, self.version)

    def _bring_up_to_date(self, workers: list) -> None:
        """A worker that joins mid-run (scale-up, replacement) starts from the model folder, version 0: it gets
        the learners' current weights before its first rollout."""
        if self.version > 0:
            self.sync.push(self.learners.workers, workers, self.version)

    # ------------------------------------------------------------ evaluation and checkpoints

    def eval_groups(self, limit: int | None = None) -> list[tuple]:
        """(group id, Task) of the held-out problems: the first ``limit`` per family (default trainer.eval_size)."""
        limit = limit or self.cfg.trainer.eval_size
        return [(f"eval-{t.id}", t) for ts in self.test_tasks.values() for t in ts[:limit]]

    def evaluate(self, limit: int | None = None) -> EvalResult:
        """Greedy pass@1 on the held-out tasks (first ``limit`` per family; default ``trainer.eval_size``)."""
        batch, _ = self.fleet.run_step(self.eval_groups(limit), 1, seed=0, evaluation=True)
        metrics: dict[str, float] = {}
        for fam in self.test_tasks:
            result = family_result([t for t in batch if family_of(t.problem_id) == fam])
            metrics[f"eval/{fam}/accuracy"] = result.accuracy
            metrics[f"eval/{fam}/format_valid"] = result.format_valid
        metrics["eval/mean_accuracy"] = _mean(metrics[f"eval/{f}/accuracy"] for f in self.test_tasks)
        return EvalResult(metrics, {t.problem_id: bool(t.correct) for t in batch})

    def save(self) -> Path:
        """Model (HF) + optimizer + RNG + data position + step + fleet size + the run's metric windows and
        totals, written atomically: into a temporary folder with a manifest of every file's size and hash last,
        then renamed into place."""
        ck = self.checkpoints_dir
        ck.mkdir(exist_ok=True)
        final = ck / f"step-{self.step_idx:06d}"
        tmp = ck / f".tmp-step-{self.step_idx:06d}"
        if tmp.exists():
            shutil.rmtree(tmp)
        self.learners.save(tmp, self.model_dir)
        state = {
            "step": self.step_idx,
            "version": self.version,
            "rng": self.rng.getstate(),
            "workers": len(self.fleet.workers),
            "torch_rng": torch.get_rng_state().tolist(),
            "run_metrics": self.run_metrics.get_state(),
        }
        (tmp / "trainer_state.json").write_text(json.dumps(state, default=list))
        write_manifest(
            tmp
        )  # last: a resume trusts only folders whose files match it (rapo_ray/training/checkpoints.py)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        (final / "COMPLETE").write_text("ok\n")
        done = sorted(p for p in ck.glob("step-*") if problem(p, hashes=False) is None)
        for old in done[: max(0, len(done) - self.cfg.checkpoint.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, path: Path) -> None:
        """Restore a checkpoint written by ``save`` and push its weights to the fleet."""
        self.learners.load(path)
        state = json.loads((path / "trainer_state.json").read_text())
        self.step_idx, self.version = state["step"], state["version"]
        rs = state["rng"]
        self.rng.setstate((rs[0], tuple(rs[1]), rs[2]))
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        if "run_metrics" in state:  # checkpoints before the windows existed restart them
            self.run_metrics.set_state(state["run_metrics"])
        self.sync_weights()
        self.fleet.scale(state["workers"])

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the fleet, the weight sync and the learners. ``graceful=False`` after a learner died."""
        self.fleet.shutdown()
        self.sync.close()
        self.learners.shutdown(graceful)


def push_weights(sync: WeightSync, fleet: RolloutFleet, learners: list, version: int) -> int:
    """Push the learners' weights as ``version`` to every rollout worker. A worker that died outside a rollout
    (during the old-logprob pass, the update, an evaluation's end) must not end the run:
    - with the group of the last push unchanged, the push itself meets a dead member at once (its connections
      close) and fails with nothing loaded; the dead are then replaced and the push retried on a new group;
    - a push that must form a new group (the fleet changed, or the last push failed) pings the workers first and
      replaces the dead: a dead member would leave the others waiting in the group's rendezvous for
      ``sync.timeout_s``.
    Replacements are not brought up to date on their own: the push that follows covers them. Returns the number
    replaced."""
    replaced = 0
    if sync.needs_new_group(learners, fleet.handles()):
        replaced += fleet.replace_dead("weight sync", bring_up=False)
    try:
        sync.push(learners, fleet.handles(), version)
    except WORKER_DIED:  # died before the push or during it: the others aborted, nothing loaded
        sync.reset()
        replaced += fleet.replace_dead("weight sync", bring_up=False)
        sync.push(learners, fleet.handles(), version)
    return replaced


def check_staleness(batch: TrajectoryBatch, version: int, algo_cfg) -> None:
    """Refuse trajectories sampled more than ``algo.max_staleness`` policy versions ago."""
    lag = max((version - t.policy_version) for t in batch) if len(batch) else 0
    if lag > algo_cfg.max_staleness:
        raise RuntimeError(f"trajectories are {lag} policy versions old (algo.max_staleness={algo_cfg.max_staleness})")


def rl_task_pool(cfg: Config) -> tuple[dict, dict]:
    """RL questions per family (after the warm-start or cold-start demos) and the held-out test tasks."""
    train, test = task_splits(cfg.tasks)
    n0 = sft_span(cfg)
    pool = {}
    cold = {source_name(Path(cfg.cold_start.file))} if cfg.cold_start.examples else set()  # its head is demos
    for fam, ts in train.items():
        if fam in cfg.tasks.families:
            later = ts[n0:]
        else:  # a real data file: after the cold start's head when it drew from this file
            later = ts[cfg.cold_start.examples :] if fam in cold else ts
        if cfg.tasks.difficulty and fam in cfg.tasks.families:
            later = [t for t in later if task_difficulty(t) == cfg.tasks.difficulty]
        pool[fam] = later[: cfg.trainer.rl_questions]
    return pool, test


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else 0.0
