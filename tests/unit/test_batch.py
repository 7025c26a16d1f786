"""TrajectoryBatch (the step), LearnerBatch (its tensors on the learner path) and the split over ranks, by hand."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from array import array

import numpy as np
import pytest
import torch

from rapo_ray.types.batch import PARQUET_COLUMNS, TrajectoryBatch
from rapo_ray.types.learner_batch import LearnerBatch
from rapo_ray.types.trajectory import GENERATED, RETRIEVED, TOKEN_DTYPES, TOOL_RESULT, Retrieval, Trajectory


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
    b.learner = LearnerBatch.from_trajectories(b.trajectories, pad_id=0).with_signal({"advantage": [10, 11, 12, 13]})
    part = b.select([3, 1])
    assert [t.slot for t in part] == [3, 1] and part.learner.signal["advantage"].tolist() == [13.0, 11.0]
    assert part.learner.row.tolist() == [3, 1] and part.learner.input_ids.shape == (2, 10)  # 3 + 7 tokens, trimmed
    assert part.step_entropies is None and part.learner.old_logprobs is None  # unfilled stages stay unfilled
    fresh = TrajectoryBatch([_traj(i, 4 + i) for i in range(4)], step_entropies=[[1.0], [2.0], [3.0], [4.0]])
    joined = TrajectoryBatch.concat([fresh.select([0]), fresh.select([2, 3])])
    assert [t.slot for t in joined] == [0, 2, 3] and joined.step_entropies == [[1.0], [3.0], [4.0]]
    # a stage field survives concat only when every part has it; learner data is built after the fleet joins
    assert TrajectoryBatch.concat([fresh.select([0]), TrajectoryBatch([_traj(9, 4)])]).step_entropies is None
    with pytest.raises(ValueError, match="before the old-policy pass"):
        TrajectoryBatch.concat([b.select([0]), b.select([1])])


def test_trajectory_token_fields_are_arrays_that_cross_a_pickle_exactly_and_older_pickles_load_as_arrays():
    t = _traj(1, 6)
    t.prompt_ids = [1, 2**31 - 1]
    t.logprobs = [-0.1234567890123, *t.logprobs[1:]]
    assert {k: getattr(t, k).dtype for k in TOKEN_DTYPES} == {k: np.dtype(v) for k, v in TOKEN_DTYPES.items()}
    payload = pickle.dumps(t, protocol=5)
    back = pickle.loads(payload)
    assert back == t and back.logprobs[0] == -0.1234567890123 and back.prompt_ids.tolist() == [1, 2**31 - 1]
    assert back != dataclasses.replace(t, response_ids=[*t.response_ids[:-1], 0])  # equality looks at the tokens
    # each field goes as one raw buffer (out of band, as Ray's serializer sends it), not value by value
    buffers = []
    pickle.dumps(t, protocol=5, buffer_callback=buffers.append)
    assert sorted(memoryview(b).nbytes for b in buffers) == sorted(getattr(t, k).nbytes for k in TOKEN_DTYPES)
    # a trajectory pickled before (a checkpoint's rollout-ahead queue): lists, or for a while packed ``array``s
    as_lists = {k: (v.tolist() if k in TOKEN_DTYPES else v) for k, v in t.__dict__.items()}
    packed = dict(as_lists, prompt_ids=array("q", as_lists["prompt_ids"]), logprobs=array("d", as_lists["logprobs"]))
    for state in (as_lists, packed):
        legacy = Trajectory.__new__(Trajectory)
        legacy.__setstate__(state)
        assert legacy == t and all(type(getattr(legacy, k)) is np.ndarray for k in TOKEN_DTYPES)


def test_trajectory_refuses_token_values_its_arrays_cannot_hold_by_name():
    t = _traj(1, 2)
    with pytest.raises(ValueError, match=r"Trajectory.prompt_ids: cannot hold these values as int32"):
        t.prompt_ids = [1, 2**40]
    with pytest.raises(ValueError, match=r"Trajectory.response_ids: expected one value per token"):
        t.response_ids = [[1, 2], [3, 4]]
    before = copy.deepcopy(t)
    with pytest.raises(ValueError, match=r"Trajectory.append: 1 logprobs for 2 tokens"):
        t.append(GENERATED, [5, 6], [-0.5])
    assert t == before  # a refused value leaves the trajectory as it was


def test_require_names_the_missing_stage():
    b = TrajectoryBatch([_traj(0, 4)])
    with pytest.raises(ValueError, match=r"\['learner', 'step_entropies'\] not filled yet"):
        b.require("learner", "step_entropies")
    with pytest.raises(ValueError, match=r"\['old_logprobs'\] not filled yet"):
        LearnerBatch.from_trajectories(b.trajectories, pad_id=0).require("old_logprobs")


def test_learner_batch_by_hand():
    """Row 0: 3 prompt + 4 response tokens (2 generated, then 2 tool-result tokens). Targets shift by one, so the
    response starts at target column 2."""
    lb = LearnerBatch.from_trajectories([_traj(0, 4), _traj(1, 6)], pad_id=99)
    assert lb.input_ids.shape == (2, 9) and lb.input_ids[0].tolist() == [1, 2, 3, 10, 11, 7, 8, 99, 99]
    assert lb.attention_mask[0].tolist() == [1] * 7 + [0, 0]
    assert lb.response_mask[0].tolist() == [0, 0, 1, 1, 1, 1, 0, 0] and lb.loss_mask[0].tolist() == [
        0,
        0,
        1,
        1,
        0,
        0,
        0,
        0,
    ]
    assert lb.response_span(0) == (2, 6) and lb.response_span(1) == (2, 8) and lb.tokens() == 7 + 9
    lb.entropies = torch.arange(16, dtype=torch.float32).reshape(2, 8)
    assert lb.response_values("entropies", 0).tolist() == [2.0, 3.0, 4.0, 5.0]


def test_behaviour_logprobs_are_the_engines_on_generated_targets_and_travel_with_the_rows():
    """``algo.behaviour_correction``: the engine's log-prob of each generated token (-0.5 in ``_traj``) at its target
    column, 0 on tool results, retrieved tokens and padding; sliced, padded, joined and sent like the other fields."""
    trajs = [_traj(0, 4), _traj(1, 6)]
    assert LearnerBatch.from_trajectories(trajs, pad_id=0).behaviour_logprobs is None  # only when asked for
    lb = LearnerBatch.from_trajectories(trajs, pad_id=0, behaviour=True).with_signal({"advantage": [1.0, -1.0]})
    assert lb.behaviour_logprobs[0].tolist() == [0, 0, -0.5, -0.5, 0, 0, 0, 0]
    assert lb.behaviour_logprobs[1].tolist() == [0, 0, -0.5, -0.5, -0.5, -0.5, 0, 0]
    assert lb.select([0]).behaviour_logprobs.shape == (1, 6)  # trimmed with the row
    assert LearnerBatch.padding(1, pad_id=0, like=lb).behaviour_logprobs.abs().sum() == 0
    lb.old_logprobs = -0.4 * lb.response_mask
    back = LearnerBatch.from_arrow(lb.to_arrow())
    assert torch.equal(back.behaviour_logprobs, lb.behaviour_logprobs)
    assert LearnerBatch.concat([lb.select([1]), lb.select([0])], pad_id=0).behaviour_logprobs.shape == (2, 8)
    bare = Trajectory("g", 0, "on_policy", "p", "qa", (), prompt_ids=[1], response_ids=[5, 6], loss_mask=[1, 1])
    with pytest.raises(ValueError, match="g/0: 0 engine log-probs for 2 response tokens"):
        LearnerBatch.from_trajectories([bare], pad_id=0, behaviour=True)


def test_padding_rows_weigh_nothing():
    lb = LearnerBatch.from_trajectories([_traj(0, 5)], pad_id=0)
    lb = lb.with_signal({"advantage": [2.0], "shaping": [1.1], "weight": [[0.5, 1.0, 1.0, 1.0, 1.0]]}, ["weight"])
    lb.old_logprobs = torch.full_like(lb.response_mask, -1.0)
    pad = LearnerBatch.padding(2, pad_id=0, like=lb)
    assert len(pad) == 2 and pad.loss_mask.sum() == 0 and pad.row.tolist() == [-1, -1]
    assert {k: v.tolist() for k, v in pad.signal.items()} == {
        "advantage": [0.0, 0.0],
        "shaping": [0.0, 0.0],
        "weight": [[0.0], [0.0]],  # per token: one target column, like the padding rows' masks
    }
    assert pad.old_logprobs.abs().sum() == 0 and pad.entropies is None  # only the stages ``like`` has
    assert LearnerBatch.padding(1, pad_id=0).signal == {"advantage": torch.zeros(1)}  # a rank with no rows


def test_parquet_rows_and_learner_arrow_round_trip():
    b = TrajectoryBatch([_traj(i, 4 + i) for i in range(3)])
    signal = {"advantage": [0.5, -0.5, 0.0], "retrieval_reward": [0.0, 0.3, 0.0], "shaping": [1.0, 1.02, 1.0]}
    signal["weight"] = [[0.5] * 4, [0.25] * 5, [1.0] * 6]  # per token: one value per response token of each row
    lb = LearnerBatch.from_trajectories(b.trajectories, pad_id=0).with_signal(signal, per_token=["weight"])
    assert lb.signal["weight"][1].tolist() == [0, 0, 0.25, 0.25, 0.25, 0.25, 0.25, 0]  # at its response targets
    lb.old_logprobs = -0.1 * lb.response_mask
    b.learner, b.step_entropies = lb, [[1.0]] * 3
    rows = b.to_rows()
    assert list(rows[1]) == [*PARQUET_COLUMNS, "advantage", "retrieval_reward", "shaping", "weight"]
    assert rows[1]["advantage"] == -0.5 and rows[1]["retrieval_reward"] == pytest.approx(0.3)
    assert rows[1]["weight"] == [0.25] * 5
    with pytest.raises(ValueError, match=r"per-token output 'weight': row 0 has 3 values for 4 response tokens"):
        lb.with_signal({"weight": [[1.0] * 3, [1.0] * 5, [1.0] * 6]}, per_token=["weight"])
    assert rows[1]["segments"][1] == {"kind": RETRIEVED, "start": 3, "end": 5} and rows[1]["num_retrievals"] == 1
    table = lb.to_arrow({"mb": [0, 0, 1]})
    assert table.column("mb").to_pylist() == [0, 0, 1]
    back = LearnerBatch.from_arrow(table)
    for name in ("input_ids", "attention_mask", "response_mask", "loss_mask", "old_logprobs"):
        assert getattr(back, name).dtype == getattr(lb, name).dtype, name
        assert torch.equal(getattr(back, name), getattr(lb, name)), name
    assert list(back.signal) == list(lb.signal) and all(torch.equal(back.signal[k], lb.signal[k]) for k in lb.signal)
    again = pickle.loads(pickle.dumps(lb.select([1, 2])))  # how a micro-batch reaches a rank
    assert torch.equal(again.signal["weight"], lb.select([1, 2]).signal["weight"])
    assert back.row.tolist() == [0, 1, 2] and back.entropies is None
    joined = LearnerBatch.concat([lb.select([2]), lb.select([0])], pad_id=0)
    assert joined.row.tolist() == [2, 0] and torch.equal(joined.input_ids, lb.select([2, 0]).input_ids)
    # across a process boundary: numpy buffers on the wire, the same tensors back
    again = pickle.loads(pickle.dumps(lb, protocol=5))
    assert all(torch.equal(getattr(again, f), getattr(lb, f)) for f in ("input_ids", "loss_mask", "old_logprobs"))


def test_advantage_inputs_are_the_estimators_columns():
    from rapo_ray.algos.group import ADVANTAGE_INPUTS

    b = TrajectoryBatch([_traj(i, 6) for i in range(2)])
    b.step_entropies = [[1.0], [2.0]]
    cols = b.advantage_inputs()
    assert tuple(cols) == ADVANTAGE_INPUTS
    assert cols["retrieval_before"] == [[], [0]] and cols["retrieval_after"] == [[], [-1]]
    assert cols["num_retrieved_tokens"].tolist() == [0, 2] and cols["num_response_tokens"].tolist() == [6, 6]
    assert cols["reward"].dtype == np.float64 and cols["row"].tolist() == [0, 1]  # per-row columns are arrays


def test_split_for_ranks_round_robin_with_padding():
    from rapo_ray.workers.learner import split_for_ranks

    lb = LearnerBatch.from_trajectories([_traj(i, 4 + i) for i in range(5)], pad_id=0)
    lb.old_logprobs = torch.zeros_like(lb.response_mask)
    per_rank, rows = split_for_ranks(lb, world=2, max_rows=2, pad_id=0)
    assert rows == [[[0, 2], [4]], [[1, 3], []]]
    # rank 0 gets rows 0, 2, 4 (two micro-batches); rank 1 rows 1, 3 and one padding micro-batch
    assert [mb.row.tolist() for mb in per_rank[0]] == [[0, 2], [4]]
    assert [mb.row.tolist() for mb in per_rank[1]] == [[1, 3], [-1]]
    # each micro-batch is padded to its own longest row: rows 0 and 2 have 3 + 4 and 3 + 6 tokens
    assert per_rank[0][0].input_ids.shape == (2, 9) and per_rank[0][1].input_ids.shape == (1, 11)
    assert per_rank[1][1].loss_mask.sum() == 0 and per_rank[1][1].old_logprobs is not None


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
    old behaviour, cuts every ``max_rows`` rows, and uncapped (0) gives each rank one micro-batch of its share."""
    from rapo_ray.workers.learner import micro_batch_rows

    lengths = [10, 10, 11, 10, 40, 10, 41]
    for max_rows in (0, 4):
        assert micro_batch_rows(lengths, 2, max_rows, "length-sorted") == [[[0, 2], [4, 6]], [[1, 3, 5], []]]
        assert micro_batch_rows(lengths, 2, max_rows, "row-order") == [[[0, 2, 4, 6]], [[1, 3, 5]]]
    assert micro_batch_rows(lengths, 2, 3, "row-order") == [[[0, 2, 4], [6]], [[1, 3, 5], []]]
    assert micro_batch_rows(lengths, world=2, max_rows=1, order="length-sorted") == [
        [[0], [2], [4], [6]],
        [[1], [3], [5], []],
    ]
    assert micro_batch_rows([], world=2, max_rows=4, order="length-sorted") == [[[]], [[]]]
    with pytest.raises(ValueError, match="order 'sorted'"):
        micro_batch_rows(lengths, world=2, max_rows=4, order="sorted")
    with pytest.raises(ValueError, match=r"max_rows \(-1\) >= 0"):
        micro_batch_rows(lengths, world=2, max_rows=-1, order="row-order")


def test_balanced_micro_batches_by_hand():
    """Sorted longest first: 100 (0), 90 (2), 30 (4), 25 (3), 20 (1), 10 (5). One micro-batch per rank: cutting
    after two rows costs max(2 x 100, 4 x 30) = 200, the least (after one: 5 x 90; after three: 3 x 100). Capped at
    2 rows, the six rows make three micro-batches of like lengths, dealt costliest first to the least-loaded rank with
    room: 200 -> rank 0, 60 -> rank 1, 20 -> rank 1 (rank 0 is fuller)."""
    from rapo_ray.types.batch import balanced_micro_batches

    lengths = [100, 20, 90, 25, 30, 10]
    assert balanced_micro_batches(lengths, world=2, max_rows=0) == [[[0, 2]], [[4, 3, 1, 5]]]
    assert balanced_micro_batches(lengths, world=2, max_rows=2) == [[[0, 2], []], [[4, 3], [1, 5]]]
    # a cap at least a rank's share still gives one micro-batch per rank, each within the cap
    assert balanced_micro_batches(lengths, world=2, max_rows=3) == [[[0, 2, 4]], [[3, 1, 5]]]
    assert balanced_micro_batches([7, 7, 7], world=2, max_rows=0) == [[[0, 1]], [[2]]]
    assert balanced_micro_batches([5], world=3, max_rows=0) == [[[0]], [[]], [[]]]
    assert balanced_micro_batches([], world=2, max_rows=0) == [[[]], [[]]]
    with pytest.raises(ValueError, match="max_rows >= 0"):
        balanced_micro_batches(lengths, world=2, max_rows=-1)


@pytest.mark.parametrize("max_rows", [0, 1, 3, 8])
def test_balanced_micro_batches_cover_every_row_once_and_never_pad_more_than_row_order(max_rows):
    """Random batches: every row lands in exactly one micro-batch, ranks end with the same count, no micro-batch
    passes the cap, no rank makes more passes than row order gives it, and the slowest rank's padded tokens (the sum
    over its micro-batches of rows x longest row) never exceed row order's."""
    import random

    from rapo_ray.types.batch import balanced_micro_batches
    from rapo_ray.workers.learner import micro_batch_rows

    def slowest(split, lengths):
        return max(sum(len(mb) * max((lengths[i] for i in mb), default=0) for mb in mbs) for mbs in split)

    rng = random.Random(max_rows)
    for _ in range(200):
        world = rng.choice([1, 2, 3, 4])
        lengths = [rng.randint(5, 300) for _ in range(rng.randint(0, 40))]
        got = balanced_micro_batches(lengths, world, max_rows)
        assert len(got) == world and len({len(mbs) for mbs in got}) == 1
        assert sorted(i for mbs in got for mb in mbs for i in mb) == list(range(len(lengths)))
        assert all(len(mb) <= (max_rows or len(lengths)) for mbs in got for mb in mbs)
        share = max(1, -(-len(lengths) // world))
        row_order = micro_batch_rows(lengths, world, max_rows, "row-order")
        assert len(got[0]) <= len(row_order[0])
        if max_rows == 0 or max_rows >= share:
            assert slowest(got, lengths) <= slowest(row_order, lengths)


def test_logprob_gap_between_engine_and_learner_by_hand():
    """Only generated tokens count: row 0 has 2 generated (engine -0.5 each) and 2 tool-result tokens."""
    from rapo_ray.training.reporting import logprob_gap

    b = TrajectoryBatch([_traj(0, 4), _traj(1, 5)])
    assert logprob_gap(b) == {}  # no old-policy pass yet
    b.learner = LearnerBatch.from_trajectories(b.trajectories, pad_id=0)
    lp = torch.full(b.learner.loss_mask.shape, -9.0)  # outside generated targets: ignored however wrong
    lp[0, 2:4] = torch.tensor([-0.5, -0.7])  # row 0's generated targets: gaps 0, 0.2
    lp[1, 2:5] = torch.tensor([-0.4, -0.5, -1.5])  # row 1's: gaps 0.1, 0, 1.0
    b.learner.old_logprobs = lp
    gap = logprob_gap(b)
    assert gap["logprob_gap_mean"] == pytest.approx((0.2 + 0.1 + 1.0) / 5) and gap["logprob_gap_max"] == pytest.approx(
        1.0
    )
