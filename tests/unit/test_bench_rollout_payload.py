"""benchmarks/bench_rollout_payload.py: both forms carry the same tokens to the same learner tensors; shapes parse."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

from rapo_ray.types.learner_batch import LearnerBatch
from tests.helpers import benchmark_module


def test_both_forms_round_trip_to_the_same_learner_batch(monkeypatch):
    bench = benchmark_module("bench_rollout_payload")
    monkeypatch.setitem(sys.modules, bench.__name__, bench)  # pickle finds ListTrajectory by its module's name
    outputs = bench.engine_outputs(5, 13, prompt=4)
    arrays, lists = (bench.build(cls, outputs) for cls in (bench.Trajectory, bench.ListTrajectory))
    assert type(lists[0].response_ids) is list and lists[0].loss_mask[:3] == [1, 1, 0]  # 13 tokens: cuts 2, 4, ...
    assert [t.segments for t in arrays] == [t.segments for t in lists] and len(arrays[0].segments) == bench.SEGMENTS
    a, b = (LearnerBatch.from_trajectories(ts, pad_id=0, behaviour=True) for ts in (arrays, lists))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
    for cls in bench.FORMS.values():
        row = bench.one_round(cls, outputs, pieces=2)
        assert row["bytes"] > 0 and row["driver_ms"] == pytest.approx(row["load_ms"] + row["learner_ms"])


def test_shapes_parse_or_are_refused_by_name():
    bench = benchmark_module("bench_rollout_payload")
    assert bench.parse_shape("64x105") == (64, 105, 1) and bench.parse_shape("4000x144/1000") == (4000, 144, 1000)
    for bad in ("64", "64x", "4x144/8", "0x10"):
        with pytest.raises(argparse.ArgumentTypeError, match="--shapes"):
            bench.parse_shape(bad)
