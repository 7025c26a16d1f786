"""Multi-node simulations on one machine: fleet autoscaling with Ray's fake node provider, and node loss.

    python benchmarks/cluster_sim.py autoscale       # fake autoscaling cluster: scale 1 -> 3 workers -> 1
    python benchmarks/cluster_sim.py node-loss       # ray.cluster_utils.Cluster: a rollout node dies mid-step
    python benchmarks/cluster_sim.py learner-loss    # a learner node dies mid-run; the run rebuilds and finishes
    python benchmarks/cluster_sim.py node-loss --artifacts DIR   # the bundled model built once in DIR, kept there

Each prints one JSON line with what it measured (times, node counts, groups) and exits non-zero on failure.
Every Ray process is started here and stopped here by PID (never `ray stop`); everything binds to 127.0.0.1.
A random token enables Ray's token authentication for the simulated cluster without touching ~/.ray.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rapo_ray.core.net import free_port, short_temp_dir

REPO = Path(__file__).resolve().parents[1]

ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "RAY_AUTH_MODE": "token",
}


def _pids_under(path: str) -> list[int]:
    """Processes whose command line names ``path`` (the Ray temp dir this script created)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if path in cmd:
                out.append(int(entry))
    return out


def _stop_pids(path: str) -> None:
    """SIGTERM, then SIGKILL whatever is left after 3 s; returns once none is left (or 1 s after the SIGKILL)."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
        for pid in _pids_under(path):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while _pids_under(path) and time.monotonic() < deadline:
            time.sleep(0.1)


@contextlib.contextmanager
def scenario_dir(prefix: str):
    """A temporary folder for one scenario's Ray session and artifacts. Every process started under it is stopped
    afterwards; the folder is removed after a scenario that succeeded and kept (Ray's logs) after one that failed."""
    tmp = short_temp_dir(prefix)  # Ray's sockets live under it
    try:
        yield tmp
    except BaseException:
        _stop_pids(tmp)
        print(f"kept {tmp} (Ray's session logs of the failed scenario)", file=sys.stderr)
        raise
    _stop_pids(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def _tiny_cfg(artifacts: str, *overrides):
    from rapo_ray.config import TINY_OVERRIDES, load_config

    base = [
        f"run.artifacts_dir={artifacts}",
        *TINY_OVERRIDES,
        "rollout.max_response_tokens=96",
        "rollout.max_step_tokens=32",
        "rollout.engine=torch",
        "algo.name=grpo",
        "algo.group_size=4",
    ]
    return load_config(overrides=base + list(overrides))


def _alive_nodes(ray) -> int:
    return sum(1 for n in ray.nodes() if n["Alive"])


def _wait(pred, timeout: float, poll: float = 0.25) -> float:
    t0 = time.perf_counter()
    while not pred():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"condition not met within {timeout:.0f} s")
        time.sleep(poll)
    return time.perf_counter() - t0


# ---------------------------------------------------------------- fake autoscaling cluster


def autoscale(timeout: float, artifacts: str = "") -> dict:
    import yaml

    with scenario_dir("rapo_fake_") as tmp:
        port = free_port()
        # the autoscaler looks every second, not every 5 s: the same decisions, sooner (its monitor reads this at start)
        env = dict(
            os.environ,
            **ENV,
            RAY_FAKE_CLUSTER="1",
            AUTOSCALER_UPDATE_INTERVAL_S="1",
            RAY_AUTH_TOKEN=secrets.token_hex(32),
        )
        os.environ.update({k: env[k] for k in ENV} | {"RAY_AUTH_TOKEN": env["RAY_AUTH_TOKEN"]})
        cfg_yaml = yaml.safe_load((REPO / "cluster" / "fake-multinode.yaml").read_text())
        cfg_yaml["provider"]["gcs_address"] = f"127.0.0.1:{port}"
        scaling = Path(tmp) / "autoscaling.yaml"
        scaling.write_text(yaml.safe_dump(cfg_yaml))
        ray_bin = str(Path(sys.executable).with_name("ray"))
        subprocess.run(
            [
                ray_bin,
                "start",
                "--head",
                f"--port={port}",
                "--num-cpus=1",
                "--node-ip-address=127.0.0.1",
                f"--autoscaling-config={scaling}",
                f"--temp-dir={tmp}/ray",
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        import ray

        from rapo_ray.model.factory import ensure_bundled_model
        from rapo_ray.workers.rollout import RolloutFleet

        cfg = _tiny_cfg(
            artifacts or f"{tmp}/artifacts",
            "rollout.num_workers=1",
            "rollout.min_workers=1",
            "rollout.max_workers=3",
            "resources.rollout_custom_resources={rollout_node: 1}",
            f"resources.placement_timeout_s={timeout}",
        )
        model_dir = ensure_bundled_model(cfg)
        ray.init(
            address=f"127.0.0.1:{port}",
            log_to_driver=False,
            runtime_env={"env_vars": {k: v for k, v in ENV.items() if k != "RAY_AUTH_MODE"}},
        )
        report = {"nodes_at_start": _alive_nodes(ray)}
        t0 = time.perf_counter()
        fleet = RolloutFleet(str(model_dir), cfg, None)  # its one worker needs a rollout node: the first scale-up
        report["first_worker_s"] = round(time.perf_counter() - t0, 1)
        report["nodes_with_1_worker"] = _alive_nodes(ray)
        from rapo_ray.envs.suite import task_splits

        train, _ = task_splits(cfg.tasks)
        groups = [(f"g{i}", t) for i, t in enumerate(train["arith"][:6])]
        t0 = time.perf_counter()
        workers = fleet.autoscale(backlog_groups=len(groups), groups_per_worker=2)  # backlog 6 -> 3 workers
        report["scale_up_s"] = round(time.perf_counter() - t0, 1)
        report["workers_after_scale_up"] = workers
        report["nodes_after_scale_up"] = _alive_nodes(ray)
        batch, stats = fleet.run_step(groups, group_size=cfg.algo.group_size, seed=0)
        report["groups_done"] = len(set(batch.group_ids()))
        t0 = time.perf_counter()
        report["workers_after_scale_down"] = fleet.autoscale(backlog_groups=0)
        report["node_removal_s"] = round(_wait(lambda: _alive_nodes(ray) <= 2, timeout), 1)  # head + 1 worker node
        report["nodes_after_scale_down"] = _alive_nodes(ray)
        fleet.shutdown()
        ray.shutdown()
        return report


# ---------------------------------------------------------------- node loss (ray.cluster_utils.Cluster)


def local_cluster(tmp: str, auth: bool = True):
    """A ``ray.cluster_utils.Cluster`` head (1 CPU) whose session lives under ``tmp``. ``auth``: token
    authentication, which must be set before Ray is imported (it reads the auth mode once); a caller that imported
    Ray already passes False."""
    env = ENV if auth else {k: v for k, v in ENV.items() if k != "RAY_AUTH_MODE"}
    os.environ.update(env)
    if auth:
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    # Cluster writes the head's address to <Ray temp root>/ray/ray_current_cluster whatever temp_dir says; without
    # this it would be the machine's /tmp/ray (missing on a fresh machine, and a running cluster's file to clobber).
    os.environ["RAY_TMPDIR"] = tmp
    import ray
    from ray.cluster_utils import Cluster

    return ray, Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 1,
            "node_ip_address": "127.0.0.1",
            "temp_dir": f"{tmp}/ray",
            "include_dashboard": False,
            "env_vars": dict(env),
        },
    )


def node_loss(timeout: float, artifacts: str = "") -> dict:
    """Two rollout workers on two nodes (plus a spare node); the node of the first worker that takes work is
    removed right after its groups are dispatched, while they are in flight."""
    with scenario_dir("rapo_nodeloss_") as tmp:
        ray, cluster = local_cluster(tmp)
        nodes = [
            cluster.add_node(num_cpus=1, resources={"rollout_node": 1}, node_ip_address="127.0.0.1") for _ in range(3)
        ]
        cluster.wait_for_nodes()
        from rapo_ray.model.factory import ensure_bundled_model
        from rapo_ray.workers.rollout import RolloutFleet

        cfg = _tiny_cfg(
            artifacts or f"{tmp}/artifacts",
            "rollout.num_workers=2",
            "rollout.min_workers=1",
            "rollout.max_workers=3",
            "resources.rollout_custom_resources={rollout_node: 1}",
            f"resources.placement_timeout_s={timeout}",
        )
        model_dir = ensure_bundled_model(cfg)
        ray.init(address=cluster.address, log_to_driver=False)
        fleet = RolloutFleet(str(model_dir), cfg, None)
        node_of = {wid: ray.get(w.ready.remote())["node_id"] for wid, w in fleet.workers.items()}
        from rapo_ray.envs.suite import task_splits

        train, _ = task_splits(cfg.tasks)
        groups = [(f"g{i}", t) for i, t in enumerate(train["arith"][:16])]
        victim = {}

        def on_dispatch(wid, take):
            if victim:
                return
            target = next(n for n in nodes if n.node_id == node_of[wid])
            victim.update(worker=wid, node=target.node_id, groups=len(take))
            cluster.remove_node(target)  # the worker just received its groups: they are in flight

        t0 = time.perf_counter()
        batch, stats = fleet.run_step(groups, group_size=cfg.algo.group_size, seed=0, on_dispatch=on_dispatch)
        ids = batch.group_ids()
        report = {
            "step_s": round(time.perf_counter() - t0, 1),
            "groups": len(groups),
            "groups_done": len(set(ids)),
            "rows": len(batch),
            "rows_expected": len(groups) * cfg.algo.group_size,
            "each_group_once": all(ids.count(g) == cfg.algo.group_size for g, _ in groups),
            "killed_worker_groups": victim.get("groups"),
            "requeued_groups": stats["requeued_groups"],
            "replaced_workers": stats["replaced_workers"],
            "workers_after": len(fleet.workers),
            "events": [e.detail for e in fleet.events],
        }
        fleet.shutdown()
        ray.shutdown()
        cluster.shutdown()
        return report


def learner_loss(timeout: float, artifacts: str = "") -> dict:
    """An 8-step GRPO run whose learners sit on their own node; that node dies after the step-2 checkpoint, a new
    one joins 5 s later, and the run rebuilds from the checkpoint and finishes all steps."""
    with scenario_dir("rapo_learnerloss_") as tmp:
        ray, cluster = local_cluster(tmp)
        cluster.add_node(num_cpus=2, resources={"rollout_node": 2}, node_ip_address="127.0.0.1")
        learner_node = cluster.add_node(num_cpus=2, resources={"learner_node": 2}, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        from rapo_ray.model.factory import ensure_bundled_model

        cfg = _tiny_cfg(
            artifacts or f"{tmp}/artifacts",
            "rollout.num_workers=1",
            "rollout.min_workers=1",
            "rollout.max_workers=2",
            "learner.world_size=2",
            "trainer.total_steps=8",
            "trainer.prompts_per_step=2",
            "trainer.eval_every=0",
            "trainer.eval_size=4",
            "checkpoint.every=1",
            f"run.output_dir={tmp}/runs",
            "run.name=learner-loss",
            "run.progress=false",
            "run.tensorboard=false",
            "resources.rollout_custom_resources={rollout_node: 1}",
            "resources.learner_custom_resources={learner_node: 1}",
            f"resources.placement_timeout_s={timeout}",
        )
        from dataclasses import replace

        cfg = replace(cfg, model=replace(cfg.model, path=str(ensure_bundled_model(cfg))))
        ray.init(address=cluster.address, log_to_driver=False)
        from rapo_ray.launch import launcher

        ckpts = Path(tmp) / "runs" / "learner-loss" / "checkpoints"
        lines, result = [], {}

        def train():  # on a thread: Cluster.add_node needs the main thread
            try:
                result["summary"] = launcher.run(cfg, log=lines.append)
            except Exception:
                import traceback

                result["error"] = traceback.format_exc()[-3000:]

        th = threading.Thread(target=train, daemon=True)
        th.start()
        _wait(lambda: (ckpts / "step-000002" / "COMPLETE").is_file() or not th.is_alive(), timeout)
        cluster.remove_node(learner_node)
        killed_at = time.perf_counter()
        time.sleep(5.0)
        cluster.add_node(num_cpus=2, resources={"learner_node": 2}, node_ip_address="127.0.0.1")
        rejoined_at = time.perf_counter()
        th.join(timeout=timeout * 3)
        if "summary" not in result:
            print(
                json.dumps(
                    {
                        "scenario": "learner-loss",
                        "error": result.get("error", "training did not finish"),
                        "log": lines[-20:],
                    }
                ),
                flush=True,
            )
            raise SystemExit(1)
        summary = result["summary"]
        t_end = time.perf_counter()
        # not rapo_ray.training.reporting.read_metrics: importing it imports Ray, which must come after the
        # token-auth environment is set (local_cluster)
        metrics = [json.loads(l) for l in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        report = {
            "steps": summary["steps"],
            "learner_failures": summary["learner_failures"],
            "node_down_s": round(rejoined_at - killed_at, 1),
            "finished_after_rejoin_s": round(t_end - rejoined_at, 1),
            "logged_steps": [m["step"] for m in metrics if "reward" in m],
            "log": [l for l in lines if "stopped" in l or "rebuilt" in l],
        }
        ray.shutdown()
        cluster.shutdown()
        return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=["autoscale", "node-loss", "learner-loss"])
    ap.add_argument("--timeout", type=float, default=120.0, help="bound on every wait (s)")
    ap.add_argument(
        "--artifacts",
        default="",
        help="the bundled tiny model (and caches) built once here and kept (default: in the scenario's temp folder)",
    )
    args = ap.parse_args()
    fn = {"autoscale": autoscale, "node-loss": node_loss, "learner-loss": learner_loss}[args.scenario]
    report = fn(args.timeout, args.artifacts)
    print(json.dumps({"scenario": args.scenario, **report}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
