"""benchmarks/peer_trl.py: TRL is fed the questions our run drew, in our order; with --tool-loop, TRL's rollouts
come from our agent loop on its own model (benchmarks/trl_rollout.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq

from rapo_ray.engines.scripted import ScriptedEngine
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


def _arith_tasks(n: int) -> dict:
    from rapo_ray.envs import tasks
    from rapo_ray.envs.suite import to_task

    return {t.id: t for t in map(to_task, tasks.generate("arith", "test", n, 0))}


def _trainer_of(model):
    """What the rollout function reads of TRL's trainer: its model, and accelerate's unwrap."""
    return SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m))


def test_the_tool_loop_reaches_trl_as_token_ids_with_tool_results_masked(tiny_cfg, tiny_tokenizer, monkeypatch):
    """--tool-loop's rollout function: one completion per prompt entry, in TRL's order (a prompt repeats once per
    generation of its group), the python tool's result inside the completion with env_mask 0, the loop's reward;
    ``close`` stops the python sandbox it started."""
    rollout_mod = benchmark_module("trl_rollout")
    closed = []

    def tools_recording_close(*args, **kwargs):
        tools = rollout_mod_build_tools(*args, **kwargs)
        close = tools.close
        tools.close = lambda: (closed.append(True), close())
        return tools

    rollout_mod_build_tools = rollout_mod.build_tools
    monkeypatch.setattr(rollout_mod, "build_tools", tools_recording_close)
    by_id = _arith_tasks(2)
    (a, b) = by_id
    right = by_id[a].answers[0]
    steps = ["<think>x</think><python>print(6*7)</python>", f"<think>y</think><answer>\\boxed{{{right}}}</answer>"]
    rollout = rollout_mod.tool_loop_rollout(
        tiny_cfg, tiny_tokenizer, by_id, seed=0, engine_on=lambda model, tok, n: ScriptedEngine(tok, steps)
    )
    try:
        out = rollout([a, a, b], _trainer_of(model=SimpleNamespace()))
    finally:
        rollout.close()
    assert closed == [True]
    assert len(out["prompt_ids"]) == len(out["completion_ids"]) == 3
    assert out["loop_reward"][0] == out["loop_reward"][1] == 1.0 and out["correct"] == [True, True, False]
    assert out["loop_reward"][2] < 1.0  # b's answer is a's
    for ids, mask, logps in zip(out["completion_ids"], out["env_mask"], out["logprobs"]):
        assert len(ids) == len(mask) == len(logps)
        tool_part = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m == 0])
        assert "42" in tool_part and "print" not in tool_part  # the result only: the call is the model's
        assert "print(6*7)" in tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m == 1])
    question = tiny_tokenizer.decode(out["prompt_ids"][2])
    assert by_id[b].question in question


def test_the_tool_loop_samples_from_trls_live_weights(tiny_cfg, tiny_model_dir, tiny_tokenizer):
    """Our torch engine runs on TRL's model object: an update to its weights reaches the next rollout with no copy
    (zeroed embeddings give uniform logits, so every sampled token's log-prob is -log V), and the model's train mode
    is left as TRL set it."""
    import math

    import torch

    from rapo_ray.model.factory import load_model

    rollout_mod = benchmark_module("trl_rollout")
    by_id = _arith_tasks(1)
    model = load_model(tiny_model_dir).train()
    rollout = rollout_mod.tool_loop_rollout(tiny_cfg, tiny_tokenizer, by_id, seed=0)
    try:
        first = rollout(list(by_id) * 2, _trainer_of(model))
        assert model.training
        assert any(lp < -1e-3 for row in first["logprobs"] for lp in row)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "embed_tokens" in name or "lm_head" in name:
                    p.zero_()
        second = rollout(list(by_id) * 2, _trainer_of(model))
    finally:
        rollout.close()
    uniform = -math.log(model.config.vocab_size)
    sampled = [lp for row, mask in zip(second["logprobs"], second["env_mask"]) for lp, m in zip(row, mask) if m]
    assert sampled and all(abs(lp - uniform) < 1e-4 for lp in sampled)
