"""A step's advantages, computed in the driver or as a Ray Data pipeline over the step's Arrow rows.

``compute_advantages`` fills the advantage stage of a ``TrajectoryBatch``: exact per-step entropies from the
learner's old-policy pass, then the algorithm's group-wise estimator. ``trainer.advantages_on=ray_data`` runs
the estimator as ``map_groups`` (one call per group) instead of in the driver; the numbers are identical, what
it adds is Ray Data's per-step scheduling cost (docs/RESULTS.md, Performance), which is why the driver is
the default.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import ray

from rapo_ray.algos.entropy import step_entropies
from rapo_ray.algos.registry import Algorithm
from rapo_ray.types.batch import TrajectoryBatch


def fill_step_entropies(batch: TrajectoryBatch) -> None:
    """``batch.step_entropies`` [B][S_i]: each generated step's mean entropy, from ``batch.learner.entropies``."""
    batch.require("learner")
    lb = batch.learner
    lb.require("entropies")
    batch.step_entropies = [step_entropies(lb.response_values("entropies", i), t.segments) for i, t in enumerate(batch)]


def compute_advantages(batch: TrajectoryBatch, algorithm: Algorithm, algo_cfg, on: str = "driver") -> None:
    """Fill ``batch.step_entropies`` [B][S_i] (from the old-policy pass's ``batch.learner.entropies``) and
    ``batch.learner.signal``: ``algorithm``'s outputs ([B], or [B, T-1] for a per-token one), from its estimator
    run in the driver or (``on="ray_data"``) in Ray Data. Without the pass (``rapo_ray/algos/old_pass.py``) the
    step entropies are left empty for an estimator that does not read them, and filled after the update from its
    own forward."""
    batch.require("learner")
    if batch.learner.entropies is not None:
        fill_step_entropies(batch)
    elif algorithm.reads_step_entropies(algo_cfg):
        raise ValueError(f"{algorithm.name} reads the old policy's step entropies: run the old-policy pass first")
    else:
        batch.step_entropies = [[] for _ in batch.trajectories]
    columns = batch.advantage_inputs()
    out = (
        advantages_with_ray_data(columns, algorithm, algo_cfg)
        if on == "ray_data"
        else algorithm.advantages(columns, algo_cfg)
    )
    missing = [k for k in ("row", *algorithm.outputs) if k not in out]
    if missing or any(len(out[k]) != len(batch) for k in ("row", *algorithm.outputs)):
        raise ValueError(
            f"algorithm {algorithm.name!r}: its estimator must return 'row' and its outputs {algorithm.outputs}, "
            f"one entry per row ({len(batch)}); got { ({k: len(v) for k, v in out.items()}) }"
        )
    if list(out["row"]) != list(range(len(batch))):
        raise ValueError(f"algorithm {algorithm.name!r}: its estimator must return the rows in the order given")
    outputs = {k: out[k] for k in algorithm.outputs}
    batch.learner = batch.learner.with_signal(outputs, algorithm.per_token)


def ragged(rows) -> np.ndarray:
    """A column of arrays of different lengths (a per-token output), as Ray Data's numpy batches carry one."""
    out = np.empty(len(rows), dtype=object)
    out[:] = [np.asarray(r, dtype=np.float32) for r in rows]
    return out


def advantages_with_ray_data(columns: dict, algorithm: Algorithm, algo_cfg) -> dict:
    """``algorithm.advantages`` over ``columns`` (``ADVANTAGE_INPUTS``), one ``map_groups`` call per group."""

    def per_group(group: dict) -> dict:
        return {
            k: ragged(v) if k in algorithm.per_token else np.asarray(v)
            for k, v in algorithm.advantages(group, algo_cfg).items()
        }

    # One shuffle partition: a step holds a few dozen groups, and the default partition count costs seconds.
    ds = (
        ray.data.from_arrow(pa.table(columns))
        .groupby("group_id", num_partitions=1)
        .map_groups(per_group, batch_format="numpy")
    )
    out: dict[str, list] = {k: [] for k in ("row", *algorithm.outputs)}
    for b in ds.iter_batches(batch_format="numpy", batch_size=None):
        for k in out:
            out[k].extend(list(b[k]) if k in algorithm.per_token else b[k].tolist())
    order = sorted(range(len(out["row"])), key=lambda i: out["row"][i])  # back to the step's row order
    return {k: [v[i] for i in order] for k, v in out.items()}
