"""Serve a trained agent: OpenAI-compatible chat completions over the tool loop, on Ray Serve.

    python jobs/serve.py --checkpoint runs/rapo-20261122-101500        # latest checkpoint of a run
    python jobs/serve.py --checkpoint DIR serve.port=8001 serve.max_replicas=4

Without a cluster this starts a local Ray on 127.0.0.1, serves on http://serve.host:serve.port and blocks
until Ctrl-C. On a running cluster (RAY_ADDRESS, or `ray job submit`) it deploys and returns; running it
again with a new checkpoint is a rolling update with no downtime. `serve run configs/serve/agent.yaml`
does the same from a Serve config file.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from rapo_ray.launch.cli import parse  # noqa: E402


def _extra(parser):
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="HF model folder, trainer checkpoint, run directory, or a folder of runs (newest)",
    )
    parser.add_argument(
        "--block", action="store_true", help="on a running cluster, keep this process attached (Ctrl-C deletes the app)"
    )


def main(argv=None) -> int:
    cfg, args = parse(__doc__, argv, extra=_extra)
    import ray
    from ray import serve

    from rapo_ray.core.errors import ConfigError, ModelLoadError
    from rapo_ray.launch.launcher import init_ray
    from rapo_ray.serving.app import build_agent_app

    try:
        app = build_agent_app(cfg, args.checkpoint)
    except (ConfigError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started_ray = init_ray(cfg)
    sc = cfg.serve
    if started_ray:  # a local machine: as many replicas as its CPUs hold (a cluster's autoscaler adds nodes)
        fit = max(1, int(ray.cluster_resources().get("CPU", 1) // max(sc.num_cpus, 1e-9)))
        if fit < sc.min_replicas:
            print(
                f"serve.min_replicas={sc.min_replicas} x serve.num_cpus={sc.num_cpus:g} does not fit this machine's "
                f"CPUs: serving with {fit} replica(s); a replica's death then fails its requests in flight",
                flush=True,
            )
            cfg.serve.min_replicas = fit
            cfg.serve.max_replicas = fit
            app = build_agent_app(cfg, args.checkpoint)
    try:
        serve.start(http_options={"host": sc.host, "port": sc.port})
        serve.run(app, name=sc.app_name, route_prefix=sc.route_prefix)
        base = f"http://{sc.host}:{sc.port}{sc.route_prefix.rstrip('/')}"
        print(
            f"serving {args.checkpoint} at {base}/v1/chat/completions (models: {base}/v1/models, health: {base}/health)",
            flush=True,
        )
        if not started_ray and not args.block:
            return 0  # deployed on the cluster; it keeps serving after this process exits
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", flush=True)
        serve.delete(sc.app_name)
        return 0
    finally:
        if started_ray:
            serve.shutdown()
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
