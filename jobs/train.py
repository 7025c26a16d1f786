"""Train an agent with RAPO (default), GRPO or ARPO.

python jobs/train.py [--config FILE] [--dry-run] [section.key=value ...]
ray job submit --working-dir . -- python jobs/train.py [...]
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from rapo_ray.launch.cli import train_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_main())
