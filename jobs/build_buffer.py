"""Build the off-policy step-trace buffer into Milvus (spec §2) with a Ray Data pipeline.

    python jobs/build_buffer.py [section.key=value ...]

Uses retrieval.milvus_uri (empty: embedded milvus-lite under run.artifacts_dir/milvus, served by a managed
`milvus-lite server` child for the duration of the job). Idempotent and resumable; prints the paper's
buffer table (trajectories, step traces, tokens).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from rapo_ray.launch.cli import parse  # noqa: E402


def main(argv=None) -> int:
    cfg, _ = parse(__doc__, argv)
    import ray

    from rapo_ray.launch.launcher import init_ray, starting_policy
    from rapo_ray.pipelines.buffer import buffer_questions, build_buffer, manifest_path, with_buffer_collection
    from rapo_ray.retrieval.store import MilvusLiteServer
    from rapo_ray.training.trainer import rl_task_pool

    owns_ray = not ray.is_initialized()  # disconnect at the end, also from a cluster (its Ray stays up)

    init_ray(cfg)
    server = None
    try:
        model_dir = str(starting_policy(cfg))
        cfg = with_buffer_collection(cfg, model_dir)
        uri = cfg.retrieval.milvus_uri
        if not uri:
            server = MilvusLiteServer(Path(cfg.run.artifacts_dir) / "milvus")
            uri = server.uri
        pool, _ = rl_task_pool(cfg)
        report = build_buffer(cfg, model_dir, uri, buffer_questions(cfg, pool), manifest_path(cfg))
        print(report.table())
        print(f"{report.steps / max(report.seconds, 1e-9):.1f} steps/s written this run")
    finally:
        if server is not None:
            server.stop()
        if owns_ray:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
