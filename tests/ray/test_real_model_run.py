"""The real-model recipe users run (configs/smollm2_arith.yaml) end to end on a small batch: the packaged SmolLM2
converted once, its cold start on the scripted expert's arith solutions, a step-trace buffer in Milvus behind Serve,
then RAPO steps with the python tool through the fleet (on-policy and hybrid slots) and the recipe's dynamic sampling,
the learner and the weight sync, and the held-out evaluation before and after. RAPO runs every stage GRPO does, and
the buffer, retrieval and hybrid slots on top. The buffer comes from the scripted expert here: a two-step cold start
rarely calls the tool, so its own samples (the recipe's ``policy`` source, tested in tests/unit/test_buffer_sources.py)
would give an empty buffer."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from rapo_ray.config import load_config
from rapo_ray.launch.launcher import run
from rapo_ray.model.factory import load_tokenizer
from rapo_ray.pipelines.buffer import manifest_path, with_buffer_collection
from rapo_ray.types import protocol

REPO = Path(__file__).resolve().parents[2]
GROUP = 4


def test_two_rapo_steps_of_the_real_model_recipe(ray_session, smollm2_dir, tmp_path):
    cfg = load_config(
        REPO / "configs" / "smollm2_arith.yaml",
        [
            f"run.artifacts_dir={smollm2_dir.parents[1]}",  # the session's converted model is reused
            f"run.output_dir={tmp_path}",
            "run.name=smollm2",
            "run.progress=false",
            "tasks.test_size=4",
            "cold_start.examples=8",
            "cold_start.steps=2",
            "cold_start.batch_size=1",  # a step of one example: the path, at half the cost
            "rollout.engine=torch",
            "rollout.threads_per_worker=2",  # the one worker rolls out (and evaluates) while the learners wait
            "rollout.max_response_tokens=128",
            "rollout.max_step_tokens=48",
            f"algo.group_size={GROUP}",
            "algo.name=rapo",
            "algo.rapo.n_hybrid=2",
            "algo.rapo.retrieve_prob=1.0",  # every hybrid slot that goes on past its first step retrieves
            f"learner.mini_batch_size={2 * GROUP}",
            "trainer.total_steps=2",
            "trainer.eval_size=4",
            "trainer.rl_questions=16",
            "trainer.validation_questions=0",
            "trainer.dynamic_sampling_budget=1.5",  # at most one refill group a step: the path, at a small cost
            "retrieval.buffer_source=scripted-expert",
            "retrieval.buffer_questions=8",
        ],
    )
    said = []
    summary = run(cfg, log=said.append)
    rd = Path(summary["run_dir"])
    # the cold start trained in a worker process that exits after it, not in the driver that then runs for hours
    assert any("once, in a worker process" in line for line in said), said
    steps = [m for m in map(json.loads, open(rd / "metrics.jsonl")) if "reward" in m]
    assert len(steps) == 2 and all(m["generated_tokens"] > 0 and m["update_s"] > 0 for m in steps)
    # the torch engine and the fp32 learner score the sampled tokens alike
    assert all(0 <= m["logprob_gap_max"] < 1e-3 for m in steps), [m["logprob_gap_max"] for m in steps]
    assert summary["paired_change"]["arith"]["n"] == 4
    (cold_dir,) = Path(cfg.run.artifacts_dir).glob("cold-start-*")  # the starting policy, the buffer built for it
    cold = json.loads((cold_dir / "built_on.json").read_text())
    assert cold["demonstrations"]["read"] == 8 and cold["steps"] == 2
    # dynamic sampling: the groups trained on are those with signal (or, with none, the first draw), a group each
    tok = load_tokenizer(smollm2_dir)
    for step, m in enumerate(steps, 1):
        kept, dropped = m["dynamic_sampling/groups_kept"], m["dynamic_sampling/groups_dropped"]
        assert kept + dropped + m["dynamic_sampling/groups_surplus"] <= 3  # the budget: 1.5 x 2 groups
        rows = pq.read_table(rd / "trajectories" / f"step-{step:06d}.parquet").to_pylist()
        trained = 2 if m["dynamic_sampling/no_signal"] else kept
        assert len(rows) == GROUP * trained, (len(rows), m)
    # rollouts are the model's chat template around the paper's system prompt, on questions after the cold start's
    rows = pq.read_table(rd / "trajectories" / "step-000001.parquet").to_pylist()
    assert all(r["problem_id"].startswith("arith-train-") for r in rows)
    assert all(int(r["problem_id"].rsplit("-", 1)[1]) >= 8 for r in rows)
    prompt = tok.decode(rows[0]["prompt_ids"])
    assert prompt.startswith("<|im_start|>system\n" + protocol.SYSTEM_PROMPT)
    # the buffer: the expert's python steps on the first 8 RL questions, in the collection named by its fingerprint
    built = json.loads(manifest_path(with_buffer_collection(cfg, str(cold_dir))).read_text())
    assert built["built_for"]["retrieval.buffer_source"] == "scripted-expert" and 5 <= len(built["questions"]) <= 8
    # the last 2 slots of each group are hybrid; every retrieval the metrics count is a retrieved block in a row,
    # and each block is a stored expert step (a python call and its result)
    assert [r["slot_kind"] for r in rows[:GROUP]] == ["on_policy", "on_policy", "hybrid", "hybrid"]
    all_rows = rows + pq.read_table(rd / "trajectories" / "step-000002.parquet").to_pylist()
    blocks = [
        tok.decode(r["response_ids"][seg["start"] : seg["end"]])
        for r in all_rows
        for seg in r["segments"]
        if seg["kind"] == "retrieved"
    ]
    assert len(blocks) == sum(m["retrievals"] for m in steps)
    assert all("<python>" in b and "</result>" in b for b in blocks), blocks
