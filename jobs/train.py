"""Train an agent with RAPO (default), GRPO or ARPO.

    python jobs/train.py [--config FILE] [--dry-run] [section.key=value ...]
    ray job submit --working-dir . -- python jobs/train.py [...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from _cli import parse  # noqa: E402


def main(argv=None) -> int:
    cfg, args = parse(__doc__, argv, extra=lambda p: p.add_argument(
        "--dry-run", action="store_true", help="resolve the config, print the resource plan and exit (no Ray, no model)"))
    if args.dry_run:
        from rapo_ray.plan import resource_plan

        print(resource_plan(cfg))
        return 0
    from rapo_ray.trainer import run

    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
