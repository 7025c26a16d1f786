"""``Trainer``: one RL step, top to bottom, over the learner group, the rollout fleet and the weight sync.

    step:  sample prompts -> rollout (fleet) -> old-policy pass (learners: log-probs, entropies)
           -> advantages (the algorithm's estimator) -> PPO update (learners)
           -> weight sync (collective; shared memory when colocated, rapo_ray/workers/colocated.py)

With ``algo.max_staleness = k >= 1`` the learners' part (old-policy pass, advantages, update) runs in a driver
thread while the fleet rolls out the next steps' groups (up to k ahead) with the weights it has; the weight sync
waits for both, so a push never lands in the middle of a rollout and no sequence mixes two versions. k = 0 is
the synchronous step (nothing runs ahead, no thread). The bookkeeping is in rapo_ray/training/staleness.py.

Every stage reads and fills the same ``TrajectoryBatch`` (rapo_ray/types/batch.py). The Ray topology around it
(Ray start-up, warm start, buffer, Serve, the training loop) is in rapo_ray/launch/launcher.py.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import shutil
import time
from collections import Counter, deque
from concurrent import futures
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rapo_ray.agent.evaluation import family_result
from rapo_ray.agent.retriever import steps_of
from rapo_ray.algos.old_pass import old_pass_reason
from rapo_ray.algos.registry import algorithm_of
from rapo_ray.config import Config
from rapo_ray.core.errors import WORKER_DIED, ConfigError, LearnerLost
from rapo_ray.core.metrics import RunMetrics, StageTimer, mean_or_zero
from rapo_ray.envs.loaders import source_name
from rapo_ray.envs.suite import family_of, task_difficulty, task_splits
from rapo_ray.model.factory import load_tokenizer
from rapo_ray.pipelines.sft import sft_span
from rapo_ray.training.checkpoints import problem, write_manifest
from rapo_ray.training.data_flow import compute_advantages, fill_step_entropies
from rapo_ray.training.dynamic_sampling import dynamic_sample
from rapo_ray.training.prompt_pool import PromptPool
from rapo_ray.training.reporting import step_metrics, write_trajectories
from rapo_ray.training.staleness import (
    RolloutAhead,
    lag_histogram,
    merge_rollout_stats,
    replace_groups,
    stale_groups,
    staleness_metrics,
)
from rapo_ray.types.batch import TrajectoryBatch
from rapo_ray.workers.learner import LearnerGroup
from rapo_ray.workers.rollout import ColocatedSpawner, RolloutFleet
from rapo_ray.workers.sync import ColocatedSync, WeightSync

log = logging.getLogger("rapo_ray.training.trainer")

AHEAD_FILE = "rollouts_ahead.pkl"  # in a checkpoint: the steps rolled out before their update (a pickled list)


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
        learners: LearnerGroup | None = None,
    ):
        """``tasks``: ``rl_task_pool(cfg)`` when the caller has it already (computed here otherwise). ``learners``: a
        group already starting (``LearnerGroup(..., wait=False)``) for this config and model; built here otherwise."""
        self.cfg, self.model_dir, self.checkpoints_dir = cfg, Path(model_dir), Path(checkpoints_dir)
        self.algorithm = algorithm_of(cfg.algo)
        self.retrieval_app = retrieval_app
        self.tok = load_tokenizer(model_dir)
        self.train_tasks, self.test_tasks = tasks if tasks is not None else rl_task_pool(cfg)
        # version: the weights the fleet was last sent; learner_version: the learners' (one ahead during an update)
        self.step_idx, self.version, self.learner_version = 0, 0, 0
        self.ahead: deque[RolloutAhead] = deque()  # steps rolled out before their update (algo.max_staleness >= 1)
        self.lag_counts: Counter = Counter()  # the run's trajectories per policy-version lag at their update
        self._learning: futures.Future | None = None  # the learners' part of the step while it runs in its thread
        self._learner_thread = (
            futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="learners")
            if cfg.algo.max_staleness > 0
            else None
        )
        self.run_metrics = RunMetrics(cfg.run.metrics_window)  # moving means and lifetime totals across steps
        self.rng = random.Random(cfg.trainer.seed)
        # each training prompt's pass rate so far (trainer.prompt_sampling=pass_rate draws by it)
        self.prompt_pool = PromptPool() if cfg.trainer.prompt_sampling == "pass_rate" else None
        # the learner ranks and the rollout workers start at once (a process's imports and model each); the
        # fleet's constructor returns when its workers are ready, then the learners are waited for
        self.startup = StageTimer()  # what each part's start took, or was still waited for (the launcher logs it)
        self.learners = learners if learners is not None else LearnerGroup(cfg, model_dir, wait=False)
        # colocated (resources.colocate): each worker in its learner rank's bundle, the weights by shared memory
        colocated, wire_dtype = cfg.resources.colocate is True, cfg.sync.wire_dtype(cfg.model.dtype)
        self.sync = (
            ColocatedSync(cfg.sync.timeout_s, wire_dtype)
            if colocated
            else WeightSync(cfg.sync.bucket_mb, cfg.sync.timeout_s, wire_dtype)
        )
        spawner = (
            ColocatedSpawner(cfg, str(model_dir), retrieval_app, self.learners.pg, cfg.rollout.num_workers)
            if colocated
            else None
        )
        self.free_engine_cache = colocated and cfg.rollout.free_cache_during_update and cfg.algo.max_staleness == 0
        self.fleet: RolloutFleet | None = None
        try:
            with self.startup.stage("rollout fleet"):
                self.fleet = RolloutFleet(
                    model_dir, cfg, retrieval_app, on_new_workers=self._bring_up_to_date, spawner=spawner
                )
            with self.startup.stage("learner group"):
                self.learners.wait_ready()
        except BaseException:  # nothing started here outlives a failed start
            if self.fleet is not None:
                self.fleet.shutdown()
            self.sync.close()
            if learners is None:  # (a caller's group is the caller's to stop)
                self.learners.shutdown(graceful=False)
            raise

    # ------------------------------------------------------------ one RL step, top to bottom

    def step(self, trajectories_dir: Path | None = None) -> dict:
        """One RL step; returns its metrics. ``trajectories_dir``: write the step's batch there as parquet."""
        cfg = self.cfg
        timer = StageTimer()  # wall seconds per stage, reported as <stage>_s
        with timer.stage("step_s"):
            # 1-2. sample prompts (one group per prompt) and roll them out on the fleet, unless the last step's
            # update already rolled them out (algo.max_staleness >= 1); groups too stale for the bound are rolled
            # out again
            ahead = self.ahead.popleft() if self.ahead else self._roll_out(self.step_idx)
            if ahead.step != self.step_idx:  # the queue and the step count come from one checkpoint: else a bug
                raise RuntimeError(
                    f"the rollout made ahead is step {ahead.step + 1}'s, the trainer is at {self.step_idx + 1}"
                )
            batch, rollout_stats, dropped, rollout_s = self._within_bound(ahead)
            timer.add("rollout_s", rollout_s)
            lags = lag_histogram(batch, self.learner_version)
            # 3-5. the learners: old-policy pass, advantages, PPO update (with k >= 1, the next rollouts meanwhile)
            if self._learner_thread is None:
                if self.free_engine_cache:  # colocated: the learners get the device's memory the caches held
                    with timer.stage("free_cache_s"):
                        rollout_stats["engine_cache_freed_mb"] = self.fleet.release_memory() / 2**20
                update_stats, learner_seconds = self._learn(batch)
            else:
                update_stats, learner_seconds = self._learn_while_rolling_out(batch)
            for stage, stage_s in learner_seconds.items():
                timer.add(stage, stage_s)
            # 6. weight sync to every rollout engine
            with timer.stage("sync_s"):
                self.version = self.learner_version
                rollout_stats["replaced_workers"] += self.sync_weights()
            self.step_idx += 1
            # 7. optional buffer growth, trajectories to parquet, metrics
            insert = cfg.retrieval.insert_on_policy and self.retrieval_app
            inserted = self._insert_on_policy(batch) if insert else None
            if trajectories_dir is not None:
                write_trajectories(trajectories_dir, self.step_idx, batch)
        seconds = timer.seconds
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
        m["time"] = round(time.time(), 3)  # when the step ended (epoch s): lines a step up with other records
        if inserted is not None:
            m["inserted_steps"] = max(inserted, 0)
            m["insert_errors"] = int(inserted < 0)
        self.lag_counts.update(lags)
        m.update(staleness_metrics(lags, dropped))
        m.update({k: seconds[k] for k in ("ahead_rollout_s", "learner_wait_s", "free_cache_s") if k in seconds})
        m.update({k: v for k, v in rollout_stats.items() if k.startswith("dynamic_sampling/")})
        if "engine_cache_freed_mb" in rollout_stats:  # (colocated, rollout.free_cache_during_update)
            m["engine_cache_freed_mb"] = rollout_stats["engine_cache_freed_mb"]
        if self.prompt_pool is not None:
            m.update(self.prompt_pool.metrics())
        m.update(self.run_metrics.update(m))
        return m

    # ------------------------------------------------------------ pieces of the step

    def _roll_out(self, step: int) -> RolloutAhead:
        """Sample step ``step``'s prompts and roll them out on the fleet (resized to the backlog first when
        autoscaling is on); with ``trainer.dynamic_sampling`` groups without signal are replaced by fresh ones
        (rapo_ray/training/dynamic_sampling.py). Steps are sampled in order, so a step's prompts and seed do not
        depend on whether it was rolled out ahead."""
        cfg = self.cfg

        def roll_out(n: int, first: int) -> tuple[list[tuple], TrajectoryBatch, dict]:
            groups = self._sample_groups(n, step, first)
            if cfg.rollout.autoscale:
                self.fleet.autoscale(len(groups), cfg.rollout.groups_per_worker)
            batch, stats = self.fleet.run_step(groups, cfg.algo.group_size, seed=self._rollout_seed(step))
            if self.prompt_pool is not None:
                self.prompt_pool.observe(batch, dict(groups))
            return groups, batch, stats

        t0 = time.perf_counter()
        if cfg.trainer.dynamic_sampling:
            groups, batch, stats = dynamic_sample(
                cfg.trainer.prompts_per_step, cfg.trainer.dynamic_sampling_budget, roll_out
            )
        else:
            groups, batch, stats = roll_out(cfg.trainer.prompts_per_step, 0)
        return RolloutAhead(step, groups, batch, stats, time.perf_counter() - t0)

    def _rollout_seed(self, step: int) -> int:
        return self.cfg.trainer.seed * 7919 + step

    def _within_bound(self, ahead: RolloutAhead) -> tuple[TrajectoryBatch, dict, int, float]:
        """The step's batch with every group more than ``algo.max_staleness`` versions behind the learners rolled
        out again now (only after a resume with a smaller bound than the run saved with). Returns the batch, its
        rollout stats, how many groups were dropped and the rollout's wall time (the re-rollout's included)."""
        stale = stale_groups(ahead.batch, self.learner_version, self.cfg.algo.max_staleness)
        if not stale:
            return ahead.batch, dict(ahead.stats), 0, ahead.rollout_s
        redo = [(gid, task) for gid, task in ahead.groups if gid in stale]
        log.warning(
            "step %d: %d group(s) sampled more than algo.max_staleness=%d versions ago are rolled out again",
            ahead.step + 1,
            len(redo),
            self.cfg.algo.max_staleness,
        )
        t0 = time.perf_counter()
        fresh, fresh_stats = self.fleet.run_step(redo, self.cfg.algo.group_size, seed=self._rollout_seed(ahead.step))
        rerollout_s = time.perf_counter() - t0
        stats = merge_rollout_stats(ahead.stats, fresh_stats)
        return replace_groups(ahead, stale, fresh), stats, len(redo), ahead.rollout_s + rerollout_s

    def _learn(self, batch: TrajectoryBatch) -> tuple[dict, dict[str, float]]:
        """The learners' part of the step: old-policy pass (exact log-probs, full-vocabulary entropies), advantages
        (the algorithm's estimator: GRPO's outcome advantage; RAPO adds the retrieval reward and shaping), PPO
        update with global denominators per mini-batch. Returns the update's stats and the stage timings."""
        timer = StageTimer()
        # one optimizer step on fresh rows that nothing reads pi_old's values before: the update's forward is the pass
        skip_pass = old_pass_reason(self.cfg, len(batch), self.algorithm) is None
        old_pass_cpu_s = 0.0
        with timer.stage("old_logprob_s"):
            if skip_pass:
                self.learners.learner_batch(batch)
            else:
                old_pass_cpu_s = self.learners.forward_old(batch)["cpu_s"]
        with timer.stage("advantages_s"):
            compute_advantages(batch, self.algorithm, self.cfg.algo, on=self.cfg.trainer.advantages_on)
        with timer.stage("update_s"):
            update_stats = self.learners.update(batch, self.step_idx, old_from_update=skip_pass)
        if skip_pass:
            fill_step_entropies(batch)  # from the update's own forward, for the metrics and the trajectories
        update_stats["old_pass_skipped"] = float(skip_pass)
        update_stats["old_pass_cpu_s"] = old_pass_cpu_s
        self.learner_version += 1
        return update_stats, timer.seconds

    def _learn_while_rolling_out(self, batch: TrajectoryBatch) -> tuple[dict, dict[str, float]]:
        """``_learn`` in the learner thread while this thread rolls out the next steps, at most
        ``algo.max_staleness`` ahead and never past ``trainer.total_steps``; it stops starting rollouts once the
        learners are done, so their weights reach the fleet without waiting for more. Returns ``_learn``'s stats
        and timings, the latter with ``ahead_rollout_s`` (the rollouts made meanwhile) and ``learner_wait_s`` (the
        wait for the learners after them: the update's time that no rollout covered)."""
        cfg = self.cfg
        timer = StageTimer()
        self._learning = learning = self._learner_thread.submit(self._learn, batch)
        try:
            with timer.stage("ahead_rollout_s"):
                while not learning.done() and len(self.ahead) < cfg.algo.max_staleness:
                    next_step = self.step_idx + 1 + len(self.ahead)
                    if next_step >= cfg.trainer.total_steps:
                        break
                    self.ahead.append(self._roll_out(next_step))
            with timer.stage("learner_wait_s"):
                futures.wait([learning])
        except BaseException:
            futures.wait([learning])  # the learners' part never outlives its step
            if learning.exception() is not None:  # a lost learner is the launcher's to rebuild: it wins
                raise learning.exception() from None
            raise
        finally:
            self._learning = None
        update_stats, learner_seconds = learning.result()
        return update_stats, {**learner_seconds, **timer.seconds}

    def _sample_groups(self, n: int, step: int, first: int = 0) -> list[tuple]:
        """``n`` (group id, Task) pairs for step ``step``, numbered from ``first`` (dynamic sampling's refills
        continue the step's numbering); families take turns, a prompt is drawn uniformly within its family or, with
        ``trainer.prompt_sampling=pass_rate``, by the prompt pool's weights."""
        fams = list(self.train_tasks)
        out = []
        for k in range(first, first + n):
            fam = fams[(step * self.cfg.trainer.prompts_per_step + k) % len(fams)]
            tasks = self.train_tasks[fam]
            if self.prompt_pool is None:
                task = self.rng.choice(tasks)
            else:
                task = self.rng.choices(tasks, weights=self.prompt_pool.weights(tasks))[0]
            out.append((f"s{step}-g{k}-{task.id}", task))
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
        the learners' current weights before its first rollout. During an update in the learner thread
        (algo.max_staleness >= 1) it waits for the update's end and gets the updated weights; after a failed
        update it gets nothing (the step fails where it waits for the learners)."""
        learning = self._learning
        if learning is not None:
            futures.wait([learning])
            if learning.exception() is not None:
                return
        if self.learner_version > 0:
            self.sync.push(self.learners.workers, workers, self.learner_version)

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
        metrics["eval/mean_accuracy"] = mean_or_zero(metrics[f"eval/{f}/accuracy"] for f in self.test_tasks)
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
        if self.ahead:  # the rollouts made ahead of their update: a resume uses them as the straight run would
            (tmp / AHEAD_FILE).write_bytes(pickle.dumps(list(self.ahead)))
        state = {
            "step": self.step_idx,
            "version": self.version,
            "lag_counts": {str(lag): c for lag, c in self.lag_counts.items()},
            "rng": self.rng.getstate(),
            "workers": len(self.fleet.workers),
            "torch_rng": torch.get_rng_state().tolist(),
            "run_metrics": self.run_metrics.get_state(),
        }
        if self.prompt_pool is not None:
            state["prompt_pool"] = self.prompt_pool.get_state()
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
        self.learner_version = self.version
        self.lag_counts = Counter({int(lag): c for lag, c in state.get("lag_counts", {}).items()})
        ahead = path / AHEAD_FILE
        self.ahead = deque(pickle.loads(ahead.read_bytes()) if ahead.is_file() else [])
        rs = state["rng"]
        self.rng.setstate((rs[0], tuple(rs[1]), rs[2]))
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        if "run_metrics" in state:  # checkpoints before the windows existed restart them
            self.run_metrics.set_state(state["run_metrics"])
        if self.prompt_pool is not None:  # a run that switches to pass_rate on resume starts its counts there
            self.prompt_pool.set_state(state.get("prompt_pool", {}))
        self.sync_weights()
        self.fleet.scale(state["workers"])

    def can_keep_fleet(self, lost: LearnerLost) -> bool:
        """Whether the rollout fleet can outlive the learner group that raised ``lost``: it can when it is idle and
        none of its workers depends on the group. Not when the learner died in a weight-sync exchange (the workers may
        be blocked on it), in colocated mode (the workers sit in the learners' placement group), or with
        ``algo.max_staleness >= 1`` (the fleet's rollouts ahead of the update are bound to the lost update)."""
        return not lost.in_weight_push and self.cfg.resources.colocate is not True and self.cfg.algo.max_staleness == 0

    def replace_learners(self) -> None:
        """New learner ranks in place of a group that lost one; the fleet, its workers and their retrieval clients
        stay (``can_keep_fleet``). The new ranks start from the model folder and form a new weight-sync group at the
        next push; the caller then restores a checkpoint with ``load``, which resets this trainer's state too."""
        lost, self.learners = self.learners, None  # (a replacement that fails to start leaves none to stop)
        lost.shutdown(graceful=False)
        self.sync.reset()
        self.learners = LearnerGroup(self.cfg, self.model_dir)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the fleet, the weight sync and the learners. ``graceful=False`` after a learner died."""
        if self._learner_thread is not None:
            self._learner_thread.shutdown(wait=True)
        self.fleet.shutdown()
        self.sync.close()
        if self.learners is not None:
            self.learners.shutdown(graceful)


def push_weights(sync: WeightSync | ColocatedSync, fleet: RolloutFleet, learners: list, version: int) -> int:
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


def rl_task_pool(cfg: Config) -> tuple[dict, dict]:
    """RL questions per family (after the warm-start or cold-start demos) and the tasks that evaluation scores: the
    held-out test tasks or, with ``trainer.eval_on=validation``, the validation questions of each training family
    (the ``trainer.validation_questions`` that follow its RL questions; never trained on)."""
    train, test = task_splits(cfg.tasks)
    n0 = sft_span(cfg)
    pool, validation = {}, {}
    cold = set()  # the data files whose head is the cold start's demonstrations
    if cfg.cold_start.examples and cfg.cold_start.source == "file":
        cold.add(source_name(Path(cfg.cold_start.file)))
    rl, nv = cfg.trainer.rl_questions, cfg.trainer.validation_questions
    for fam, ts in train.items():
        if fam in cfg.tasks.families:  # after the warm start's span, or a real model's cold start drawn from it
            later = ts[max(n0, cfg.cold_start.examples if cfg.cold_start.source == "families" else 0) :]
        else:  # a real data file: after the cold start's head when it drew from this file
            later = ts[cfg.cold_start.examples :] if fam in cold else ts
        if cfg.tasks.difficulty and fam in cfg.tasks.families:
            later = [t for t in later if task_difficulty(t) == cfg.tasks.difficulty]
        pool[fam] = later[:rl]
        if nv:
            validation[fam] = later[rl : rl + nv]
    if cfg.trainer.eval_on == "test":
        return pool, test
    short = {fam: len(ts) for fam, ts in validation.items() if len(ts) < nv}
    if not validation or short:
        raise ConfigError(
            f"trainer.eval_on=validation needs trainer.validation_questions ({nv}) questions after the "
            f"{rl} RL questions of each training family; too few in {short or 'every family'}"
        )
    return pool, validation  # scored under the training family's name (gsm8k_openai, not the test file's gsm8k)
