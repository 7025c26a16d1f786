"""TrajectoryBatch (the one object from the fleet to the loss) and the learner group's split over ranks."""

from __future__ import annotations

import pytest
import torch

from rapo_ray.algos.entropy import GENERATED, RETRIEVED, TOOL_RESULT
from rapo_ray.types.batch import PARQUET_COLUMNS, TrajectoryBatch
from rapo_ray.types.trajectory import Retrieval, Trajectory


def _traj(i: int, n_resp: int, group: str = "g") -> Trajectory:
    t = Trajectory(group, i, "hybrid" if i % 2 else "on_policy", f"arith-{i}", "math", ("3",), prompt_ids=[1, 2, 3])
    t.append(GENERATED, list(range(10, 10 + n_resp - 2)), [-0.5] * (n_resp - 2), [1.0] * (n_resp - 2))
    t.append(RETRIEVED if i % 2 else TOOL_RESULT, [7, 8])
    if i % 2:
        t.retrievals.append(Retrieval(step_before=0, step_after=None))
    t.reward = float(i)
    return t


def test_select_concat_keep_rows_and_stage_fields_aligned():
    b = TrajectoryBatch([_traj(i, 4 + i) for i in range(4)])
    b.old_logprobs = [[float(i)] * (4 + i) for i in range(4)]
    b.advantage = [10.0, 11.0, 12.0, 13.0]
    part = b.select([3, 1])
    assert [t.slot for t in part] == [3, 1] and part.advantage == [13.0, 11.0] and part.old_logprobs[0] == [3.0] * 7
    assert part.entropies is None and part.shaping is None  # unfilled stages stay unfilled
    joined = TrajectoryBatch.concat([b.select([0]), b.select([2, 3])])
    assert [t.slot for t in joined] == [0, 2, 3] and joined.advantage == [10.0, 12.0, 13.0]
    # a stage field survives concat only when every part has it
    assert TrajectoryBatch.concat([b.select([0]), TrajectoryBatch([_traj(9, 4)])]).advantage is None


def test_require_names_the_missing_stage():
    b = TrajectoryBatch([_traj(0, 4)])
    with pytest.raises(ValueError, match=r"\['old_logprobs', 'advantage'\] not filled yet"):
        b.require("old_logprobs", "advantage")


def test_padding_rows_weigh_nothing():
    b = TrajectoryBatch([_traj(0, 5)], old_logprobs=[[-1.0] * 5], advantage=[2.0], shaping=[1.1])
    pad = b.padding_like(2)
    assert len(pad) == 2 and all(sum(t.loss_mask) == 0 for t in pad)
    assert pad.advantage == [0.0, 0.0] and pad.shaping == [1.0, 1.0] and pad.old_logprobs == [[0.0] * 5] * 2


def test_parquet_rows_and_learner_table_round_trip():
    b = TrajectoryBatch([_traj(i, 4 + i) for i in range(3)])
    b.old_logprobs = [[-0.1 * i] * (4 + i) for i in range(3)]
    b.step_entropies, b.advantage, b.retrieval_reward, b.shaping = (
        [[1.0]] * 3,
        [0.5, -0.5, 0.0],
        [0.0, 0.3, 0.0],
        [1.0, 1.02, 1.0],
    )
    rows = b.to_rows()
    assert (
        list(rows[1]) == list(PARQUET_COLUMNS) and rows[1]["advantage"] == -0.5 and rows[1]["retrieval_reward"] == 0.3
    )
    assert rows[1]["segments"][1] == {"kind": RETRIEVED, "start": 3, "end": 5} and rows[1]["num_retrievals"] == 1
    table = b.learner_table({"mb": [0, 0, 1]})
    back = TrajectoryBatch.from_learner_table(table.to_pylist())
    assert [t.response_ids for t in back] == [t.response_ids for t in b] and back.advantage == b.advantage
    assert back.old_logprobs == b.old_logprobs and [t.loss_mask for t in back] == [t.loss_mask for t in b]


def test_advantage_inputs_are_the_estimators_columns():
    from rapo_ray.algos.group import ADVANTAGE_INPUTS

    b = TrajectoryBatch([_traj(i, 6) for i in range(2)])
    b.step_entropies = [[1.0], [2.0]]
    cols = b.advantage_inputs()
    assert tuple(cols) == ADVANTAGE_INPUTS
    assert cols["retrieval_before"] == [[], [0]] and cols["retrieval_after"] == [[], [-1]]
    assert cols["num_retrieved_tokens"] == [0, 2] and cols["num_response_tokens"] == [6, 6]


def test_split_for_ranks_round_robin_with_padding():
    from rapo_ray.workers.learner import _collate, split_for_ranks

    b = TrajectoryBatch([_traj(i, 4 + i) for i in range(5)], old_logprobs=[[0.0] * (4 + i) for i in range(5)])
    per_rank, rows = split_for_ranks(b, world=2, micro=2)
    assert rows == [[[0, 2], [4]], [[1, 3], []]]
    # rank 0 gets rows 0, 2, 4 (two micro-batches); rank 1 rows 1, 3 and one padding micro-batch
    assert [[t.slot for t in mb] for mb in per_rank[0]] == [[0, 2], [4]]
    assert [[t.slot for t in mb] for mb in per_rank[1]] == [[1, 3], [-1]]
    ids, attn, resp, mask, old = _collate(per_rank[0][0], pad_id=0)
    # row 0: 3 prompt + 4 response tokens; targets shift by one, so the response mask starts at position 2
    assert ids.shape == (2, 9) and attn[0].tolist() == [1] * 7 + [0, 0]
    assert resp[0].tolist() == [0, 0, 1, 1, 1, 1, 0, 0] and mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert torch.equal(old, torch.zeros_like(old))


def test_length_sorted_groups_by_hand():
    from rapo_ray.types.batch import length_sorted_groups

    # sorted: 5 (0), 6 (2), 50 (1), 52 (3); 5+6 pads to 12 <= 1.1 x 11; adding 50 would pad 150 > 1.1 x 61
    assert length_sorted_groups([5, 50, 6, 52], max_rows=4, pad_slack=0.1) == [[0, 2], [1, 3]]
    assert length_sorted_groups([5, 50, 6, 52], max_rows=1, pad_slack=0.1) == [[0], [2], [1], [3]]
    assert length_sorted_groups([5, 50, 6, 52], max_rows=4, pad_slack=10.0) == [[0, 2, 1, 3]]  # 208 <= 11 x 113
    assert length_sorted_groups([7, 7, 7], max_rows=2, pad_slack=0.0) == [[0, 1], [2]]
    assert length_sorted_groups([], max_rows=4, pad_slack=0.1) == []


def test_length_sorted_micro_batches_per_rank_with_the_same_count_on_every_rank():
    """Rank 0 holds rows 0, 2, 4, 6 (lengths 10, 11, 40, 41), rank 1 rows 1, 3, 5 (10, 10, 10): rank 0 cuts two
    micro-batches of like lengths, rank 1 needs one and gets an empty (padding) one to match; row order, the
    old behaviour, cuts every ``micro`` rows."""
    from rapo_ray.workers.learner import micro_batch_rows

    lengths = [10, 10, 11, 10, 40, 10, 41]
    assert micro_batch_rows(lengths, world=2, micro=4, length_sorted=True) == [[[0, 2], [4, 6]], [[1, 3, 5], []]]
    assert micro_batch_rows(lengths, world=2, micro=4, length_sorted=False) == [[[0, 2, 4, 6]], [[1, 3, 5]]]
    assert micro_batch_rows(lengths, world=2, micro=1, length_sorted=True) == [
        [[0], [2], [4], [6]],
        [[1], [3], [5], []],
    ]
    assert micro_batch_rows([], world=2, micro=4, length_sorted=True) == [[[]], [[]]]
