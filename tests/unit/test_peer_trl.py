"""benchmarks/peer_trl.py: TRL is fed the questions our run drew, in our order."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from tests.helpers import benchmark_module


def test_prompt_order_is_each_steps_groups_in_stored_order(tmp_path):
    peer = benchmark_module("peer_trl")
    traj = tmp_path / "trajectories"
    traj.mkdir()
    # two steps of 2 prompts x 3 rollouts; step 2 draws gsm8k-7 again (a later epoch), which TRL must see twice
    steps = {
        1: ["gsm8k-7", "gsm8k-7", "gsm8k-7", "gsm8k-2", "gsm8k-2", "gsm8k-2"],
        2: ["gsm8k-9"] * 3 + ["gsm8k-7"] * 3,
    }
    for step, ids in steps.items():
        pq.write_table(pa.table({"problem_id": ids}), traj / f"step-{step:06d}.parquet")
    assert peer.prompt_order(tmp_path) == ["gsm8k-7", "gsm8k-2", "gsm8k-9", "gsm8k-7"]


def test_the_real_model_side_asks_for_a_boxed_answer_without_tools():
    peer = benchmark_module("peer_trl")

    class Args:
        artifacts, overrides = "/tmp/a", ["trainer.seed=3"]

    args = Args()
    args.config = "configs/smollm2_gsm8k.yaml"
    real = peer.common_overrides(args)
    assert real[1] == f"tasks.system_prompt={peer.NO_TOOL_PROMPT}" and real[-1] == "trainer.seed=3"
    assert "<answer>\\boxed{...}</answer>" in peer.NO_TOOL_PROMPT
    args.config = None
    assert peer.common_overrides(args)[1] == "tasks.system_prompt=short"
