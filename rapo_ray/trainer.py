"""The main job: the whole Ray topology in ``run`` and one RL step top to bottom in ``Trainer.step``.

    topology (run):    local Ray (127.0.0.1) or the cluster -> warm start -> step-trace buffer in Milvus
                       -> Serve retrieval app -> learner group (FSDP2) -> rollout fleet -> weight hub
    one step (step):   sample prompts -> rollout (fleet) -> old-policy pass (learner: log-probs, entropies)
                       -> advantages (GRPO / RAPO) -> PPO update (learner) -> weight sync (collective)
                       -> log -> maybe evaluate / checkpoint
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from rapo_ray.config import Config, ConfigError, diff_configs, from_dict, save_config, to_dict
from rapo_ray.net import free_port


# ---------------------------------------------------------------- Ray start-up


def init_ray(cfg: Config) -> bool:
    """Connect to a running cluster (``ray job submit`` sets RAY_ADDRESS) or start a local one on
    127.0.0.1. Returns True if this process started Ray."""
    if ray.is_initialized():
        return False
    address = cfg.resources.ray_address or os.environ.get("RAY_ADDRESS", "")
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}}
    if address:
        _enable_token_auth_if_available()
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        return False
    # A local Ray may oversubscribe logical CPUs: every actor runs one torch thread and the learners and
    # rollout workers take turns within a step, so 2 learners + 2 workers share a 2-core laptop fine.
    # Local Ray: loopback only, for Ray itself and for every gloo socket (learners, weight sync).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["env_vars"].update(GLOO_SOCKET_IFNAME="lo", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    rc = cfg.resources
    need = cfg.learner.world_size * rc.cpus_per_learner + cfg.rollout.max_workers * rc.cpus_per_rollout_worker
    # address='local': never join another Ray that happens to run on this machine (ray.init() without an
    # address would); joining is what RAY_ADDRESS / resources.ray_address are for.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), object_store_memory=cfg.resources.object_store_mb << 20, include_dashboard=False,
             _node_ip_address="127.0.0.1", runtime_env=env, log_to_driver=True)
    return True


def _enable_token_auth_if_available() -> None:
    """Ray 2.60 turns token auth on for clusters started on this machine (`ray start --head`), but a driver that
    connects by address only sends the token when RAY_AUTH_MODE=token. Use the token when one exists."""
    if os.environ.get("RAY_AUTH_MODE"):
        return  # explicit choice
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def check_resources(cfg: Config) -> None:
    """Fail before any work if the cluster cannot host the learners and the fleet."""
    total = ray.cluster_resources()
    rc = cfg.resources
    cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
    need_gpu = cfg.learner.world_size * rc.gpus_per_learner + cfg.rollout.min_workers * rc.gpus_per_rollout_worker
    if need_gpu > gpus and not _autoscaling_cluster():
        raise ConfigError(f"resources: the run needs {need_gpu:g} GPUs (learner.world_size x resources.gpus_per_learner + "
                          f"rollout.min_workers x resources.gpus_per_rollout_worker) but the cluster has {gpus:g}")
    need_cpu = cfg.learner.world_size * rc.cpus_per_learner + cfg.rollout.min_workers * rc.cpus_per_rollout_worker
    if need_cpu > cpus and not _autoscaling_cluster():
        raise ConfigError(f"resources: learner.world_size={cfg.learner.world_size} x resources.cpus_per_learner="
                          f"{rc.cpus_per_learner:g} + rollout.min_workers={cfg.rollout.min_workers} x resources.cpus_per_rollout_worker="
                          f"{rc.cpus_per_rollout_worker:g} = {need_cpu:g} CPUs, but the cluster has {cpus:g}")


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

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p for p in self.checkpoints.glob("step-*") if (p / "COMPLETE").is_file())
        return done[-1] if done else None


def make_run_dir(cfg: Config) -> RunDir:
    if cfg.checkpoint.resume:
        p = Path(cfg.checkpoint.resume)
        root = p if (p / "config.yaml").is_file() else p.parent.parent
        if not (root / "config.yaml").is_file():
            raise ConfigError(f"checkpoint.resume={p}: not a run directory or a checkpoint inside one")
        old = _load_saved_config(root / "config.yaml")
        diff = diff_configs(old, cfg, ignore=("checkpoint.", "trainer.total_steps", "run.", "rollout.num_workers",
                                              "rollout.engine", "resources.", "serve."))
        if diff:
            raise ConfigError(f"cannot resume {root}: config differs in {diff}")
        return RunDir(root)
    name = cfg.run.name or f"{cfg.algo.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(cfg.run.output_dir) / name
    if path.exists() and any(path.iterdir()):
        raise ConfigError(f"run directory {path} already exists and is not empty (choose run.name or resume it)")
    path.mkdir(parents=True, exist_ok=True)
    save_config(cfg, path / "config.yaml")
    return RunDir(path)


def _load_saved_config(path: Path) -> Config:
    import yaml

    return from_dict(yaml.safe_load(path.read_text()))


# ---------------------------------------------------------------- the trainer


class LearnerLost(RuntimeError):
    """A learner actor died (its node went away): the step cannot finish; rebuild from the last checkpoint."""


def _gather(refs: list) -> list:
    """ray.get for learner calls that fails fast: the surviving ranks of a group that lost one would wait in a
    collective, so the first dead rank ends the wait."""
    results, pending = {}, list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            results[ready[0]] = ray.get(ready[0])  # each result fetched once (a full state dict can be GBs)
        # ObjectLostError: the learner finished, but its node went away before its result was fetched
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.ObjectLostError) as exc:
            raise LearnerLost(f"a learner died: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    return [results[r] for r in refs]


class Trainer:
    def __init__(self, cfg: Config, model_dir: Path, run_dir: RunDir, retrieval_app: str | None, log=print):
        from rapo_ray.learner import LearnerWorker
        from rapo_ray.model import load_tokenizer
        from rapo_ray.rollout import RolloutFleet
        from rapo_ray.sync import WeightSync

        self.cfg, self.model_dir, self.run_dir, self.log = cfg, Path(model_dir), run_dir, log
        self.retrieval_app = retrieval_app
        self.tok = load_tokenizer(model_dir)
        self.train_tasks, self.test_tasks = rl_task_pool(cfg)
        self.step_idx, self.version = 0, 0
        self.rng = random.Random(cfg.trainer.seed)
        self.metrics_path = run_dir.path / "metrics.jsonl"
        self.traj_dir = run_dir.path / "trajectories"
        self.traj_dir.mkdir(exist_ok=True)
        self.history: list[dict] = []
        self.tb = _tensorboard(run_dir.path) if cfg.run.tensorboard else None

        # learner group in a placement group, one torch.distributed group
        lc, rc = cfg.learner, cfg.resources
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": rc.cpus_per_learner} | ({"GPU": rc.gpus_per_learner} if rc.gpus_per_learner else {}) | dict(rc.learner_custom_resources)
        self.pg = placement_group([bundle] * lc.world_size, strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=rc.placement_timeout_s)
        if not ready:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            raise RuntimeError(f"the learner placement group ({lc.world_size} x {bundle}) could not be scheduled within "
                               f"{rc.placement_timeout_s:g} s (resources.placement_timeout_s)")
        actor = ray.remote(num_cpus=rc.cpus_per_learner, num_gpus=rc.gpus_per_learner,
                           resources=dict(rc.learner_custom_resources) or None)(LearnerWorker)
        port = free_port()
        cfg_dict = to_dict(cfg)
        self.learners = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r))
                         .remote(r, lc.world_size, port, str(model_dir), cfg_dict, lc.backend) for r in range(lc.world_size)]
        _gather([l.ready.remote() for l in self.learners])
        self.sync = WeightSync(cfg.sync.bucket_mb)
        self._latest_weights: dict | None = None
        self.fleet = RolloutFleet(model_dir, cfg, retrieval_app, weights_source=lambda: (self._latest_weights, self.version))

    # ------------------------------------------------------------ one RL step, top to bottom

    def step(self) -> dict:
        from rapo_ray.learner import split_for_ranks

        cfg, a = self.cfg, self.cfg.algo
        t_step = time.perf_counter()
        # 1. sample prompts (one group per prompt)
        groups = self._sample_groups(cfg.trainer.prompts_per_step)
        n_hybrid = a.n_hybrid if a.name == "rapo" else 0
        # 2. rollout on the fleet (resized to the backlog first when autoscaling is on)
        if cfg.rollout.autoscale:
            self.fleet.autoscale(len(groups), cfg.rollout.groups_per_worker)
        t0 = time.perf_counter()
        rows, rstats = self.fleet.run_step(groups, a.group_size, n_hybrid, seed=cfg.trainer.seed * 7919 + self.step_idx)
        rollout_s = time.perf_counter() - t0
        self._check_staleness(rows)
        # 3. old-policy pass: exact log-probs and full-vocabulary entropies
        t0 = time.perf_counter()
        lrows = [self._learner_row(r) for r in rows]
        per_rank = split_for_ranks(lrows, len(self.learners), micro=max(1, cfg.learner.mini_batch_size // len(self.learners)))
        old = _gather([l.forward_old.remote(mb) for l, mb in zip(self.learners, per_rank)])
        self._attach_old(lrows, old, len(self.learners))
        old_s = time.perf_counter() - t0
        # 4. advantages (GRPO outcome advantage; RAPO adds the retrieval advantage and shaping)
        adv_info = self._advantages(rows, lrows)
        # 5. PPO update with global denominators per mini-batch
        t0 = time.perf_counter()
        upd = self._update(lrows)
        update_s = time.perf_counter() - t0
        # 6. weight sync to every rollout engine
        t0 = time.perf_counter()
        self.version += 1
        self._push_weights()
        sync_s = time.perf_counter() - t0
        self.step_idx += 1
        # 7. log
        gen_tokens = sum(r["num_generated_tokens"] for r in rows)
        m = {
            "step": self.step_idx, "version": self.version,
            "reward": _mean(r["reward"] for r in rows), "accuracy": _mean(float(r["correct"]) for r in rows),
            "format_valid": _mean(float(r["format_ok"]) for r in rows),
            "hybrid_reward": _mean(r["reward"] for r in rows if r["slot_kind"] == "hybrid"),
            "on_policy_reward": _mean(r["reward"] for r in rows if r["slot_kind"] != "hybrid"),
            "rollout_s": rollout_s, "old_logprob_s": old_s, "update_s": update_s, "sync_s": sync_s,
            "generate_s": rstats["generate_s"], "tool_s": rstats["tool_s"], "retrieve_s": rstats["retrieve_s"],
            "rollout_tokens": sum(len(r["response_ids"]) for r in rows), "generated_tokens": gen_tokens,
            "tool_calls": sum(r["tool_calls"] for r in rows), "retrievals": sum(r["num_retrievals"] for r in rows),
            "retrieval_fallbacks": sum(r["retrieval_fallbacks"] for r in rows),
            "retrieved_token_fraction": _mean(r["retrieved_fraction"] for r in rows),
            "entropy": adv_info["entropy"], "retrieval_reward": adv_info["z_ret_mean"], "advantages_s": adv_info["advantages_s"],
            "requeued_groups": rstats["requeued_groups"], "workers": len(self.fleet.workers),
            **{f"update/{k}": v for k, v in upd.items()},
        }
        m["step_s"] = time.perf_counter() - t_step
        m["tokens_per_s"] = gen_tokens / max(rollout_s, 1e-9)
        # learner throughput: every sequence token goes through forward and backward once per PPO epoch
        seq_tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
        m["learner_tokens_per_s"] = seq_tokens * cfg.learner.ppo_epochs / max(update_s, 1e-9)
        if cfg.retrieval.insert_on_policy and self.retrieval_app:
            m["inserted_steps"] = self._insert_on_policy(rows)
        self._write_trajectories(rows)
        self._log(m)
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

    def _check_staleness(self, rows):
        lag = max((self.version - r["policy_version"]) for r in rows) if rows else 0
        if lag > self.cfg.algo.max_staleness and self.cfg.algo.stale_policy == "refuse":
            raise RuntimeError(f"trajectories are {lag} policy versions old (algo.max_staleness={self.cfg.algo.max_staleness})")

    def _learner_row(self, r: dict):
        from rapo_ray.learner import LearnerRow

        return LearnerRow(list(r["prompt_ids"]) + list(r["response_ids"]), len(r["prompt_ids"]), list(r["loss_mask"]))

    @staticmethod
    def _attach_old(lrows, old, world):
        per_rank_rows = [lrows[r::world] for r in range(world)]
        for r in range(world):
            flat = [x for mb in old[r] for x in mb]
            for row, (logp, ent) in zip(per_rank_rows[r], flat):
                row.old_logprobs, row.entropies = logp, ent

    def _advantages(self, rows, lrows) -> dict:
        from rapo_ray.algos import group_advantages, step_entropies

        a = self.cfg.algo
        ent_means = []
        for r, lr in zip(rows, lrows):
            segs = [(s["kind"], s["start"], s["end"]) for s in r["segments"]]
            r["step_entropies"] = step_entropies(torch.tensor(lr.entropies), segs)  # exact, from the learner's pass
            if r["step_entropies"]:
                ent_means.append(sum(r["step_entropies"]) / len(r["step_entropies"]))
        batch = {"row": list(range(len(rows))), "group_id": [r["group_id"] for r in rows], "reward": [float(r["reward"]) for r in rows],
                 "step_entropies": [[float(h) for h in r["step_entropies"]] for r in rows],
                 "retrieval_before": [[int(x["step_before"]) for x in r["retrievals"]] for r in rows],
                 "retrieval_after": [[-1 if x["step_after"] is None else int(x["step_after"]) for x in r["retrievals"]] for r in rows],
                 "num_retrieved_tokens": [int(r["num_retrieved_tokens"]) for r in rows],
                 "num_response_tokens": [len(r["response_ids"]) for r in rows]}
        t0 = time.perf_counter()
        if self.cfg.trainer.advantages_on == "ray_data":
            from rapo_ray.data_flow import advantages_with_ray_data

            out = advantages_with_ray_data(batch, a)
        else:
            out = group_advantages(batch, a)
        elapsed = time.perf_counter() - t0
        for i, (r, lr) in enumerate(zip(rows, lrows)):
            lr.advantage, lr.shaping = float(out["advantage"][i]), float(out["shaping"][i])
            r["advantage"], r["retrieval_reward"], r["shaping"] = lr.advantage, float(out["retrieval_reward"][i]), lr.shaping
        hybrid_z = [r["retrieval_reward"] for r in rows if r["num_retrievals"]]
        return {"entropy": _mean(ent_means), "z_ret_mean": _mean(hybrid_z), "advantages_s": elapsed}

    def _update(self, lrows) -> dict:
        from rapo_ray.algos import aggregation_denominator
        from rapo_ray.learner import split_for_ranks

        lc, world = self.cfg.learner, len(self.learners)
        agg = self.cfg.algo.loss_agg_mode
        out: dict[str, float] = {}
        for epoch in range(lc.ppo_epochs):
            order = list(range(len(lrows)))
            random.Random(self.cfg.trainer.seed * 31 + self.step_idx * 7 + epoch).shuffle(order)
            minis = [[lrows[j] for j in order[i:i + lc.mini_batch_size]] for i in range(0, len(order), lc.mini_batch_size)]
            denoms = []  # each mini-batch's global loss denominator, agreed before any rank computes a loss
            for mini in minis:
                mask = torch.zeros(len(mini), max(len(r.loss_mask) for r in mini))
                for i, r in enumerate(mini):
                    mask[i, :len(r.loss_mask)] = torch.tensor(r.loss_mask, dtype=torch.float32)
                denoms.append(aggregation_denominator(mask, agg))
            if self.cfg.trainer.learner_feed == "streaming_split":
                stats = self._update_streaming(minis, denoms)
            else:
                per_rank: list[list] = [[] for _ in range(world)]
                for mini, denom in zip(minis, denoms):
                    split = split_for_ranks(mini, world, micro=max(1, math_ceil(len(mini), world)))
                    for rank in range(world):
                        per_rank[rank].append((split[rank], denom))
                stats = _gather([l.update.remote(per_rank[r]) for r, l in enumerate(self.learners)])
            for k in stats[0]:
                out[k] = sum(s[k] for s in stats) / world if k != "loss_sum" else sum(s[k] for s in stats)
        return out

    def _update_streaming(self, minis, denoms) -> list[dict]:
        """One epoch's mini-batches as a Ray Data dataset (one block per micro-batch's worth of rows), read by
        the learners through ``streaming_split``; each row carries its mini-batch index."""
        import pyarrow as pa

        world = len(self.learners)
        micro = max(1, math_ceil(self.cfg.learner.mini_batch_size, world))
        rows = [(k, r) for k, mini in enumerate(minis) for r in mini]
        blocks = [pa.table({"mb": [k for k, _ in chunk], "input_ids": [r.input_ids for _, r in chunk],
                            "prompt_len": [r.prompt_len for _, r in chunk], "loss_mask": [r.loss_mask for _, r in chunk],
                            "advantage": [float(r.advantage) for _, r in chunk], "shaping": [float(r.shaping) for _, r in chunk],
                            "old_logprobs": [r.old_logprobs for _, r in chunk]})
                  for chunk in (rows[i:i + micro] for i in range(0, len(rows), micro))]
        splits = ray.data.from_arrow(blocks).streaming_split(world, equal=False)  # equal=True would drop rows
        stats = _gather([l.update_from_stream.remote(splits[r], denoms, micro) for r, l in enumerate(self.learners)])
        if sum(s.pop("rows") for s in stats) != len(rows):
            raise RuntimeError("streaming_split delivered a different number of rows than the step has")
        return stats

    def _push_weights(self):
        sds = _gather([l.full_state_dict.remote() for l in self.learners])
        self._latest_weights = sds[0]
        self.sync.push(sds[0], self.version, self.fleet.handles())

    # ------------------------------------------------------------ evaluation, logging, checkpoints

    def evaluate(self, limit: int | None = None) -> dict:
        from rapo_ray.envs.suite import family_of

        limit = limit or self.cfg.trainer.eval_size
        groups = [(f"eval-{t.id}", t) for fam, ts in self.test_tasks.items() for t in ts[:limit]]
        rows, _ = self.fleet.run_step(groups, 1, 0, seed=0, evaluation=True)
        self.last_eval_problems = {r["problem_id"]: bool(r["correct"]) for r in rows}  # for the paired before/after test
        out: dict[str, float] = {}
        for fam in self.test_tasks:
            fr = [r for r in rows if family_of(r["problem_id"]) == fam]
            out[f"eval/{fam}/accuracy"] = _mean(float(r["correct"]) for r in fr)
            out[f"eval/{fam}/format_valid"] = _mean(float(r["format_ok"]) for r in fr)
        out["eval/mean_accuracy"] = _mean(out[f"eval/{f}/accuracy"] for f in self.test_tasks)
        return out

    def _log(self, m: dict):
        self.history.append(m)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(m) + "\n")
        if self.tb is not None:
            for k, v in m.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, m.get("step", self.step_idx))
            self.tb.flush()

    def _insert_on_policy(self, rows) -> int:
        """RAPO's optional buffer growth: steps of successful on-policy trajectories go into the buffer."""
        from dataclasses import asdict

        from ray import serve

        from rapo_ray.sft import steps_of_row

        good = [r for r in rows if r["slot_kind"] != "hybrid" and not r["num_retrievals"] and r["reward"] >= self.cfg.retrieval.insert_min_reward]
        steps = [asdict(st) for r in good for st in steps_of_row(self.tok, r)]
        if not steps:
            return 0
        return serve.get_deployment_handle("StepRetriever", app_name=self.retrieval_app).insert.remote(steps).result()

    def _write_trajectories(self, rows):
        import pyarrow as pa
        import pyarrow.parquet as pq

        keep = ["group_id", "slot", "slot_kind", "problem_id", "prompt_ids", "response_ids", "segments", "loss_mask", "logprobs",
                "step_entropies", "step_entropies_engine", "reward", "correct", "format_ok", "tool_calls", "num_retrievals",
                "num_retrieved_tokens", "retrieved_fraction", "policy_version", "advantage", "retrieval_reward", "shaping",
                "finish_reason", "answer", "tool_time_s", "retrievals"]
        table = pa.Table.from_pylist([{k: r.get(k) for k in keep} for r in rows])
        tmp = self.traj_dir / f".step-{self.step_idx:06d}.parquet.tmp"
        pq.write_table(table, tmp)
        tmp.replace(self.traj_dir / f"step-{self.step_idx:06d}.parquet")

    def save_checkpoint(self) -> Path:
        """Model (HF) + optimizer + RNG + data position + step + fleet size, written atomically: into a
        temporary folder, renamed when complete, with a COMPLETE marker last."""
        ck = self.run_dir.checkpoints
        ck.mkdir(exist_ok=True)
        final = ck / f"step-{self.step_idx:06d}"
        tmp = ck / f".tmp-step-{self.step_idx:06d}"
        if tmp.exists():
            shutil.rmtree(tmp)
        _gather([l.save_checkpoint.remote(str(tmp), str(self.model_dir)) for l in self.learners])
        state = {"step": self.step_idx, "version": self.version, "rng": self.rng.getstate(), "workers": len(self.fleet.workers),
                 "torch_rng": torch.get_rng_state().tolist()}
        (tmp / "trainer_state.json").write_text(json.dumps(state, default=list))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        (final / "COMPLETE").write_text("ok\n")
        done = sorted(p for p in ck.glob("step-*") if (p / "COMPLETE").is_file())
        for old in done[: max(0, len(done) - self.cfg.checkpoint.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, path: Path):
        _gather([l.load_checkpoint.remote(str(path)) for l in self.learners])
        state = json.loads((path / "trainer_state.json").read_text())
        self.step_idx, self.version = state["step"], state["version"]
        rs = state["rng"]
        self.rng.setstate((rs[0], tuple(rs[1]), rs[2]))
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        self._push_weights()
        self.fleet.scale(state["workers"])

    def shutdown(self, graceful: bool = True):
        """Stop the fleet, the weight hub and the learners. ``graceful=False`` after a learner died: the surviving
        ranks may be blocked in a collective, so they are killed without asking."""
        self.fleet.shutdown()
        ray.kill(self.sync.hub)
        for l in self.learners:
            if graceful:
                try:
                    ray.get(l.shutdown.remote(), timeout=30)
                except Exception:
                    pass
            ray.kill(l)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)
        if self.tb is not None:
            self.tb.close()


def rl_task_pool(cfg):
    """RL questions per family (after the warm-start demos) and the held-out test tasks."""
    from rapo_ray.envs.suite import task_difficulty, task_splits
    from rapo_ray.sft import sft_span

    train, test = task_splits(cfg.tasks)
    n0 = sft_span(cfg)
    pool = {}
    for fam, ts in train.items():
        later = ts[n0:] or ts  # real data files have no warm-start head
        if cfg.tasks.difficulty and fam in cfg.tasks.families:
            later = [t for t in later if task_difficulty(t) == cfg.tasks.difficulty]
        pool[fam] = later[: cfg.trainer.rl_questions]
    return pool, test


def math_ceil(a: int, b: int) -> int:
    return -(-a // b)


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else 0.0


def _tensorboard(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(path / "tb"))
    except Exception:
        return None


# ---------------------------------------------------------------- the launcher: the whole topology


def run(cfg: Config, log=print) -> dict:
    """Warm start -> buffer -> retrieval service -> learners + fleet -> train -> evaluate. Returns the summary."""
    from rapo_ray.model import set_torch_threads

    set_torch_threads(1)
    started_ray = init_ray(cfg)
    check_resources(cfg)
    run_dir = make_run_dir(cfg)
    log(f"run directory: {run_dir.path}")
    server = trainer = retrieval_app = None
    serve_started = False
    try:
        # 1. starting policy: the given HF folder, or the bundled model's warm start (built once)
        if cfg.model.path:
            from rapo_ray.model import resolve_model_dir

            model_dir = resolve_model_dir(cfg)
        else:
            from rapo_ray.sft import warm_start

            model_dir = warm_start(cfg, log=log)
        log(f"starting policy: {model_dir}")
        # 2. RAPO: step-trace buffer in Milvus behind a Ray Serve deployment
        if cfg.algo.name == "rapo" and cfg.algo.n_hybrid > 0:
            from ray import serve

            from rapo_ray.retrieval.buffer import build_buffer
            from rapo_ray.retrieval.service import build_app
            from rapo_ray.retrieval.store import MilvusLiteServer

            uri = cfg.retrieval.milvus_uri
            if not uri:  # embedded default: milvus-lite as a managed child process, shared by URI
                server = MilvusLiteServer(Path(cfg.run.artifacts_dir) / "milvus")
                uri = server.uri
            pool, _ = rl_task_pool(cfg)
            manifest = Path(cfg.run.artifacts_dir) / "milvus" / f"manifest-{cfg.retrieval.collection}.json"
            manifest.parent.mkdir(parents=True, exist_ok=True)
            report = build_buffer(cfg, str(model_dir), uri, [t for ts in pool.values() for t in ts], manifest, log=log)
            log(report.table())
            serve_started = not _serve_running()  # a Serve someone else started (a cluster's, a test's) stays up
            if serve_started:
                serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
            retrieval_app = "retrieval"
            serve.run(build_app(cfg.retrieval, uri), name=retrieval_app, route_prefix="/retrieve")
        # 3. learners, fleet, weight hub
        trainer = Trainer(cfg, model_dir, run_dir, retrieval_app, log=log)
        resume = run_dir.latest_checkpoint() if cfg.checkpoint.resume else None
        if resume is not None:
            trainer.load_checkpoint(resume)
            log(f"resumed from {resume} at step {trainer.step_idx}")
            before = json.loads((run_dir.path / "eval_before.json").read_text()) if (run_dir.path / "eval_before.json").is_file() else {}
        else:
            trainer._push_weights()
            before = {**trainer.evaluate(), "problems": trainer.last_eval_problems}
            (run_dir.path / "eval_before.json").write_text(json.dumps(before, indent=1))
            log("held-out before training: " + _fmt_eval(before))
        # 4. train; a lost learner (node loss) rebuilds the learners and fleet from the last checkpoint
        failures = 0
        bar = _progress(cfg, trainer.step_idx)
        while trainer.step_idx < cfg.trainer.total_steps:
            try:
                m = trainer.step()
                if cfg.trainer.eval_every and trainer.step_idx % cfg.trainer.eval_every == 0 and trainer.step_idx < cfg.trainer.total_steps:
                    ev = trainer.evaluate()
                    trainer._log({"step": trainer.step_idx, **ev})
                    m.update(ev)
                if cfg.checkpoint.every and trainer.step_idx % cfg.checkpoint.every == 0:
                    trainer.save_checkpoint()
            except LearnerLost as exc:
                failures += 1
                latest = run_dir.latest_checkpoint()
                log(f"step {trainer.step_idx + 1} stopped: {exc}; failure {failures}/{cfg.trainer.max_failures}")
                trainer.shutdown(graceful=False)
                trainer = None
                if failures > cfg.trainer.max_failures:
                    raise RuntimeError(f"{exc}; gave up after {cfg.trainer.max_failures} rebuilds (trainer.max_failures). The last "
                                       f"checkpoint is {latest}; continue with checkpoint.resume={run_dir.path}") from None
                trainer = Trainer(cfg, model_dir, run_dir, retrieval_app, log=log)  # waits for resources to return
                if latest is not None:
                    trainer.load_checkpoint(latest)
                else:
                    trainer._push_weights()
                log(f"rebuilt the learners and fleet; resumed at step {trainer.step_idx} from {latest or 'the starting policy'}")
                continue
            _progress_update(bar, m, log)
        if bar is not None:
            bar.close()
        after = trainer.evaluate()
        trainer._log({"step": trainer.step_idx, **after})
        ck = trainer.save_checkpoint()
        change = _paired_changes(before.pop("problems", {}), trainer.last_eval_problems)
        summary = {"run_dir": str(run_dir.path), "checkpoint": str(ck), "steps": trainer.step_idx, "learner_failures": failures,
                   "before": before, "after": after, "paired_change": change,
                   "mean_step_s": _mean(m["step_s"] for m in trainer.history if "step_s" in m)}
        (run_dir.path / "summary.json").write_text(json.dumps(summary, indent=1))
        _plot(run_dir.path, trainer.history)
        log("held-out after training:  " + _fmt_eval(after))
        log(_before_after_table(before, after, change))
        return summary
    finally:
        if trainer is not None:
            trainer.shutdown()
        if serve_started:
            from ray import serve

            serve.shutdown()
        elif retrieval_app is not None:
            from ray import serve

            serve.delete(retrieval_app)
        if server is not None:
            server.stop()
        if started_ray:
            ray.shutdown()


def _fmt_eval(ev: dict) -> str:
    return ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in ev.items() if k.endswith("/accuracy") and k.count("/") == 2)


def _paired_changes(before: dict, after: dict) -> dict:
    """Per family (and "all"): problems fixed / broken by training and the sign-test p-value."""
    from rapo_ray.envs.suite import family_of
    from rapo_ray.evaluation import paired_change

    fams = sorted({family_of(p) for p in after})
    out = {f: paired_change({p: c for p, c in before.items() if family_of(p) == f}, {p: c for p, c in after.items() if family_of(p) == f})
           for f in fams}
    out["all"] = paired_change(before, after)
    return out


def _before_after_table(before: dict, after: dict, change: dict | None = None) -> str:
    """Held-out accuracy before/after per family; with ``change``: problems fixed/broken and the paired
    sign-test p-value (a gain is measurable when p is small, e.g. < 0.05)."""
    change = change or {}
    fams = sorted({k.split("/")[1] for k in after if k.count("/") == 2})
    lines = [f"{'family':12} {'before':>8} {'after':>8} {'gain':>8} {'fixed':>6} {'broken':>6} {'p':>7}"]

    def row(name, b, a, c):
        paired = f" {c['fixed']:6d} {c['broken']:6d} {c['p_value']:7.3g}" if c else ""
        lines.append(f"{name:12} {b:8.3f} {a:8.3f} {a - b:+8.3f}{paired}")

    for f in fams:
        row(f, before.get(f"eval/{f}/accuracy", 0.0), after.get(f"eval/{f}/accuracy", 0.0), change.get(f))
    row("mean", before.get("eval/mean_accuracy", 0.0), after.get("eval/mean_accuracy", 0.0), change.get("all"))
    return "\n".join(lines)


def _progress(cfg: Config, start: int):
    if not cfg.run.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.trainer.total_steps, initial=start, desc=f"{cfg.algo.name}", dynamic_ncols=True)


def _progress_update(bar, m: dict, log):
    text = f"reward {m['reward']:+.3f} acc {m['accuracy']:.3f} tok/s {m['tokens_per_s']:.0f} step {m['step_s']:.1f}s"
    if "eval/mean_accuracy" in m:
        text += f" eval {m['eval/mean_accuracy']:.3f}"
    if bar is not None:
        bar.set_postfix_str(text)
        bar.update(1)
    else:
        log(f"step {m['step']}: {text}")


def _plot(path: Path, history: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m for m in history if "reward" in m]
    evals = [m for m in history if "eval/mean_accuracy" in m]
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.5))
    ax[0].plot([m["step"] for m in steps], [m["reward"] for m in steps], label="reward")
    ax[0].plot([m["step"] for m in steps], [m["accuracy"] for m in steps], label="train accuracy")
    ax[0].legend(); ax[0].set_xlabel("step")
    for k in sorted({k for m in evals for k in m if k.endswith("/accuracy") and k.count("/") == 2}):
        ax[1].plot([m["step"] for m in evals], [m.get(k, 0) for m in evals], marker="o", label=k.split("/")[1])
    ax[1].set_title("held-out accuracy"); ax[1].legend(); ax[1].set_xlabel("step")
    for k in ("rollout_s", "update_s", "sync_s"):
        ax[2].plot([m["step"] for m in steps], [m[k] for m in steps], label=k)
    ax[2].set_title("step time (s)"); ax[2].legend(); ax[2].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path / "curves.png", dpi=90)
    plt.close(fig)
