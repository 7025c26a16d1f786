"""``TrajectoryBatch``: the one object a step's data lives in, from the rollout fleet to the loss.

The rollout fleet fills ``trajectories``; every later stage adds its own fields to the same object. The learner's
per-token data is one ``LearnerBatch`` of padded tensors (rapo_ray/types/learner_batch.py), built once by the
old-policy pass: per-token values never become Python lists again. Plain rows exist only at the parquet writer
(``to_rows``).

Shapes (B trajectories; T = the longest prompt + response; ``S_i`` = generated steps of i):

    stage                         field              shape               filled by
    rollout                       trajectories       [B]                 RolloutFleet.run_step
    old-policy pass               learner            LearnerBatch        LearnerGroup.forward_old (or the update,
                                                                             algos/old_pass.py)
                                    .old_logprobs    [B, T-1] tensor
                                    .entropies       [B, T-1] tensor
    advantage estimation          step_entropies     [B][S_i]            data_flow.compute_advantages
                                  learner.signal     {name: [B] or       data_flow.compute_advantages: the
                                                      [B, T-1] tensor}   algorithm's outputs (advantage, ...)

A field is ``None`` until its stage has run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from rapo_ray.core.errors import require_filled
from rapo_ray.types.learner_batch import LearnerBatch
from rapo_ray.types.trajectory import Trajectory

# Per-row fields that stages fill (``learner`` is sliced with them: its ``select``).
STAGE_FIELDS = ("step_entropies",)

# Columns of a step's parquet file (``trajectories/step-NNNNNN.parquet``), in order.
PARQUET_COLUMNS = (
    "group_id",
    "slot",
    "slot_kind",
    "problem_id",
    "prompt_ids",
    "response_ids",
    "segments",
    "loss_mask",
    "logprobs",
    "step_entropies",
    "step_entropies_engine",
    "reward",
    "correct",
    "format_ok",
    "tool_calls",
    "num_retrievals",
    "num_retrieved_tokens",
    "retrieved_fraction",
    "policy_version",
    "finish_reason",
    "answer",
    "answer_retrieved",
    "tool_time_s",
    "retrievals",
)


def length_sorted_groups(lengths: Sequence[int], max_rows: int, pad_slack: float) -> list[list[int]]:
    """Indices of items with these lengths, sorted by length and cut into groups of at most ``max_rows`` whose
    padded size (longest x count) stays within ``1 + pad_slack`` of their real size.

    Why: a padded batch costs its padded size on a CPU, and a model's forward over several groups gives each row
    what one batch gives (the loss sums per-token terms). E.g. lengths [5, 50, 6, 52], max_rows 4, slack 0.1 ->
    [[0, 2], [1, 3]] (12 <= 1.1 x 11, 104 <= 1.1 x 102; all four together would pad 52 x 4 = 208 for 113)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        cur = groups[-1] if groups else None
        if cur and len(cur) < max_rows and lengths[i] * (len(cur) + 1) <= (1 + pad_slack) * (real + lengths[i]):
            cur.append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


# How the learner cuts a batch into [rank][micro-batch] rows (``workers.learner.micro_batch_rows``).
MICRO_BATCH_ORDERS = ("balanced", "row-order", "length-sorted")


def balanced_micro_batches(lengths: Sequence[int], world: int, max_rows: int) -> list[list[list[int]]]:
    """[rank][micro-batch] -> indices of items with these lengths, dealt so that the ranks pad about the same number
    of tokens: a padded micro-batch costs about rows x its longest row, and every rank waits for the slowest at each
    collective, so the step costs the largest rank's sum.

    Items are sorted longest first (ties by index). With one micro-batch per rank (``max_rows`` 0, or at least a
    rank's even share), the sorted items are cut into ``world`` consecutive runs of at most ``max_rows`` items (0: no
    cap) whose largest rows x longest product is the smallest possible: a rank of long rows gets fewer of them.
    Otherwise they are cut into micro-batches of ``max_rows`` and dealt, costliest first, to the least-loaded rank
    that holds fewer than ceil(micro-batches / world), so no rank makes more passes than an even share would.
    Ranks left short get empty micro-batches, to end with the same count (at least one).

    E.g. lengths [100, 20, 90, 25, 30, 10], world 2, max_rows 0 -> [[[0, 2]], [[4, 3, 1, 5]]]: 2 x 100 = 200 and
    4 x 30 = 120, where dealing rows alternately gives rank 0 [100, 90, 30], 3 x 100 = 300.
    """
    if world < 1 or max_rows < 0:
        raise ValueError(f"balanced_micro_batches needs world >= 1 and max_rows >= 0, got {world}, {max_rows}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = len(order)
    cap = max_rows or max(n, 1)
    if math.ceil(math.ceil(n / world) / cap) <= 1:
        runs = _min_max_runs([max(int(lengths[i]), 1) for i in order], world, cap)
        out = [[[order[j] for j in range(a, b)]] for a, b in runs]
    else:
        chunks = [order[a : a + cap] for a in range(0, n, cap)]
        per_rank = math.ceil(len(chunks) / world)
        out, load = [[] for _ in range(world)], [0] * world
        for chunk in chunks:  # sorted longest first, so each chunk costs no more than the one before
            rank = min((r for r in range(world) if len(out[r]) < per_rank), key=lambda r: (load[r], r))
            out[rank].append(chunk)
            load[rank] += len(chunk) * lengths[chunk[0]]
    out += [[] for _ in range(world - len(out))]
    n_micro = max(1, max(len(mbs) for mbs in out))
    return [mbs + [[] for _ in range(n_micro - len(mbs))] for mbs in out]


def _min_max_runs(desc: Sequence[int], parts: int, cap: int) -> list[tuple[int, int]]:
    """Cut ``desc`` (positive, non-increasing) into at most ``parts`` consecutive runs of at most ``cap`` items that
    minimise the largest ``len(run) * run[0]``; ``(start, end)`` per run. A run that starts at ``i`` under a bound
    ``c`` greedily takes ``min(c // desc[i], cap)`` items, which is optimal for a non-increasing sequence; binary
    search finds the least bound that needs at most ``parts`` runs."""

    def cut(bound: int) -> list[tuple[int, int]] | None:
        runs, i = [], 0
        while i < len(desc):
            take = min(bound // desc[i], cap)
            if take == 0 or len(runs) == parts:
                return None
            runs.append((i, min(i + take, len(desc))))
            i += take
        return runs

    if not desc:
        return []
    lo, hi = desc[0], desc[0] * len(desc)
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    runs = cut(lo)
    if runs is None:
        raise ValueError(f"{len(desc)} items do not fit {parts} runs of at most {cap}")
    return runs


@dataclass
class TrajectoryBatch:
    trajectories: list[Trajectory] = field(default_factory=list)
    learner: LearnerBatch | None = None
    step_entropies: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):
        return iter(self.trajectories)

    # ------------------------------------------------------------ slicing and joining

    def select(self, indices: Sequence[int]) -> "TrajectoryBatch":
        """A new batch of the rows ``indices`` (every filled field sliced alike)."""
        out = TrajectoryBatch([self.trajectories[i] for i in indices])
        if self.learner is not None:
            out.learner = self.learner.select(indices)
        for name in STAGE_FIELDS:
            col = getattr(self, name)
            if col is not None:
                setattr(out, name, [col[i] for i in indices])
        return out

    @classmethod
    def concat(cls, batches: Sequence["TrajectoryBatch"]) -> "TrajectoryBatch":
        """Rows of ``batches`` in order; a stage field is kept only when every part has it (the fleet joins its groups
        before any learner data exists)."""
        if any(b.learner is not None for b in batches):
            raise ValueError(
                "TrajectoryBatch.concat: join batches before the old-policy pass builds their learner data"
            )
        out = cls([t for b in batches for t in b.trajectories])
        for name in STAGE_FIELDS:
            cols = [getattr(b, name) for b in batches]
            if batches and all(c is not None for c in cols):
                setattr(out, name, [x for c in cols for x in c])
        return out

    def require(self, *names: str) -> None:
        """Raise if a stage that must have run has not filled its fields (a stage called out of order)."""
        require_filled(self, names, "stages run in the order of rapo_ray/types/batch.py")

    # ------------------------------------------------------------ views used by several stages

    def group_ids(self) -> list[str]:
        return [t.group_id for t in self.trajectories]

    def rewards(self) -> list[float]:
        return [float(t.reward) for t in self.trajectories]

    def advantage_inputs(self) -> dict:
        """Columns for the advantage estimators (``rapo_ray.algos.group.ADVANTAGE_INPUTS``): numpy arrays [B] per
        row, and lists of each row's steps or retrievals where rows differ in length; the same columns make an Arrow
        table for Ray Data."""
        self.require("step_entropies")
        return {
            "row": np.arange(len(self)),
            "group_id": np.array(self.group_ids(), dtype=object),
            "reward": np.array(self.rewards(), dtype=np.float64),
            "step_entropies": [[float(h) for h in hs] for hs in self.step_entropies],
            "retrieval_before": [[int(r.step_before) for r in t.retrievals] for t in self.trajectories],
            "retrieval_after": [
                [-1 if r.step_after is None else int(r.step_after) for r in t.retrievals] for t in self.trajectories
            ],
            "num_retrieved_tokens": np.array([t.num_retrieved_tokens for t in self.trajectories], dtype=np.int64),
            "num_response_tokens": np.array([len(t.response_ids) for t in self.trajectories], dtype=np.int64),
        }

    # ------------------------------------------------------------ the boundary: parquet

    def to_rows(self) -> list[dict]:
        """One flat dict per trajectory with ``PARQUET_COLUMNS`` (stage fields None when not filled), then the
        algorithm's outputs by name (``learner.signal``: a float per row, or a list over the response tokens)."""
        signal = self.learner is not None and self.learner.signal is not None
        rows = []
        for i, t in enumerate(self.trajectories):
            row = t.to_row()
            row["step_entropies"] = self.step_entropies[i] if self.step_entropies is not None else None
            rows.append({k: row.get(k) for k in PARQUET_COLUMNS} | (self.learner.row_signal(i) if signal else {}))
        return rows
