"""benchmarks/bench_target_logits.py: one pass per mode on a saved step's longest rows, the same targets in both."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from tests.helpers import benchmark_module


def test_one_pass_takes_the_longest_rows_and_counts_their_generated_targets(tiny_model_dir, tmp_path):
    bench = benchmark_module("bench_target_logits")
    rows = {
        "prompt_ids": [[3, 4], [3], [3, 4, 5]],
        "response_ids": [[7, 8, 9], [7], [7, 8, 9, 10]],
        "loss_mask": [[1, 0, 1], [1], [1, 1, 0, 1]],
        "logprobs": [[-0.5, 0.0, -0.25], [-1.0], [-0.1] * 4],
        "slot_kind": ["on_policy", "hybrid", "on_policy"],
        "advantage": [0.5, -0.5, 0.0],
        "shaping": [1.0, 1.0, 1.0],
    }
    pq.write_table(pa.table(rows), tmp_path / "step-000002.parquet")
    got = [bench.one_pass(str(tiny_model_dir), str(tmp_path / "step-000002.parquet"), 2, m) for m in bench.MODES]
    for res in got:  # rows 2 (7 tokens) and 0 (5 tokens): T 7, targets 3 + 2
        assert (res["rows"], res["T"], res["targets"], res["positions"]) == (2, 7, 5, 12)
        assert res["seconds"] > 0 and res["peak_rss_mb"] >= res["rss_before_mb"] > 0
    assert [r["mode"] for r in got] == ["all", "targets"]
