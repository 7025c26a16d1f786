"""The scripted expert and the warm start's demonstrations (rapo_ray/pipelines)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from rapo_ray.agent.loop import AgentLoop
from rapo_ray.agent.retriever import InMemoryStepRetriever, steps_of
from rapo_ray.envs.suite import task_difficulty, task_splits
from rapo_ray.pipelines.expert import ScriptedExpertEngine
from rapo_ray.types import protocol
from tests.helpers import settings

SCHEDULES = pytest.mark.parametrize("schedule", ["lockstep", "per_trajectory"])


@SCHEDULES
def test_expert_solves_every_family_through_real_tools(tiny_cfg, tiny_tokenizer, tools, schedule):
    _, test = task_splits(tiny_cfg.tasks)
    loop = AgentLoop(ScriptedExpertEngine(tiny_tokenizer), tiny_tokenizer, tools, settings(schedule=schedule))
    for fam, tasks in test.items():
        trajs, _ = loop.run_groups(tasks[:50], 1)
        acc = sum(t.correct for t in trajs) / len(trajs)
        assert acc >= 0.99, fam
        assert all(t.format_ok and t.reward == 1.0 for t in trajs)
        assert all(t.tool_calls >= 2 for t in trajs)  # multi-step: every problem needs 2-3 tool calls


def test_expert_continues_from_a_retrieved_step_that_is_its_next_one():
    q = "Ben has 756 pens. Ben buys 9 boxes of 51 pens. Ben finds 108 more pens. Ben finds 508 more pens. How many pens does Ben have now?"
    expert = ScriptedExpertEngine(None)

    def step(response):
        return expert.next_step(f"{protocol.USER}{q}{protocol.ASSISTANT}{response}")

    own = "<think>compute 756 + 9 * 51</think><python>print(756 + 9 * 51)</python><result>1215</result>"
    fits = (
        "<retrieve><think>compute 1215 + 108</think><python>print(1215 + 108)</python><result>1323</result></retrieve>"
    )
    other = "<retrieve><think>compute 99 + 108</think><python>print(99 + 108)</python><result>207</result></retrieve>"
    last = (
        "<retrieve><think>compute 1323 + 508</think><python>print(1323 + 508)</python><result>1831</result></retrieve>"
    )
    assert "print(1215 + 108)" in step(own) and "print(1215 + 108)" in step(
        own + other
    )  # another question's step: ignored
    assert "print(1323 + 508)" in step(own + fits)  # its own next step, retrieved: built upon
    assert step(own + fits + last).endswith("<answer>\\boxed{1831}</answer>")
    assert "print(756 + 9 * 51)" in step(fits)  # a later step before the first one does not fit
    mq = "Who is the sibling of the rival of the neighbor of Jopado?"
    m1 = "<think>x</think><search>neighbor of Jopado</search><result>The neighbor of Jopado is Vesire.</result>"
    mr = "<retrieve><think>x</think><search>rival of Vesire</search><result>The rival of Vesire is Kalo.</result></retrieve>"
    assert expert.next_step(f"{protocol.USER}{mq}{protocol.ASSISTANT}{m1}{mr}").endswith(
        "<search>sibling of Kalo</search>"
    )


def test_warm_start_hybrid_demos_with_own_question_steps(tiny_cfg, tiny_tokenizer, tools):
    """sft_retrieval_scope=own: hybrid demos splice in the question's own expert steps and the expert builds on
    them, so those demos still solve the problem with fewer tool calls of its own."""
    from rapo_ray.pipelines.sft import expert_trajectories

    _, test = task_splits(tiny_cfg.tasks)
    tasks_ = test["arith"][:6] + test["multihop"][:6]
    steps = [
        st for tr in expert_trajectories(tiny_cfg, tiny_tokenizer, tools, tasks_) for st in steps_of(tiny_tokenizer, tr)
    ]
    demos = expert_trajectories(
        tiny_cfg,
        tiny_tokenizer,
        tools,
        tasks_,
        hybrid_fraction=1.0,
        retriever=InMemoryStepRetriever(steps, question_scope="own"),
        seed=1,
    )
    with_blocks = [d for d in demos if d.num_retrievals]
    assert all(d.correct for d in demos) and len(with_blocks) >= 4
    assert all(r.source_id == d.problem_id for d in with_blocks for r in d.retrievals)
    plan_steps = {t.id: task_difficulty(t) for t in tasks_}
    # a retrieved step that was the expert's next one is not redone (a retrieved repeat of a done step is ignored)
    assert all(d.tool_calls + d.num_retrievals >= plan_steps[d.problem_id] for d in with_blocks)
    assert sum(d.tool_calls < plan_steps[d.problem_id] for d in with_blocks) >= 3


def test_expert_with_errors_varies_rewards(tiny_cfg, tiny_tokenizer, tools):
    _, test = task_splits(tiny_cfg.tasks)
    loop = AgentLoop(ScriptedExpertEngine(tiny_tokenizer, error_rate=0.3, seed=1), tiny_tokenizer, tools, settings())
    trajs, _ = loop.run_groups(test["multihop"][:20], 4)
    acc = sum(t.correct for t in trajs) / len(trajs)
    assert 0.05 < acc < 0.95


def test_cold_start_demonstrations_mask_tool_results_and_drop_bad_solutions(tiny_cfg, tiny_tokenizer, tools, tmp_path):
    """GSM8K gold solutions in the tool protocol: policy steps trained, sandbox results masked, the end-of-turn token
    trained; a solution whose annotation the sandbox does not reproduce, or that is too long, is dropped."""
    import json
    from dataclasses import replace

    from rapo_ray.pipelines.cold_start import cold_start_examples

    rows = [
        {"question": "2 apples and 3 more?", "answer": "She has 2+3 = <<2+3=5>>5 apples.\n#### 5"},
        {"question": "Wrong note?", "answer": "It is 2*3 = <<2*3=7>>7.\n#### 7"},
        {"question": "Long?", "answer": "".join(f"Step {i}: <<{i}+1={i + 1}>>.\n" for i in range(40)) + "#### 40"},
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = replace(tiny_cfg, cold_start=replace(tiny_cfg.cold_start, examples=3, file=str(data)))
    examples, counts = cold_start_examples(cfg, tiny_tokenizer, tools)
    assert counts == {"read": 3, "kept": 1, "tool_mismatch": 1, "too_long": 1}
    ((ids, mask),) = examples
    first = mask.index(1)
    text = lambda a, b: tiny_tokenizer.decode(ids[a:b], skip_special_tokens=False)  # noqa: E731
    assert "2 apples and 3 more?" in text(0, first)  # the prompt: what the agent loop would send
    trained = "".join(text(i, i + 1) for i, m in enumerate(mask) if m)
    masked = "".join(text(i, i + 1) for i, m in enumerate(mask[first:], first) if not m)
    assert trained == "<think>She has 2+3 = 5 apples.</think><python>print(2+3)</python>" + (
        "<think>done</think><answer>\\boxed{5}</answer>" + tiny_tokenizer.eos_token
    )
    assert masked == "<result>5</result>"


def test_a_cold_start_from_the_families_is_the_scripted_experts_solutions_and_rl_comes_after_them(
    tiny_cfg, tiny_tokenizer, tools
):
    """cold_start.source=families: the first cold_start.examples training problems of each family, solved by the
    scripted expert (python calls trained, the recorded results masked); RL questions start after them."""
    from dataclasses import replace

    from rapo_ray.envs import tasks as bundled
    from rapo_ray.pipelines.cold_start import cold_start_dir, cold_start_examples
    from rapo_ray.pipelines.sft import sft_span
    from rapo_ray.training.trainer import rl_task_pool

    n = sft_span(tiny_cfg) + 3  # past the warm-start span: RL starts after the cold start's demonstrations
    cfg = replace(
        tiny_cfg,
        tasks=replace(tiny_cfg.tasks, families=["arith"], difficulty=0, train_size=n + 10),
        cold_start=replace(tiny_cfg.cold_start, examples=n, source="families"),
    )
    problems = bundled.generate("arith", "train", cfg.tasks.train_size, cfg.tasks.seed)
    few = replace(cfg, cold_start=replace(cfg.cold_start, examples=2))
    examples, counts = cold_start_examples(few, tiny_tokenizer, tools)
    assert counts == {"read": 2, "kept": 2, "tool_mismatch": 0, "too_long": 0}
    ids, mask = examples[0]
    trained = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    first_call = problems[0].expert_steps[0][2]
    assert f"<python>{first_call}</python>" in trained and f"\\boxed{{{problems[0].answers[0]}}}" in trained
    assert "<result>" not in trained  # tool results are context, not trained
    pool, _ = rl_task_pool(cfg)
    assert pool["arith"][0].question == problems[n].question
    assert cold_start_dir(cfg, Path("m")) != cold_start_dir(
        replace(cfg, cold_start=replace(cfg.cold_start, source="file")), Path("m")
    )


def test_rl_questions_of_a_data_file_come_after_its_cold_start_head(tiny_cfg, tmp_path):
    import json
    from dataclasses import replace

    from rapo_ray.training.trainer import rl_task_pool

    data = tmp_path / "gsm" / "train.jsonl"
    data.parent.mkdir()
    data.write_text(
        "".join(json.dumps({"question": f"q{i}?", "answer": f"<<{i}+0={i}>>\n#### {i}"}) + "\n" for i in range(10))
    )
    cfg = replace(tiny_cfg, tasks=replace(tiny_cfg.tasks, families=[], data_files=[str(data)]))
    pool, _ = rl_task_pool(cfg)
    assert [t.question for t in pool["gsm"]] == [f"q{i}?" for i in range(10)]
    cold = replace(cfg, cold_start=replace(cfg.cold_start, examples=4, file=str(data)))
    pool, _ = rl_task_pool(cold)
    assert [t.question for t in pool["gsm"]] == [f"q{i}?" for i in range(4, 10)]


def test_a_cold_start_is_found_whether_its_base_model_is_named_relatively_or_absolutely(
    tiny_cfg, tmp_path, monkeypatch
):
    """A benchmark passing ``--artifacts /abs/artifacts`` must find the cold start that ``artifacts/`` built."""
    from rapo_ray.pipelines.cold_start import cold_start_dir

    (tmp_path / "artifacts" / "models" / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    relative = cold_start_dir(tiny_cfg, Path("artifacts/models/m"))
    absolute = cold_start_dir(tiny_cfg, tmp_path / "artifacts" / "models" / "m")
    assert relative == absolute
    other = cold_start_dir(
        replace(tiny_cfg, cold_start=replace(tiny_cfg.cold_start, steps=41)), Path("artifacts/models/m")
    )
    assert other != relative  # a different recipe is a different cold start


def test_sft_with_the_head_only_at_targets_trains_as_the_full_logits_do(tiny_model_dir):
    """train_sft's ``logits_only_at_targets`` (learner.logits_only_at_targets): the same losses, step for step, and
    the same weights after, to float rounding, as every position's logits selected afterwards."""
    import torch

    from rapo_ray.model.factory import load_model
    from rapo_ray.pipelines.sft import train_sft

    examples = [([5, 6, 7, 8, 9, 10][: 3 + i], [0, 0, 1, 0, 1, 1][: 3 + i]) for i in range(4)]
    runs = []
    for only_at in (True, False):
        model = load_model(tiny_model_dir)
        losses = train_sft(model, examples, 3, batch_size=4, log=None, warmup=1, logits_only_at_targets=only_at)
        runs.append((losses, model.state_dict()))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-5)
    # AdamW divides by the gradient's running RMS, so a weight whose gradient is ~0 moves by rounding-sized amounts
    # either way: 1e-5 against the 3 x 2e-3 = 6e-3 that 3 steps can move a weight
    for name, value in runs[0][1].items():
        torch.testing.assert_close(value, runs[1][1][name], rtol=1e-4, atol=1e-5)
