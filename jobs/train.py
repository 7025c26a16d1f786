"""Train an agent with RAPO (default), GRPO or ARPO.

    python jobs/train.py [--config FILE] [section.key=value ...]
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
    cfg, args = parse(__doc__, argv)
    from rapo_ray.trainer import run

    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
