"""Where the step-trace buffer's samples come from (``retrieval.buffer_source``), which questions are sampled, and
the default collection named by what the buffer is built for."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from rapo_ray.config import load_config, to_dict
from rapo_ray.core.errors import ConfigError, DataError, StoreError
from rapo_ray.envs.suite import task_splits
from rapo_ray.pipelines.buffer import (
    PolicySampler,
    SolutionSampler,
    StepSampler,
    _write_manifest,
    buffer_collection,
    buffer_fingerprint,
    buffer_questions,
    buffer_source,
    build_buffer,
    manifest_path,
    sibling_buffer,
    with_buffer_collection,
)
from rapo_ray.pipelines.sft import expert_trajectories
from rapo_ray.types.trajectory import GENERATED, TOOL_RESULT


def _batch(tasks) -> dict:
    return {
        "id": [t.id for t in tasks],
        "question": [t.question for t in tasks],
        "answers": [json.dumps(list(t.answers)) for t in tasks],
        "kind": [t.kind for t in tasks],
    }


def test_default_collection_is_named_by_what_the_buffer_is_built_for(tiny_cfg, tiny_model_dir, tmp_path):
    assert tiny_cfg.retrieval.collection == ""
    name = buffer_collection(tiny_cfg, str(tiny_model_dir))
    assert name.startswith("step_traces_") and len(name) == len("step_traces_") + 12
    assert buffer_collection(tiny_cfg, str(tiny_model_dir)) == name  # stable
    # another tokenizer (its ids decode to other text), other tasks, another sampler: another buffer
    other_tok = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other_tok)
    tok_file = other_tok / "tokenizer_config.json"
    tok_file.write_text(tok_file.read_text().replace("{", '{"model_max_length": 77, ', 1))
    assert buffer_collection(tiny_cfg, str(other_tok)) != name
    assert buffer_collection(replace(tiny_cfg, tasks=replace(tiny_cfg.tasks, seed=99)), str(tiny_model_dir)) != name
    policy = replace(tiny_cfg, retrieval=replace(tiny_cfg.retrieval, buffer_source="policy"))
    assert buffer_collection(policy, str(tiny_model_dir)) != name
    # a name the user chose is kept; resolving leaves the caller's config as it was
    named = replace(tiny_cfg, retrieval=replace(tiny_cfg.retrieval, collection="mine"))
    assert buffer_collection(named, str(tiny_model_dir)) == "mine"
    resolved = with_buffer_collection(tiny_cfg, str(tiny_model_dir))
    assert resolved.retrieval.collection == name and tiny_cfg.retrieval.collection == ""
    # the builder is never handed an unresolved name (it would write a collection called "")
    with pytest.raises(StoreError, match="retrieval.collection is empty.*with_buffer_collection"):
        build_buffer(tiny_cfg, str(tiny_model_dir), str(tmp_path / "b.db"), [], tmp_path / "m.json")
    # a build that stored no step says so on the console (the run goes on, its hybrid slots retrieving nothing)
    said = []
    build_buffer(resolved, str(tiny_model_dir), str(tmp_path / "b.db"), [], tmp_path / "m.json", log=said.append)
    assert said[-1] == f"step-trace buffer {name!r} is EMPTY: no scripted-expert sample of its 0 questions gave a " \
        "step, so hybrid slots will retrieve nothing"  # fmt: skip


def test_buffer_source_and_questions(tiny_cfg):
    assert buffer_source(tiny_cfg) == "scripted-expert"  # the bundled model: its tasks' scripted expert
    real = replace(tiny_cfg, model=replace(tiny_cfg.model, path="/some/hf/folder"))
    assert buffer_source(real) == "policy"  # a real model: the paper's recipe, samples of the starting policy
    forced = replace(real, retrieval=replace(real.retrieval, buffer_source="scripted-expert"))
    assert buffer_source(forced) == "scripted-expert"
    train, _ = task_splits(tiny_cfg.tasks)
    pool = {"arith": train["arith"][:5], "multihop": train["multihop"][:3]}
    assert buffer_questions(tiny_cfg, pool) == pool["arith"] + pool["multihop"]  # 0: every RL question
    two = replace(tiny_cfg, retrieval=replace(tiny_cfg.retrieval, buffer_questions=2))
    assert buffer_questions(two, pool) == pool["arith"][:2] + pool["multihop"][:2]  # the first N of each family


def test_config_refuses_a_buffer_source_that_cannot_sample_the_tasks(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    with pytest.raises(ConfigError, match="buffer_source=scripted-expert solves only the bundled families.*policy"):
        load_config(overrides=[f"tasks.data_files=[{data}]", "retrieval.buffer_source=scripted-expert"])
    with pytest.raises(ConfigError, match="buffer_source=solutions reads the human solutions of tasks.data_files"):
        load_config(overrides=["retrieval.buffer_source=solutions"])
    with pytest.raises(ConfigError, match="retrieval.buffer_questions"):
        load_config(overrides=["retrieval.buffer_questions=-1"])
    with pytest.raises(ConfigError, match="retrieval.buffer_source"):
        load_config(overrides=["retrieval.buffer_source=humans"])


class _ExpertWithErrors(StepSampler):
    """A sampler whose N samples differ in reward, keeping what it sampled for the test to check against."""

    source = "test-expert"

    def trajectories(self, tasks, samples):
        self.sampled = expert_trajectories(
            self.cfg, self.tok, self.tools, tasks, seed=3, error_rate=0.4, samples=samples
        )
        return self.sampled


def test_sampler_keeps_the_top_k_trajectories_by_reward_and_splits_them_into_steps(
    tiny_cfg, tiny_model_dir, tiny_tokenizer
):
    cfg = replace(tiny_cfg, retrieval=replace(tiny_cfg.retrieval, buffer_samples_per_question=4, buffer_keep_top_k=2))
    train, _ = task_splits(cfg.tasks)
    tasks = train["multihop"][:6]
    sampler = _ExpertWithErrors(str(tiny_model_dir), to_dict(cfg), seed=0)
    out = sampler(_batch(tasks))
    by_q: dict[str, list] = {}
    for t in sampler.sampled:
        by_q.setdefault(t.problem_id, []).append(t)
    assert all(len(ts) == 4 for ts in by_q.values()) and len(by_q) == 6
    assert any(len({t.reward for t in ts}) > 1 for ts in by_q.values())  # the choice is not trivial
    kept = {f"{q}#{t.slot}": t for q, ts in by_q.items() for t in sorted(ts, key=lambda t: (-t.reward, t.slot))[:2]}
    # only the kept trajectories give steps, one per tool call (the answer step is not stored)
    assert set(out["traj_id"]) <= set(kept)
    for traj_id in set(out["traj_id"]):
        assert list(out["traj_id"]).count(traj_id) == kept[traj_id].tool_calls
    rows = list(zip(out["traj_id"], out["value"], out["value_ids"], out["reward"], out["source"]))
    assert rows and all(src == "test-expert" for *_, src in rows)
    for traj_id, value, ids, reward, _ in rows:
        assert reward == kept[traj_id].reward
        assert tiny_tokenizer.decode(json.loads(ids), skip_special_tokens=False) == value  # token ids, as sampled


def test_policy_sampler_draws_n_seeded_on_policy_samples_per_question(tiny_cfg, tiny_model_dir):
    cfg = replace(
        tiny_cfg,
        model=replace(tiny_cfg.model, path=str(tiny_model_dir)),
        rollout=replace(tiny_cfg.rollout, engine="torch", max_response_tokens=40, max_step_tokens=12),
    )
    _, test = task_splits(cfg.tasks)
    tasks = test["arith"][:2] + test["multihop"][:1]
    first = PolicySampler(str(tiny_model_dir), to_dict(cfg), seed=5).trajectories(tasks, 3)
    again = PolicySampler(str(tiny_model_dir), to_dict(cfg), seed=5).trajectories(tasks, 3)
    assert sorted((t.problem_id, t.slot) for t in first) == sorted((t.id, s) for t in tasks for s in range(3))
    assert all(kind in (GENERATED, TOOL_RESULT) for t in first for kind, *_ in t.segments)  # on-policy
    assert [t.response_ids.tolist() for t in first] == [
        t.response_ids.tolist() for t in again
    ]  # a rebuild draws the same samples
    assert len({tuple(t.response_ids) for t in first}) > 1  # sampled at the training temperature, not greedy


def test_solution_sampler_writes_human_calculator_steps_as_tool_calls(
    tiny_cfg, tiny_model_dir, tiny_tokenizer, tmp_path
):
    data = tmp_path / "gsm" / "train.jsonl"
    data.parent.mkdir()
    rows = [
        {
            "question": "Ann has 2 apples and buys 3. Then she doubles them. How many?",
            "answer": "She has 2+3 = <<2+3=5>>5.\nDoubled: 5*2 = <<5*2=10>>10.\n#### 10",
        },
        {"question": "A wrong note?", "answer": "It is 2*3 = <<2*3=7>>7.\n#### 7"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = replace(
        tiny_cfg,
        tasks=replace(tiny_cfg.tasks, families=[], data_files=[str(data)]),
        retrieval=replace(tiny_cfg.retrieval, buffer_source="solutions"),
    )
    train, _ = task_splits(cfg.tasks)
    tasks = train["gsm"]
    sampler = SolutionSampler(str(tiny_model_dir), to_dict(cfg), seed=0)
    out = sampler(_batch(tasks))
    # the second rationale's annotation is wrong (2*3 is not 7): it gives no steps
    assert list(out["traj_id"]) == [f"{tasks[0].id}#0"] * 2 and set(out["reward"]) == {1.0}
    assert list(out["value"]) == [
        "<think>She has 2+3 = 5.</think><python>print(2+3)</python><result>5</result>",
        "<think>Doubled: 5*2 = 10.</think><python>print(5*2)</python><result>10</result>",
    ]
    assert out["key"][0] == rows[0]["question"] and out["key"][1] == rows[0]["question"] + out["value"][0]
    assert [json.loads(i) for i in out["value_ids"]][0] == tiny_tokenizer(out["value"][0], add_special_tokens=False)[
        "input_ids"
    ]
    assert set(out["source"]) == {"solutions"}
    stranger = replace(tasks[0], id="gsm-999")
    with pytest.raises(DataError, match="gsm-999 has no solution in tasks.data_files"):
        sampler.trajectories([stranger], 1)


def test_a_sibling_buffer_is_the_same_setup_with_another_backend(tiny_cfg, tiny_model_dir, tmp_path):
    def setup(**retrieval):
        cfg = replace(tiny_cfg, run=replace(tiny_cfg.run, artifacts_dir=str(tmp_path)))
        return with_buffer_collection(replace(cfg, retrieval=replace(cfg.retrieval, **retrieval)), str(tiny_model_dir))

    def write(cfg, questions):
        manifest = manifest_path(cfg)
        _write_manifest(manifest, set(questions), buffer_fingerprint(cfg, str(tiny_model_dir)))
        return manifest

    bm25, minilm = setup(embedder="bm25"), setup(embedder="minilm")
    ours = manifest_path(bm25)
    fingerprint = buffer_fingerprint(bm25, str(tiny_model_dir))
    assert sibling_buffer(ours, fingerprint) is None  # nothing else built yet
    write(setup(embedder="minilm", buffer_keep_top_k=1), ["q1", "q2", "q3"])  # other steps: never a sibling
    write(bm25, ["q9"])  # its own manifest is not its sibling
    assert sibling_buffer(ours, fingerprint) is None
    write(minilm, ["q1", "q2"])
    (tmp_path / "milvus" / "manifest-broken.json").write_text("{not json")  # skipped, not an error here
    assert sibling_buffer(ours, fingerprint) == (minilm.retrieval.collection, {"q1", "q2"})
