"""The real-model recipe (configs/smollm2_gsm8k.yaml) end to end on a small batch: the packaged SmolLM2 converted
once, its cold start on GSM8K gold solutions, a step-trace buffer in Milvus behind Serve, then RAPO steps on GSM8K
with the python tool through the fleet (on-policy and hybrid slots), the learner and the weight sync, and the
held-out evaluation before and after. RAPO runs every stage GRPO does, and the buffer, retrieval and hybrid slots
on top. The buffer comes from the human solutions here: a two-step cold start rarely calls the tool, so its own
samples (the recipe's ``policy`` source, tested in tests/unit/test_buffer_sources.py) would give an empty buffer."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from rapo_ray.config import load_config
from rapo_ray.launch.launcher import run
from rapo_ray.model.factory import load_tokenizer
from rapo_ray.types import protocol

REPO = Path(__file__).resolve().parents[2]


def test_two_rapo_steps_of_the_real_model_recipe(ray_session, smollm2_dir, tmp_path):
    cfg = load_config(
        REPO / "configs" / "smollm2_gsm8k.yaml",
        [
            f"run.artifacts_dir={smollm2_dir.parents[1]}",  # the session's converted model is reused
            f"run.output_dir={tmp_path}",
            "run.name=smollm2",
            "run.progress=false",
            "cold_start.examples=8",
            "cold_start.steps=2",
            "cold_start.batch_size=2",
            "rollout.engine=torch",
            "rollout.max_response_tokens=128",
            "rollout.max_step_tokens=48",
            "trainer.total_steps=2",
            "trainer.eval_size=4",
            "tasks.eval_limit=4",
            "trainer.rl_questions=16",
            "algo.name=rapo",
            "retrieval.buffer_source=solutions",
            "retrieval.buffer_questions=8",
        ],
    )
    said = []
    summary = run(cfg, log=said.append)
    rd = Path(summary["run_dir"])
    # the cold start trained in a worker process that exits after it, not in the driver that then runs for hours
    assert any("cold start (SFT on solutions) once, in a worker process" in line for line in said), said
    steps = [m for m in map(json.loads, open(rd / "metrics.jsonl")) if "reward" in m]
    assert len(steps) == 2 and all(m["generated_tokens"] > 0 and m["update_s"] > 0 for m in steps)
    # the torch engine and the fp32 learner score the sampled tokens alike
    assert all(0 <= m["logprob_gap_max"] < 1e-3 for m in steps), [m["logprob_gap_max"] for m in steps]
    assert summary["paired_change"]["gsm8k"]["n"] == 4
    cold = json.loads(next(Path(cfg.run.artifacts_dir).glob("cold-start-*/built_on.json")).read_text())
    assert cold["demonstrations"]["read"] == 8 and cold["steps"] == 2
    # rollouts are the model's chat template around the paper's system prompt, on questions after the cold start's
    tok = load_tokenizer(smollm2_dir)
    rows = pq.read_table(rd / "trajectories" / "step-000001.parquet").to_pylist()
    assert len(rows) == 2 * 4 and all(r["problem_id"].startswith("gsm8k_openai-") for r in rows)
    assert all(int(r["problem_id"].rsplit("-", 1)[1]) >= 8 for r in rows)
    prompt = tok.decode(rows[0]["prompt_ids"])
    assert prompt.startswith("<|im_start|>system\n" + protocol.SYSTEM_PROMPT)
    # the buffer: human calculator steps of the first 8 RL questions, in the collection named by its fingerprint
    (manifest,) = (Path(cfg.run.artifacts_dir) / "milvus").glob("manifest-step_traces_*.json")
    built = json.loads(manifest.read_text())
    assert built["built_for"]["retrieval.buffer_source"] == "solutions" and 5 <= len(built["questions"]) <= 8
    # the last 2 slots of each group are hybrid; every retrieval the metrics count is a retrieved block in a row,
    # and each block is a stored human step (a python call and its result)
    assert [r["slot_kind"] for r in rows[:4]] == ["on_policy", "on_policy", "hybrid", "hybrid"]
    all_rows = rows + pq.read_table(rd / "trajectories" / "step-000002.parquet").to_pylist()
    blocks = [
        tok.decode(r["response_ids"][seg["start"] : seg["end"]])
        for r in all_rows
        for seg in r["segments"]
        if seg["kind"] == "retrieved"
    ]
    assert len(blocks) == sum(m["retrievals"] for m in steps)
    assert all("<python>print(" in b and "</result>" in b for b in blocks), blocks
