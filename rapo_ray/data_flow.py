"""The step's trajectories as a Ray Data pipeline: Arrow rows -> per-group advantages (``map_groups``).

``trainer.advantages_on=ray_data`` routes a step's advantage computation through here instead of the driver;
the numbers are identical (``rapo_ray.algos.group_advantages`` works per group either way); what it adds is
Ray Data's per-step scheduling cost, logged as ``advantages_s``. Ray Data's tasks need free CPU slots: measured
~40 ms per step on an idle 2-core box, 2.3 s inside the default run (its actors hold 4 of 6 logical CPUs), and it
waits forever when actors hold every slot. That is why the driver is the default.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import ray

from rapo_ray.algos.group import group_advantages


def advantages_with_ray_data(batch: dict, algo) -> dict:
    """``group_advantages`` over ``batch`` (columns of ``INPUT_COLUMNS``), one ``map_groups`` call per group."""

    def per_group(group: dict) -> dict:
        return {k: np.asarray(v) for k, v in group_advantages(group, algo).items()}

    # One shuffle partition: a step holds a few dozen groups, and the default partition count costs seconds.
    ds = ray.data.from_arrow(pa.table(batch)).groupby("group_id", num_partitions=1).map_groups(per_group, batch_format="numpy")
    out: dict[str, list] = {"row": [], "advantage": [], "retrieval_reward": [], "shaping": []}
    for b in ds.iter_batches(batch_format="numpy", batch_size=None):
        for k in out:
            out[k].extend(b[k].tolist())
    order = sorted(range(len(out["row"])), key=lambda i: out["row"][i])  # back to the step's row order
    return {k: [v[i] for i in order] for k, v in out.items()}
