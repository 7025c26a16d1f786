"""The launcher: the whole Ray topology of a training run in ``run``.

    local Ray (127.0.0.1) or the cluster -> run directory -> warm start -> step-trace buffer in Milvus
    -> Serve retrieval app -> Trainer (learner group, rollout fleet, weight sync) -> train -> evaluate

One RL step is ``Trainer.step`` (rapo_ray/training/trainer.py); what is reported is in rapo_ray/training/reporting.py.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import yaml
from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
from ray.job_config import JobConfig
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rapo_ray.config import Config, diff_configs, from_dict, save_config
from rapo_ray.core.devices import machine_record
from rapo_ray.core.errors import ConfigError, LearnerLost
from rapo_ray.core.files import write_json_atomic
from rapo_ray.core.local_ray import init_local_ray
from rapo_ray.core.metrics import StageTimer
from rapo_ray.core.net import free_port
from rapo_ray.core.transformers_import_cache import cache_transformers_import_scans
from rapo_ray.launch import ray_reaper
from rapo_ray.launch.plan import (
    fit_cpus,
    hybrid_slots,
    learners_start_before_buffer,
    resolve_colocate,
    resource_needs,
)
from rapo_ray.model.factory import set_torch_threads
from rapo_ray.pipelines.buffer import buffer_questions, build_buffer, manifest_path, with_buffer_collection
from rapo_ray.pipelines.cold_start import built_cold_start, cold_start
from rapo_ray.pipelines.sft import built_warm_start, warm_start
from rapo_ray.retrieval.backends import prepare_backend
from rapo_ray.retrieval.service import build_app
from rapo_ray.retrieval.store import MilvusLiteServer
from rapo_ray.training import eval_cache
from rapo_ray.training.checkpoints import newest_complete
from rapo_ray.training.reporting import MetricsLog, Progress, before_after_table, fmt_eval, paired_changes, plot_curves
from rapo_ray.training.trainer import Trainer, rl_task_pool
from rapo_ray.workers.learner import LearnerGroup

# ---------------------------------------------------------------- Ray start-up


# The console shows the progress bar and our messages, not every actor's engine and loader logs: vLLM's INFO
# lines and per-push warnings about weights we do not send on purpose, transformers' weight-loading bars, Serve's
# and Ray Data's INFO lines. A variable the user set in the driver's environment wins (VLLM_LOGGING_LEVEL=INFO
# brings vLLM's log back).
QUIET_ENV = {
    k: os.environ.get(k, v)
    for k, v in {
        "VLLM_LOGGING_LEVEL": "ERROR",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONWARNINGS": "ignore::FutureWarning",  # deprecations inside vLLM and Ray, not ours to fix
        # Ray Data sets its logger's level from this on import and at each execution (a setLevel does not last);
        # the session's ray-data.log then keeps only warnings too
        "RAY_DATA_LOG_LEVEL": "WARNING",
        # torch's C++ warnings (TORCH_WARN) go straight to stderr; vLLM-CPU's engine start gives one per engine
        # ("NUMA binding: Using MEMBIND policy ..."). Set TORCH_CPP_LOG_LEVEL=WARNING to see them again.
        "TORCH_CPP_LOG_LEVEL": "ERROR",
    }.items()
}
SERVE_LOGGING = {"log_level": os.environ.get("RAPO_SERVE_LOG_LEVEL", "WARNING")}


def quiet_driver() -> None:
    """The driver's share of the above: no weight-loading bars, no Serve or Ray Data INFO lines."""
    cache_transformers_import_scans()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", QUIET_ENV["RAY_DATA_LOG_LEVEL"])
    for name in ("ray.serve", "ray.data"):
        logging.getLogger(name).setLevel(SERVE_LOGGING["log_level"])


def init_ray(cfg: Config) -> bool:
    """Connect to a running cluster (``ray job submit`` sets RAY_ADDRESS) or start a local one on
    127.0.0.1. Returns True if this process started Ray."""
    if ray.is_initialized():
        return False
    address = cfg.resources.ray_address or os.environ.get("RAY_ADDRESS", "")
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **QUIET_ENV}}
    if address:
        enable_token_auth_if_available()
        # A submitted job's own env_vars (``ray job submit --runtime-env``) win: Ray refuses to merge a key set twice.
        job_vars = submitted_job_env_vars()
        env["env_vars"] = {k: v for k, v in env["env_vars"].items() if k not in job_vars}
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        return False
    # A local Ray may oversubscribe logical CPUs: every actor runs one torch thread and the learners and
    # rollout workers take turns within a step, so 2 learners + 2 workers share a 2-core laptop fine.
    # Local Ray: loopback only, for Ray itself and for every gloo socket (learners, weight sync).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["env_vars"].update(GLOO_SOCKET_IFNAME="lo", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    rc = cfg.resources
    need = resource_needs(cfg).cpus_max
    # address='local': never join another Ray that happens to run on this machine (ray.init() without an
    # address would); joining is what RAY_ADDRESS / resources.ray_address are for.
    init_local_ray(
        address="local",
        num_cpus=max(os.cpu_count() or 1, int(need + 0.999)),
        object_store_memory=rc.object_store_mb << 20,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env=env,
        log_to_driver=True,
        logging_level=logging.WARNING,
    )
    global _reaper
    _reaper = ray_reaper.watch(ray._private.worker._global_node.get_session_dir_path())  # the Ray goes with us
    return True


_reaper = None  # the local Ray's reaper (rapo_ray/launch/ray_reaper.py), referenced for the driver's lifetime


def submitted_job_env_vars() -> dict:
    """The env_vars of the runtime env this driver was submitted with (``ray job submit``); {} outside a job."""
    raw = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    if not raw:
        return {}
    runtime_env = JobConfig.from_json(json.loads(raw)).runtime_env or {}
    return dict(runtime_env.get("env_vars") or {})


def enable_token_auth_if_available() -> None:
    """Ray 2.60 turns token auth on for clusters started on this machine (`ray start --head`), but a driver that
    connects by address only sends the token when RAY_AUTH_MODE=token. Use the token when one exists."""
    if os.environ.get("RAY_AUTH_MODE"):
        return  # explicit choice
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def check_resources(cfg: Config, log=print) -> None:
    """Fail before any work if the cluster cannot host the learners and the starting fleet; on a cluster with too
    few CPUs, shrink the CPU shares to fit (``resources.fit_cpus``: a 2-CPU head runs the default job)."""
    if _autoscaling_cluster():
        return  # nodes come when asked for
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
    colocated = resolve_colocate(cfg, gpus)
    if colocated:
        log(colocated)
    need = resource_needs(cfg)
    if need.gpus_start > gpus:
        raise ConfigError(
            f"resources: the run needs {need.gpus_start:g} GPUs (learner.world_size x resources.gpus_per_learner + "
            f"rollout.num_workers x resources.gpus_per_rollout_worker + retrieval.min_replicas x retrieval.num_gpus; "
            f"colocated, a learner rank and its worker share one) "
            f"but the cluster has {gpus:g}"
        )
    fitted = fit_cpus(cfg, cpus)
    if fitted:
        log(fitted)


def _serve_running() -> bool:
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False) is not None


def _autoscaling_cluster() -> bool:
    return bool(os.environ.get("RAPO_AUTOSCALING_CLUSTER"))


# ---------------------------------------------------------------- run directory


@dataclass
class RunDir:
    path: Path

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def trajectories(self) -> Path:
        return self.path / "trajectories"

    def create(self, cfg: Config) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.path / "config.yaml")

    def latest_checkpoint(self, warn=print) -> Path | None:
        """The newest complete checkpoint (its files match its manifest); newer broken ones are skipped with a
        warning. ``CheckpointError`` if there are checkpoints and none is complete."""
        return newest_complete(self.checkpoints, warn)


def make_run_dir(cfg: Config, create: bool = True) -> RunDir:
    """A new, empty run directory with the config in it (``create=False``: checked, made later by
    ``RunDir.create``); or, with ``checkpoint.resume``, the existing one (refused when its config differs in
    anything but run/resource fields)."""
    if cfg.checkpoint.resume:
        p = Path(cfg.checkpoint.resume)
        root = p if (p / "config.yaml").is_file() else p.parent.parent
        if not (root / "config.yaml").is_file():
            raise ConfigError(f"checkpoint.resume={p}: not a run directory or a checkpoint inside one")
        old = from_dict(yaml.safe_load((root / "config.yaml").read_text()))
        diff = diff_configs(
            old,
            cfg,
            ignore=(
                "checkpoint.",
                "trainer.total_steps",
                "run.",
                "rollout.num_workers",
                "rollout.engine",
                "resources.",
                "serve.",
            ),
        )
        if diff:
            raise ConfigError(f"cannot resume {root}: config differs in {diff}")
        return RunDir(root)
    name = cfg.run.name or f"{cfg.algo.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(cfg.run.output_dir) / name
    if path.exists() and any(path.iterdir()):
        raise ConfigError(f"run directory {path} already exists and is not empty (choose run.name or resume it)")
    run_dir = RunDir(path)
    if create:
        run_dir.create(cfg)
    return run_dir


# ---------------------------------------------------------------- services the trainer uses


def _failed_why(app_status) -> str:
    """The last line of each failed deployment's message: Serve's app message only names the deployments, and a
    deployment's message ends with its constructor's exception after a long traceback."""
    why = []
    for name, dep in app_status.deployments.items():
        lines = [line for line in (dep.message or "").splitlines() if line.strip()]
        if dep.status != "HEALTHY" and lines:
            why.append(f"{name}: {lines[-1].strip()}")
    return "".join(f"\n  {w}" for w in why)


class RetrievalService:
    """RAPO's step-trace buffer in Milvus (embedded milvus-lite unless ``retrieval.milvus_uri``), built once,
    behind the Serve app ``retrieval``. ``app`` is None for algorithms without hybrid slots.

    The constructor returns once the app is deployed, not once its replicas are up: the caller starts the
    learners and the fleet meanwhile (the replica's start is mostly one core's imports and embedder load, ~20 s
    on a 2-core box) and calls ``wait_ready`` before the first rollout."""

    def __init__(self, cfg: Config, model_dir: Path, questions: list, log=print):
        """``questions``: the questions whose off-policy steps fill the buffer (``buffer_questions``)."""
        self.app: str | None = None
        self._server = None
        self._serve_started = False
        if hybrid_slots(cfg) == 0:
            return
        from ray import serve

        cfg = with_buffer_collection(cfg, str(model_dir))
        uri = cfg.retrieval.milvus_uri
        if not uri:  # embedded default: milvus-lite as a managed child process, shared by URI
            self._server = MilvusLiteServer(Path(cfg.run.artifacts_dir) / "milvus")
            uri = self._server.uri
        report = build_buffer(cfg, str(model_dir), uri, questions, manifest_path(cfg), log=log)
        log(report.table())
        self._serve_started = not _serve_running()  # a Serve someone else started (a cluster's, a test's) stays up
        if self._serve_started:
            serve.start(http_options={"host": "127.0.0.1", "port": free_port()}, logging_config=SERVE_LOGGING)
        logging.getLogger("ray.serve").setLevel(SERVE_LOGGING["log_level"])  # serve.start sets the driver's to INFO
        self.app = "retrieval"
        files = prepare_backend(cfg.retrieval.embedder, cfg.run.artifacts_dir, cfg.retrieval.pooling)  # built once
        target = serve.RunTarget(
            build_app(cfg.retrieval, uri, embedder_files=files), self.app, "/retrieve", SERVE_LOGGING
        )
        # the deployment exists when this returns (rollout workers can take handles to it); its replicas start
        serve.run_many([target], wait_for_applications_running=False)

    def wait_ready(self, poll_s: float = 0.2) -> None:
        """Block until the app's replicas serve (Serve's RUNNING); a failed deploy raises with Serve's reason."""
        from ray import serve
        from ray.serve.schema import ApplicationStatus

        while self.app is not None:
            app = serve.status().applications.get(self.app)
            if app is None:
                raise RuntimeError(f"the Serve app {self.app!r} disappeared while its replicas were starting")
            if app.status == ApplicationStatus.RUNNING:
                return
            if app.status == ApplicationStatus.DEPLOY_FAILED:
                raise RuntimeError(f"the Serve app {self.app!r} failed to deploy: {app.message}{_failed_why(app)}")
            time.sleep(poll_s)

    def close(self, local_ray_ending: bool = False) -> None:
        """``local_ray_ending``: the caller shuts down the local Ray it started next, which ends Serve with it; a
        graceful ``serve.shutdown`` first would only add its wait to the end of every run."""
        from ray import serve

        if self._serve_started:
            if not local_ray_ending:
                serve.shutdown()
        elif self.app is not None:
            serve.delete(self.app)
        if self._server is not None:
            self._server.stop()


@ray.remote(num_cpus=0, max_calls=1)
def _train_starting_policy(cfg: Config) -> str:
    """``starting_policy``'s SFT in a worker process that exits when it returns (``max_calls=1``)."""
    set_torch_threads(len(os.sched_getaffinity(0)))  # nothing else of the run computes yet
    quiet_driver()
    return str(cold_start(cfg) if not cfg.model.bundled else warm_start(cfg))


def starting_policy(cfg: Config, log=print) -> Path:
    """A real model (``model.path`` or ``model.preset``) after its cold start, if one is configured, or the bundled
    model's warm start. Both are built once and cached. With Ray up, the build's SFT runs in a worker process on
    this node (where ``run.artifacts_dir`` is) that exits after it: a real model's training memory (8 GB for
    SmolLM2-135M) goes back to the OS instead of staying in the driver for the whole run."""
    built = built_cold_start(cfg, log) if not cfg.model.bundled else built_warm_start(cfg)
    if built is not None:
        return Path(built)
    if not ray.is_initialized():
        return Path(cold_start(cfg, log=log) if not cfg.model.bundled else warm_start(cfg, log=log))
    what = "cold start (SFT on solutions)" if not cfg.model.bundled else "warm start (SFT on expert demonstrations)"
    log(f"building the starting policy's {what} once, in a worker process on this node")
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return Path(ray.get(_train_starting_policy.options(scheduling_strategy=here).remote(cfg)))


def evaluate_starting_policy(cfg: Config, trainer, model_dir: Path, log=print) -> tuple[dict, dict]:
    """The starting policy's held-out (metrics, problem id -> solved): from the shared cache when an equal
    evaluation ran before (``trainer.reuse_eval_before``; ``training.eval_cache``), else evaluated and cached."""
    if not cfg.trainer.reuse_eval_before:
        ev = trainer.evaluate()
        return ev.metrics, ev.problems
    path = eval_cache.cache_path(cfg, eval_cache.eval_key(cfg, model_dir, trainer.eval_groups()))
    cached = eval_cache.load_cached(path)
    if cached is not None:
        log(f"held-out before training: reusing {path} (same weights, problems, settings and code)")
        return cached
    ev = trainer.evaluate()
    eval_cache.store(path, ev.metrics, ev.problems, model_dir)
    return ev.metrics, ev.problems


# ---------------------------------------------------------------- the launcher: the whole topology


@dataclass
class RunParts:
    """What a run has started so far, for its stages and for the clean-up at its end (``close_run``)."""

    run_dir: RunDir
    startup: StageTimer  # wall seconds per start-up stage: logged before the first step, kept in summary.json
    metrics: MetricsLog | None = None
    retrieval: RetrievalService | None = None
    learners: LearnerGroup | None = None  # started before the trainer exists; the trainer's once it does
    trainer: Trainer | None = None
    model_dir: Path | None = None
    tasks: tuple | None = None  # (RL questions per family, held-out tasks): the buffer's and the trainer's
    failures: int = 0  # learner losses survived


def run(cfg: Config, log=print, process_started_at: float | None = None) -> dict:
    """Warm start -> buffer -> retrieval service -> learners + fleet -> train -> evaluate. Returns the summary.
    ``process_started_at``: the process's start (epoch seconds), when the caller is the job's own process: its
    imports then count into the start-up's timing."""
    startup = StageTimer()
    if process_started_at is not None:
        startup.add("python and imports", time.time() - process_started_at)
    set_torch_threads(1)
    quiet_driver()
    # the run directory, a resume's config and its checkpoint are checked before any process starts (and a
    # new run's folder is made only once the cluster can host the run)
    run_dir = make_run_dir(cfg, create=False)
    resume = run_dir.latest_checkpoint(log) if cfg.checkpoint.resume else None
    # this run connects to Ray (or starts it) and so disconnects at its end, in the main thread, also as a submitted
    # job's driver on a cluster (whose Ray stays up); a caller that had Ray initialized keeps it
    owns_ray = not ray.is_initialized()
    started_local_ray = connect_ray(cfg, startup, owns_ray, log)
    if not cfg.checkpoint.resume:
        run_dir.create(cfg)
    log(f"run directory: {run_dir.path}")
    parts = RunParts(run_dir, startup)
    frozen = False
    try:
        parts.metrics = MetricsLog(run_dir.path, cfg, log)
        start_run_parts(cfg, parts, log)
        before, before_problems = held_out_before(cfg, parts, resume, log)
        log(startup.line("start-up"))
        # What start-up made lives for the run: frozen, the garbage collector's full passes (one every few steps, as
        # every worker's trajectories arrive) no longer walk it
        gc.freeze()
        frozen = True
        train_steps(cfg, parts, log)
        return finish_run(cfg, parts, before, before_problems, log)
    finally:
        if frozen:  # back to the collector for a caller that goes on (a notebook, a sweep, the tests)
            gc.unfreeze()
        close_run(parts, owns_ray, local_ray_ending=owns_ray and started_local_ray)


def connect_ray(cfg: Config, startup: StageTimer, owns_ray: bool, log=print) -> bool:
    """Ray up (local on 127.0.0.1, or the cluster) and able to host the run; True when this call started a local
    Ray. A run that cannot be hosted disconnects again (when it connected) and raises."""
    try:
        with startup.stage("ray"):
            started_local_ray = init_ray(cfg)
            check_resources(cfg, log)
    except BaseException:
        if owns_ray and ray.is_initialized():
            ray.shutdown()
        raise
    return started_local_ray


def start_run_parts(cfg: Config, parts: RunParts, log=print) -> None:
    """1. the starting policy, 2. RAPO's buffer behind Serve, 3. the learners, the fleet and the weight sync."""
    startup = parts.startup
    with startup.stage("starting policy"):
        parts.model_dir = starting_policy(cfg, log)
    log(f"starting policy: {parts.model_dir}")
    parts.tasks = rl_task_pool(cfg)
    # the learner ranks start (imports, model, optimizer: a core's worth of work for several seconds each)
    # while the buffer is checked and Serve deploys, which leave the other cores idle; where a build of the buffer
    # would not fit beside them, the trainer starts them after it
    if learners_start_before_buffer(cfg, ray.available_resources().get("CPU", 0.0)):
        with startup.stage("learner group start"):
            parts.learners = LearnerGroup(cfg, parts.model_dir, wait=False)
    with startup.stage("buffer and retrieval deploy"):
        parts.retrieval = RetrievalService(cfg, parts.model_dir, buffer_questions(cfg, parts.tasks[0]), log)
    # the rollout fleet starts while the replica does
    parts.trainer = Trainer(
        cfg, parts.model_dir, parts.run_dir.checkpoints, parts.retrieval.app, parts.tasks, parts.learners
    )
    parts.learners = None  # the trainer's now
    for stage, seconds in parts.trainer.startup.seconds.items():
        startup.add(stage, seconds)
    with startup.stage("retrieval replicas ready"):
        parts.retrieval.wait_ready()


def held_out_before(cfg: Config, parts: RunParts, resume: Path | None, log=print) -> tuple[dict, dict]:
    """The starting policy's held-out (metrics, problem id -> solved), saved in the run directory; a resume loads
    its checkpoint and reads them back instead."""
    trainer, metrics = parts.trainer, parts.metrics
    before_path = parts.run_dir.path / "eval_before.json"
    if resume is not None:
        trainer.load(resume)
        metrics.rewind(trainer.step_idx)
        log(f"resumed from {resume} at step {trainer.step_idx}")
        saved = json.loads(before_path.read_text()) if before_path.is_file() else {}
        before_problems = saved.pop("problems", {})
        return saved, before_problems
    with parts.startup.stage("first weight push"):
        trainer.sync_weights()
    with parts.startup.stage("held-out before"):
        before, before_problems = evaluate_starting_policy(cfg, trainer, parts.model_dir, log)
    write_json_atomic(before_path, {**before, "problems": before_problems})
    metrics.log({"step": 0, **before})  # the held-out curve's first point (kept by a resume's rewind)
    log("held-out before training: " + fmt_eval(before))
    return before, before_problems


def train_steps(cfg: Config, parts: RunParts, log=print) -> None:
    """4. RL steps to trainer.total_steps, with the held-out curve and checkpoints on their schedules; a lost
    learner (node loss) rebuilds the learners, and the fleet where it must, from the last checkpoint
    (``rebuild_after_loss``)."""
    progress = Progress(cfg.run.progress, cfg.trainer.total_steps, parts.trainer.step_idx, cfg.algo.name, log)
    while parts.trainer.step_idx < cfg.trainer.total_steps:
        trainer = parts.trainer
        try:
            m = trainer.step(parts.run_dir.trajectories)
            parts.metrics.log(m)
            step = trainer.step_idx
            if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and step < cfg.trainer.total_steps:
                ev = trainer.evaluate().metrics
                parts.metrics.log({"step": step, **ev})
                m.update(ev)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                trainer.save()
        except LearnerLost as exc:
            rebuild_after_loss(cfg, parts, exc, log)
            continue
        progress.update(m)
    progress.close()


def rebuild_after_loss(cfg: Config, parts: RunParts, exc: LearnerLost, log=print) -> None:
    """New learners in place of a group that lost one, at the last checkpoint or the starting policy; past
    trainer.max_failures, the run stops and names the checkpoint to resume from. The fleet stays where it can
    (``Trainer.can_keep_fleet``, with a checkpoint to restore the trainer's state from): only the learner ranks start
    again. Otherwise the whole trainer (learners and fleet) is built anew."""
    run_dir = parts.run_dir
    parts.failures += 1
    latest = run_dir.latest_checkpoint(log)
    log(f"step {parts.trainer.step_idx + 1} stopped: {exc}; failure {parts.failures}/{cfg.trainer.max_failures}")
    if parts.failures > cfg.trainer.max_failures:
        parts.trainer.shutdown(graceful=False)
        parts.trainer = None
        raise RuntimeError(
            f"{exc}; gave up after {cfg.trainer.max_failures} rebuilds (trainer.max_failures). The last "
            f"checkpoint is {latest}; continue with checkpoint.resume={run_dir.path}"
        ) from None
    keep_fleet = latest is not None and parts.trainer.can_keep_fleet(exc)
    if keep_fleet:  # both wait for resources to return
        parts.trainer.replace_learners()
    else:
        parts.trainer.shutdown(graceful=False)
        parts.trainer = None  # (a new one that fails to start leaves none to stop)
        parts.trainer = Trainer(cfg, parts.model_dir, run_dir.checkpoints, parts.retrieval.app, parts.tasks)
    if latest is not None:
        parts.trainer.load(latest)
    else:
        parts.trainer.sync_weights()
    parts.metrics.rewind(parts.trainer.step_idx)
    rebuilt = "the learners (the fleet kept)" if keep_fleet else "the learners and fleet"
    log(f"rebuilt {rebuilt}; resumed at step {parts.trainer.step_idx} from {latest or 'the starting policy'}")


def finish_run(cfg: Config, parts: RunParts, before: dict, before_problems: dict, log=print) -> dict:
    """5. held-out after training, the final checkpoint and summary.json (whose presence marks a finished run)."""
    trainer, metrics, run_dir = parts.trainer, parts.metrics, parts.run_dir
    final = trainer.evaluate()
    after = final.metrics
    metrics.log({"step": trainer.step_idx, **after})
    write_json_atomic(run_dir.path / "eval_after.json", {**after, "problems": final.problems})
    ck = trainer.save()
    change = paired_changes(before_problems, final.problems)
    summary = {
        "run_dir": str(run_dir.path),
        "checkpoint": str(ck),
        "steps": trainer.step_idx,
        "learner_failures": parts.failures,
        # trajectories per policy-version lag at their update (algo.max_staleness); all 0 when synchronous
        "staleness_lags": {str(lag): n for lag, n in sorted(trainer.lag_counts.items())},
        "before": before,
        "after": after,
        "paired_change": change,
        "weight_sync": trainer.sync.kind,  # resources.colocate: shared memory, else the network sync
        "mean_step_s": metrics.mean("step_s"),
        "startup_s": {stage: round(s, 2) for stage, s in parts.startup.seconds.items()},
        "machine": machine_record(),
    }
    write_json_atomic(run_dir.path / "summary.json", summary)
    plot_curves(run_dir.path, metrics.history)
    log("held-out after training:  " + fmt_eval(after))
    log(before_after_table(before, after, change))
    return summary


def close_run(parts: RunParts, owns_ray: bool, local_ray_ending: bool) -> None:
    """Stop what the run started, newest first, and disconnect from Ray when the run connected."""
    if parts.trainer is not None:
        parts.trainer.shutdown()
    elif parts.learners is not None:  # started, but the run stopped before its trainer took them
        parts.learners.shutdown(graceful=False)
    if parts.retrieval is not None:
        parts.retrieval.close(local_ray_ending=local_ray_ending)
    if parts.metrics is not None:
        parts.metrics.close()
    if owns_ray:
        ray.shutdown()
