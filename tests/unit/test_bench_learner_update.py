"""benchmarks/bench_learner_update.py's step loading and padding accounting, and the learner's order switches."""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rapo_ray.config import load_config
from tests.helpers import benchmark_module


def test_a_saved_step_comes_back_with_its_tokens_advantages_and_shaping(tmp_path):
    bench = benchmark_module("bench_learner_update")
    rows = {
        "prompt_ids": [[3, 4], [3]],
        "response_ids": [[7, 8, 9], [7]],
        "loss_mask": [[1, 0, 1], [1]],
        "logprobs": [[-0.5, 0.0, -0.25], [-1.0]],
        "slot_kind": ["on_policy", "hybrid"],
        "advantage": [0.5, -0.5],
        "shaping": [1.0, 1.02],
    }
    pq.write_table(pa.table(rows), tmp_path / "step-000003.parquet")
    batch, signal = bench.step_batch(tmp_path / "step-000003.parquet")
    assert [t.token_ids() for t in batch] == [[3, 4, 7, 8, 9], [3, 7]]
    assert [t.loss_mask.tolist() for t in batch] == [[1, 0, 1], [1]] and [t.slot_kind for t in batch] == [
        "on_policy",
        "hybrid",
    ]
    assert signal["advantage"] == [0.5, -0.5] and signal["shaping"] == pytest.approx([1.0, 1.02])
    pq.write_table(pa.table({k: v for k, v in rows.items() if k != "shaping"}), tmp_path / "step-000004.parquet")
    assert bench.step_batch(tmp_path / "step-000004.parquet")[1] == {"advantage": [0.5, -0.5]}  # a GRPO step


def test_steps_are_parsed_or_refused_by_name():
    bench = benchmark_module("bench_learner_update")
    assert bench.parse_steps("2-4") == range(2, 5) and bench.parse_steps("7") == range(7, 8)
    for bad in ("x", "5-2", "0-3", "2-"):
        with pytest.raises(ValueError):
            bench.parse_steps(bad)


def test_the_learner_config_names_its_micro_batch_order():
    lc = load_config().learner
    assert lc.micro_batch_order() == "balanced"  # the default
    assert replace(lc, balanced_micro_batches=False).micro_batch_order() == "row-order"
    assert replace(lc, length_sorted_micro_batches=True).micro_batch_order() == "length-sorted"  # takes precedence


def test_each_order_the_benchmark_names_is_the_order_its_flags_give():
    from rapo_ray.types.batch import MICRO_BATCH_ORDERS

    bench = benchmark_module("bench_learner_update")
    lc = load_config().learner
    assert set(bench.ORDER_FLAGS) == set(MICRO_BATCH_ORDERS)
    for order, (balanced, length_sorted) in bench.ORDER_FLAGS.items():
        flags = replace(lc, balanced_micro_batches=balanced, length_sorted_micro_batches=length_sorted)
        assert flags.micro_batch_order() == order


def test_logits_modes_set_the_workers_flag_and_name_the_variants():
    from types import SimpleNamespace

    bench = benchmark_module("bench_learner_update")
    assert bench.LOGITS_FLAGS == {"targets": True, "all": False}
    assert load_config().learner.logits_only_at_targets is True  # the default the "targets" mode measures
    assert bench.variant_name("balanced", "all", ["targets", "all"]) == "balanced/all"
    assert bench.variant_name("balanced", "targets", ["targets"]) == "balanced"  # one mode: names as before
    worker = SimpleNamespace(cfg=load_config())
    bench._set_logits_mode(worker, False)
    assert worker.cfg.learner.logits_only_at_targets is False
