"""The multi-turn agent loop (no Ray): protocol parsing, token-in/token-out, hybrid rollout, retrieval failures,
ARPO branching, schedules, held-out evaluation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rapo_ray.agent import loop as agent_loop
from rapo_ray.agent.lockstep import run_lockstep
from rapo_ray.agent.loop import AgentLoop, LoopSettings
from rapo_ray.agent.per_trajectory import run_per_trajectory
from rapo_ray.agent.retriever import InMemoryStepRetriever, StoredStep, steps_of
from rapo_ray.agent.turns import answer_handed
from rapo_ray.algos.arpo import BranchingRollout
from rapo_ray.algos.rapo import HybridRollout
from rapo_ray.config.sections import ROLLOUT_SCHEDULES
from rapo_ray.engines.base import GenerationResult, InferenceEngine
from rapo_ray.envs.suite import task_splits
from rapo_ray.pipelines.expert import ScriptedExpertEngine
from rapo_ray.types import protocol
from rapo_ray.types.trajectory import GENERATED, RETRIEVED, TOOL_RESULT, Task
from tests.helpers import settings

SCHEDULES = pytest.mark.parametrize("schedule", ["lockstep", "per_trajectory"])


class ScriptEngine(InferenceEngine):
    """Emits pre-written steps (text) in order, recording every id it produced (one trajectory per engine)."""

    name = "script"

    def __init__(self, tok, steps_by_prompt):
        super().__init__()
        self.tok, self.steps, self.produced = tok, steps_by_prompt, []
        self.calls = {}

    def load_weights(self, sd, v):
        self.version = v

    def generate(self, prompts, params):
        out = []
        for _p, sp in zip(prompts, self._per_prompt(params, len(prompts))):
            n = self.calls.get("n", 0)
            self.calls["n"] = n + 1
            text = self.steps[n] if n < len(self.steps) else protocol.EOS
            ids = self.tok(text, add_special_tokens=False)["input_ids"][: sp.max_new_tokens]
            self.produced.append(ids)
            out.append(GenerationResult(ids, [-0.5] * len(ids), [1.0] * len(ids), "stop", None))
        return out


def _store(tok, n=5):
    return [
        StoredStep(
            key=f"question {i} history",
            value=f"<think>hint {i}</think><search>h{i}</search><result>r{i}</result>",
            value_ids=tok(
                f"<think>hint {i}</think><search>h{i}</search><result>r{i}</result>", add_special_tokens=False
            )["input_ids"],
            question_id=f"src{i}",
        )
        for i in range(n)
    ]


class RandomEngine(InferenceEngine):
    name = "random"

    def __init__(self, vocab, seed):
        super().__init__()
        self.vocab, self.rng = vocab, random.Random(seed)

    def load_weights(self, sd, v):
        pass

    def generate(self, prompts, params):
        out = []
        for sp in self._per_prompt(params, len(prompts)):
            ids = []
            for _ in range(self.rng.randint(0, sp.max_new_tokens)):
                ids.append(self.rng.randrange(self.vocab))
                if ids[-1] in sp.stop_token_ids:
                    break
            out.append(GenerationResult(ids, [0.0] * len(ids), [0.0] * len(ids), "stop", None))
        return out


@pytest.mark.parametrize(
    "step, expected",
    [
        ("<think>a</think><python></python>", "Error: empty code"),
        ("<think>a</think>print(1)</python>", "Error: </python> without <python>"),
        ("<think>a</think><search>x print(1)</python>", "Error: </python> closes <search> (mismatched tags)"),
        ("<think>a</think><search>a<python>b</search>", "Error: nested tag <python> inside <search>"),
    ],
)
def test_malformed_calls_become_error_results(tiny_tokenizer, tools, step, expected):
    eng = ScriptEngine(tiny_tokenizer, [step, "<think>b</think><answer>\\boxed{1}</answer>"])
    loop = AgentLoop(eng, tiny_tokenizer, tools, settings())
    (t,), _ = loop.run_groups([Task("q", "Who?", ("1",))], 1)
    results = [tiny_tokenizer.decode(ids, skip_special_tokens=False) for ids in t.segment_ids(TOOL_RESULT)]
    assert results == [f"<result>{expected}</result>"]
    assert t.finish_reason == "answer" and t.tool_errors == 1


def test_unclosed_tag_and_unknown_tag_end_cleanly(tiny_tokenizer, tools):
    for step in ["<think>a</think><python>print(1)", "<think>a</think><calc>1+1</calc>"]:
        eng = ScriptEngine(tiny_tokenizer, [step])
        loop = AgentLoop(eng, tiny_tokenizer, tools, settings())
        (t,), _ = loop.run_groups([Task("q", "Who?", ("1",))], 1)
        assert t.finished and t.reward == -1.0 and t.tool_calls == 0


def test_tool_call_limit_and_budget(tiny_tokenizer, tools):
    steps = ["<think>a</think><python>print(1)</python>"] * 10
    loop = AgentLoop(ScriptEngine(tiny_tokenizer, steps), tiny_tokenizer, tools, settings(max_tool_calls=2))
    (t,), _ = loop.run_groups([Task("q", "Who?", ("1",))], 1)
    assert t.tool_calls == 2 and t.finish_reason == "tool_limit"
    loop = AgentLoop(
        ScriptEngine(tiny_tokenizer, steps), tiny_tokenizer, tools, settings(max_tool_calls=9, max_response_tokens=40)
    )
    (t,), _ = loop.run_groups([Task("q", "Who?", ("1",))], 1)
    assert len(t.response_ids) <= 40 and t.finish_reason == "length"


def test_token_in_token_out(tiny_tokenizer, tools):
    steps = ["<think>a</think><python>print(6*7)</python>", "<think>b</think><answer>\\boxed{42}</answer>"]
    eng = ScriptEngine(tiny_tokenizer, steps)
    loop = AgentLoop(eng, tiny_tokenizer, tools, settings())
    (t,), _ = loop.run_groups([Task("q", "What is 6*7?", ("42",), "math")], 1)
    assert t.segment_ids(GENERATED) == eng.produced  # exactly what the engine produced
    res = tiny_tokenizer("<result>42</result>", add_special_tokens=False)["input_ids"]
    assert t.segment_ids(TOOL_RESULT) == [res]
    assert t.response_ids.tolist() == eng.produced[0] + res + eng.produced[1]
    assert t.loss_mask.tolist() == [1] * len(eng.produced[0]) + [0] * len(res) + [1] * len(eng.produced[1])
    assert t.correct and t.reward == 1.0 and t.logprobs[len(eng.produced[0])] == 0.0


def test_in_memory_retriever_question_scopes(tiny_tokenizer):
    store = _store(tiny_tokenizer)
    query = ["question 2 history"]  # nearest stored key: src2's
    assert InMemoryStepRetriever(store).retrieve(query, ["src2"])[0].question_id == "src2"
    assert InMemoryStepRetriever(store, question_scope="other").retrieve(query, ["src2"])[0].question_id != "src2"
    assert InMemoryStepRetriever(store, question_scope="own").retrieve(query, ["src4"])[0].question_id == "src4"
    assert InMemoryStepRetriever(store, question_scope="own").retrieve(query, ["unknown"]) == [None]
    with pytest.raises(ValueError, match="valid: any, other, own"):
        InMemoryStepRetriever(store, question_scope="mine").retrieve(query, ["src2"])
    with pytest.raises(ValueError, match="1 question ids for 2 queries"):
        InMemoryStepRetriever(store, question_scope="own").retrieve(query * 2, ["src2"])


@SCHEDULES
def test_hybrid_rollout_invariants(tiny_cfg, tiny_tokenizer, tools, schedule):
    _, test = task_splits(tiny_cfg.tasks)
    retriever = InMemoryStepRetriever(_store(tiny_tokenizer))
    loop = AgentLoop(
        ScriptedExpertEngine(tiny_tokenizer),
        tiny_tokenizer,
        tools,
        settings(schedule=schedule),
        retriever=retriever,
        rollout=HybridRollout(n_hybrid=2, retrieve_prob=1.0),
    )
    trajs, _ = loop.run_groups(test["multihop"][:3], group_size=4)
    for t in trajs:
        kinds = [k for k, _, _ in t.segments]
        if t.slot < 2:
            assert t.slot_kind == "on_policy" and RETRIEVED not in kinds
            continue
        assert t.slot_kind == "hybrid" and t.num_retrievals >= 1 and t.correct
        assert kinds[0] == GENERATED  # never at step 0
        for a, b in zip(kinds, kinds[1:]):
            if a == RETRIEVED:
                assert b == GENERATED  # always a policy step after a retrieval
        for r in t.retrievals:
            assert r.step_after == r.step_before + 1
        for k, s, e in t.segments:
            assert all(m == (1 if k == GENERATED else 0) for m in t.loss_mask[s:e])
        assert 0 < t.retrieved_fraction < 1


@SCHEDULES
def test_a_query_is_the_tail_of_question_and_history_that_the_config_names(tiny_cfg, tiny_tokenizer, tools, schedule):
    """Every retrieval query is the last ``query_max_chars`` characters of the question and the decoded history
    (the same text a stored key embeds), and the setting comes from ``retrieval.query_max_chars`` (it used to be
    fixed at 1,300 in the loop whatever the config said)."""
    from rapo_ray.config import load_config

    assert LoopSettings.from_config(load_config(overrides=["retrieval.query_max_chars=2000"])).query_max_chars == 2000

    class Recording(InMemoryStepRetriever):
        def retrieve(self, queries, question_ids=None):
            self.queries.extend(queries)
            return super().retrieve(queries, question_ids)

    recording = Recording(_store(tiny_tokenizer))
    recording.queries = []

    _, test = task_splits(tiny_cfg.tasks)
    tasks = test["multihop"][:2]
    loop = AgentLoop(
        ScriptedExpertEngine(tiny_tokenizer),
        tiny_tokenizer,
        tools,
        settings(schedule=schedule, query_max_chars=40),
        retriever=recording,
        rollout=HybridRollout(n_hybrid=1, retrieve_prob=1.0),
    )
    trajs, _ = loop.run_groups(tasks, group_size=2)
    assert recording.queries and all(len(q) == 40 for q in recording.queries)
    full = [
        t.question + tiny_tokenizer.decode(t.response_ids[:s].tolist(), skip_special_tokens=False)
        for t in trajs
        for k, s, _ in t.segments
        if k == RETRIEVED
    ]
    assert sorted(recording.queries) == sorted(f[-40:] for f in full)


def test_retrieved_text_earns_no_reward(tiny_tokenizer, tools):
    answer_leak = StoredStep(
        "k",
        "<think>the answer</think><answer>\\boxed{42}</answer>",
        tiny_tokenizer("<think>the answer</think><answer>\\boxed{42}</answer>", add_special_tokens=False)["input_ids"],
    )
    steps = ["<think>a</think><python>print(1)</python>", "<think>b</think>" + protocol.EOS]
    loop = AgentLoop(
        ScriptEngine(tiny_tokenizer, steps),
        tiny_tokenizer,
        tools,
        settings(),
        retriever=InMemoryStepRetriever([answer_leak]),
        rollout=HybridRollout(n_hybrid=1, retrieve_prob=1.0),
    )
    (t,), _ = loop.run_groups([Task("q", "Q?", ("42",), "math")], 1)
    assert t.num_retrievals == 1 and t.reward == -1.0 and not t.correct


def test_answer_handed_needs_the_answer_in_a_retrieved_step_and_in_no_own_tool_result():
    assert answer_handed("Gavefu", "<search>rival of Pamisi</search><result>Gavefu</result>", "<result>Hihive</result>")
    assert answer_handed("gavefu", "<result>Gavefu.</result>", "")  # any case, punctuation around it
    assert answer_handed("New York", "<result>new\n york</result>", "")  # whitespace runs match
    assert not answer_handed("Gavefu", "<result>Gavefu</result>", "<result>x, Gavefu</result>")  # found it itself
    assert not answer_handed("12", "<result>120</result>", "")  # whole words only
    assert not answer_handed("Gavefu", "<result>Hihive</result>", "")
    assert not answer_handed(" ", "<result> </result>", "")


@pytest.mark.parametrize("reward_retrieved_answers", [True, False])
def test_an_answer_from_a_retrieved_step_is_flagged_and_optionally_unpaid(
    tiny_tokenizer, tools, reward_retrieved_answers
):
    """algo.rapo.reward_retrieved_answers: the paper pays a correct answer whatever showed it; False pays 0 when only
    a retrieved step showed it. Either way the trajectory records that the answer was handed to it."""
    expert = "<think>last hop</think><search>rival of Pamisi</search><result>Gavefu</result>"
    step = StoredStep("k", expert, tiny_tokenizer(expert, add_special_tokens=False)["input_ids"])
    own = "<think>a</think><python>print(1)</python>"
    answer = "<think>b</think><answer>\\boxed{Gavefu}</answer>"
    loop = AgentLoop(
        ScriptEngine(tiny_tokenizer, [own, answer]),
        tiny_tokenizer,
        tools,
        settings(),
        retriever=InMemoryStepRetriever([step]),
        rollout=HybridRollout(n_hybrid=1, retrieve_prob=1.0, reward_retrieved_answers=reward_retrieved_answers),
    )
    (t,), _ = loop.run_groups([Task("q", "Who is the rival of Pamisi?", ("Gavefu",))], 1)
    assert t.num_retrievals == 1 and t.correct and t.answer_retrieved
    assert t.reward == (1.0 if reward_retrieved_answers else 0.0)
    # the same answer after its own call showed it: not handed, paid in full
    found = "<think>a</think><python>print('Gavefu')</python>"
    loop = AgentLoop(
        ScriptEngine(tiny_tokenizer, [found, answer]),
        tiny_tokenizer,
        tools,
        settings(),
        retriever=InMemoryStepRetriever([step]),
        rollout=HybridRollout(n_hybrid=1, retrieve_prob=1.0, reward_retrieved_answers=reward_retrieved_answers),
    )
    (t,), _ = loop.run_groups([Task("q", "Who is the rival of Pamisi?", ("Gavefu",))], 1)
    assert t.num_retrievals == 1 and t.correct and not t.answer_retrieved and t.reward == 1.0


def test_empty_buffer_falls_back_and_counts(tiny_cfg, tiny_tokenizer, tools):
    _, test = task_splits(tiny_cfg.tasks)
    loop = AgentLoop(
        ScriptedExpertEngine(tiny_tokenizer),
        tiny_tokenizer,
        tools,
        settings(),
        retriever=InMemoryStepRetriever([]),
        rollout=HybridRollout(n_hybrid=2, retrieve_prob=1.0),
    )
    trajs, _ = loop.run_groups(test["arith"][:2], group_size=2)
    assert all(t.num_retrievals == 0 and t.retrieval_fallbacks >= 1 and t.correct for t in trajs)


@pytest.mark.parametrize("schedule", ["lockstep", "per_trajectory"])
def test_a_failed_retrieval_degrades_the_slot_and_is_counted(tiny_cfg, tiny_tokenizer, tools, schedule):
    """The retrieval service failing (a dead replica, a timeout: ``RetrievalFailed``) costs only that retrieval:
    the slot takes a policy step instead, counted in ``retrieval_errors``; the rollout goes on (issue #22: the
    error used to escape the loop and the fleet replaced a healthy worker)."""
    from rapo_ray.core.errors import RetrievalFailed

    class DownRetriever:
        calls = 0

        def retrieve(self, queries, question_ids=None):
            DownRetriever.calls += 1
            raise RetrievalFailed("ActorDiedError: the replica died")

    _, test = task_splits(tiny_cfg.tasks)
    loop = AgentLoop(
        ScriptedExpertEngine(tiny_tokenizer),
        tiny_tokenizer,
        tools,
        settings(schedule=schedule),
        retriever=DownRetriever(),
        rollout=HybridRollout(n_hybrid=1, retrieve_prob=1.0),
    )
    trajs, _ = loop.run_groups(test["arith"][:2], group_size=2)
    hybrid = [t for t in trajs if t.slot_kind == "hybrid"]
    assert DownRetriever.calls >= 1 and all(t.finished and t.correct for t in trajs)
    assert all(t.num_retrievals == 0 and t.retrieval_errors >= 1 and t.retrieval_fallbacks == 0 for t in hybrid)
    assert sum(t.retrieval_errors for t in hybrid) == sum(t.num_generated_steps - 1 for t in hybrid)


def test_the_serve_retriever_turns_any_call_failure_into_retrieval_failed():
    from rapo_ray.core.errors import RetrievalFailed
    from rapo_ray.retrieval.client import HandleStepRetriever

    class Response:
        def __init__(self, exc):
            self.exc = exc

        def result(self, timeout_s=None):
            assert timeout_s == 2.5  # the configured timeout reaches the handle
            raise self.exc

    class Method:
        def __init__(self, exc):
            self.exc = exc

        def remote(self, *args):
            return Response(self.exc)

    for exc in (TimeoutError("no answer"), RuntimeError("ActorDiedError: the actor died unexpectedly")):
        handle = type("Handle", (), {"retrieve": Method(exc), "sample": Method(exc)})()
        retriever = HandleStepRetriever(handle, timeout_s=2.5)
        with pytest.raises(RetrievalFailed, match=type(exc).__name__):
            retriever.retrieve(["a history"])
        assert retriever.failures == 1


def test_a_rollout_worker_loads_serve_only_to_retrieve():
    """The worker module and the retrieval client import no Serve (nor its pandas and FastAPI): ~1.5 s and ~100 MB
    less per worker that retrieves nothing; a RAPO worker imports it when it gets its handle."""
    import subprocess
    import sys

    probe = "import sys, rapo_ray.workers.rollout; print(sorted(m for m in ('ray.serve', 'pandas', 'fastapi') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_fuzz_random_token_streams_never_crash(tiny_tokenizer, tools):
    tags = [tiny_tokenizer.convert_tokens_to_ids(t) for t in protocol.ALL_TAGS]
    retriever = InMemoryStepRetriever(_store(tiny_tokenizer))
    for seed in range(6):
        eng = RandomEngine(len(tiny_tokenizer), seed)
        eng.rng.choices = None
        loop = AgentLoop(
            eng,
            tiny_tokenizer,
            tools,
            settings(max_response_tokens=120, max_step_tokens=30),
            retriever=retriever,
            rollout=HybridRollout(n_hybrid=1, retrieve_prob=0.5),
        )
        tasks = [Task(f"q{i}", "What?", ("1",)) for i in range(4)]
        trajs, _ = loop.run_groups(tasks, group_size=2)
        for t in trajs:
            assert t.finished and len(t.response_ids) <= 120
            assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.token_entropies)
            pos = 0
            for _, s, e in t.segments:
                assert s == pos and e >= s
                pos = e
            assert pos == len(t.response_ids)
    assert tags  # the vocabulary contains the tags the fuzz can hit


def test_steps_of_excludes_answer_steps(tiny_cfg, tiny_tokenizer, tools):
    _, test = task_splits(tiny_cfg.tasks)
    loop = AgentLoop(ScriptedExpertEngine(tiny_tokenizer), tiny_tokenizer, tools, settings())
    (t,), _ = loop.run_groups(test["multihop"][:1], 1)
    steps = steps_of(tiny_tokenizer, t)
    assert len(steps) == t.tool_calls
    assert all("<answer>" not in s.value and s.value.endswith("</result>") for s in steps)
    assert steps[0].key == t.question and steps[1].key.startswith(t.question + "<think>")
    # the trainer's on-policy insertion splits the batch's trajectories the same way, tagged as on-policy
    on_policy = steps_of(tiny_tokenizer, t, source="on_policy")
    assert [(x.key, x.value, x.value_ids) for x in on_policy] == [(x.key, x.value, x.value_ids) for x in steps]
    assert {x.source for x in on_policy} == {"on_policy"} and {x.source for x in steps} == {"expert"}


@SCHEDULES
def test_arpo_branching_fills_group(tiny_cfg, tiny_tokenizer, tools, schedule):
    _, test = task_splits(tiny_cfg.tasks)
    always = BranchingRollout(initial=2, beam_size=2, tau=1.0, beta=0.0)  # always branch
    loop = AgentLoop(
        ScriptedExpertEngine(tiny_tokenizer), tiny_tokenizer, tools, settings(schedule=schedule), rollout=always
    )
    trajs, _ = loop.run_groups(test["multihop"][:2], group_size=5)
    for gid in {t.group_id for t in trajs}:
        group = [t for t in trajs if t.group_id == gid]
        assert len(group) == 5 and len({t.slot for t in group}) == 5
        branches = [t for t in group if t.slot_kind == "branch"]
        assert branches and all(
            np.array_equal(t.response_ids[: t.branch_point], group[t.parent].response_ids[: t.branch_point])
            for t in branches
        )


def test_each_configurable_schedule_name_runs_its_own_schedule():
    """rollout.schedule's choices (config) and the loop's table agree name by name, whatever their order."""
    assert set(agent_loop.SCHEDULES) == set(ROLLOUT_SCHEDULES)
    assert agent_loop.SCHEDULES["lockstep"] is run_lockstep
    assert agent_loop.SCHEDULES["per_trajectory"] is run_per_trajectory


def test_per_trajectory_schedule_overlaps_tool_calls_with_decoding(tiny_tokenizer, tools):
    """A trajectory whose tool call is slow does not hold the others: in the per-trajectory schedule the
    fast trajectory runs all its turns while the slow call is running; in lockstep it waits every turn."""
    slow = "<think>s</think><python>import time; time.sleep(1.5); print(7)</python>"
    fast = "<think>f</think><python>print(1)</python>"

    class TwoScripts(InferenceEngine):
        name = "two-scripts"

        def load_weights(self, sd, v):
            self.version = v

        def generate(self, prompts, params):
            out = []
            for ids, _sp in zip(prompts, self._per_prompt(params, len(prompts))):
                text = tiny_tokenizer.decode(ids, skip_special_tokens=False)
                done = text.count(protocol.RESULT[1])
                script = (
                    [slow, "<think>d</think><answer>\\boxed{7}</answer>"]
                    if "SLOW" in text
                    else [fast] * 3 + ["<think>d</think><answer>\\boxed{1}</answer>"]
                )
                step_ids = tiny_tokenizer(script[min(done, len(script) - 1)], add_special_tokens=False)["input_ids"]
                out.append(GenerationResult(step_ids, [0.0] * len(step_ids), [0.0] * len(step_ids), "stop", None))
            return out

    tasks_ = [Task("slow", "SLOW question", ("7",), "math"), Task("fast", "FAST question", ("1",), "math")]
    for schedule in ("per_trajectory", "lockstep"):
        events = []
        loop = AgentLoop(
            TwoScripts(),
            tiny_tokenizer,
            tools,
            settings(schedule=schedule),
            on_append=lambda t, kind, ids: events.append((t.problem_id, kind)),
        )
        trajs, stats = loop.run_groups(tasks_, 1)
        assert [t.correct for t in trajs] == [True, True] and [t.tool_calls for t in trajs] == [1, 3]
        slow_result = events.index(("slow", TOOL_RESULT))
        fast_last = len(events) - 1 - events[::-1].index(("fast", GENERATED))
        if schedule == "per_trajectory":
            assert fast_last < slow_result and stats.tool_s >= 1.5
        else:
            assert fast_last > slow_result


def test_per_trajectory_schedule_equals_lockstep_with_a_model(tiny_cfg, tiny_model_dir, tiny_tokenizer, tools):
    """Greedy trajectories of the torch engine are token for token the same under both schedules."""
    from rapo_ray.engines.torch_engine import TorchEngine
    from rapo_ray.model.factory import load_model

    _, test = task_splits(tiny_cfg.tasks)
    tasks_ = test["arith"][:3] + test["multihop"][:3]
    engine = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer)
    runs = {}
    for schedule in ("lockstep", "per_trajectory"):
        loop = AgentLoop(engine, tiny_tokenizer, tools, settings(schedule=schedule, max_response_tokens=160))
        runs[schedule] = loop.run_groups(tasks_, 2)[0]
    for a, b in zip(runs["lockstep"], runs["per_trajectory"]):
        assert (a.problem_id, a.slot) == (b.problem_id, b.slot)
        assert np.array_equal(a.response_ids, b.response_ids) and a.segments == b.segments and a.reward == b.reward
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-4


def test_context_window_bounds_prompt_plus_response(tiny_tokenizer, tools):
    """A prompt longer than the model's window ends at once (no engine call); otherwise the window caps steps."""
    steps = ["<think>a</think><python>print(1)</python>"] * 5
    eng = ScriptEngine(tiny_tokenizer, steps)
    loop = AgentLoop(eng, tiny_tokenizer, tools, settings(max_context=20, max_tool_calls=9))
    (t,), _ = loop.run_groups([Task("q", "word " * 50, ("1",))], 1)
    assert t.finish_reason == "length" and len(t.response_ids) == 0 and eng.calls.get("n", 0) == 0
    loop = AgentLoop(
        ScriptEngine(tiny_tokenizer, steps), tiny_tokenizer, tools, settings(max_context=80, max_tool_calls=9)
    )
    (t,), _ = loop.run_groups([Task("q", "Who?", ("1",))], 1)
    assert len(t.prompt_ids) + len(t.response_ids) < 80 and t.finish_reason == "length"


def test_paired_change_counts_flips_and_sign_test():
    from rapo_ray.agent.evaluation import paired_change

    before = {"a": True, "b": False, "c": False, "d": True, "e": False}
    after = {"a": True, "b": True, "c": True, "d": False, "e": True, "only-after": True}
    c = paired_change(before, after)
    # 3 fixed, 1 broken: p = 2 * (C(4,0) + C(4,1)) / 2^4 = 0.625
    assert c == {"n": 5, "fixed": 3, "broken": 1, "gain": 0.4, "p_value": 0.625}
    six = paired_change({str(i): False for i in range(6)}, {str(i): True for i in range(6)})
    assert six["p_value"] == 2 / 64 and six["gain"] == 1.0
    assert paired_change({"a": True}, {"a": True})["p_value"] == 1.0


def _chat_template_tokenizer():
    """A real checkpoint's kind of tokenizer, in small: byte-level BPE without the protocol's frame tokens, and a
    ChatML chat template (SmolLM2's frame)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["What is 2 + 3? <python>print(2 + 3)</python><answer>\\boxed{5}</answer> system user assistant"] * 20
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


def test_a_chat_template_tokenizer_gives_the_prompt_token_ids():
    """A real checkpoint's tokenizer (no protocol frame tokens, a chat template): transformers 5's
    ``apply_chat_template(tokenize=True)`` returns a ``BatchEncoding`` by default, and ``list()`` of it was its keys
    ('input_ids', 'attention_mask'), which crashed the first rollout of every real model (issue #37)."""
    tok = _chat_template_tokenizer()
    loop = AgentLoop(None, tok, None, settings(system_prompt="Use the tools."))
    ids = loop.prompt_ids("What is 2 + 3?")
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == (
        "<|im_start|>system\nUse the tools.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    asked = loop.messages_prompt_ids([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    assert tok.decode(asked).startswith("<|im_start|>system\nS<|im_end|>") and all(isinstance(i, int) for i in asked)


def test_the_scripted_expert_reads_the_question_under_a_chat_template(tiny_tokenizer):
    """The expert finds the question between the template's markers: under a real model's chat template it used to
    look for the bundled frame's ``<|user|>``, read no question and answer "unknown" to everything, so
    ``retrieval.buffer_source=scripted-expert`` with a real model built an empty buffer."""
    from rapo_ray.core.errors import ModelLoadError
    from rapo_ray.types.protocol import question_frame

    tok = _chat_template_tokenizer()
    assert question_frame(tok) == ("<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    question = "Ava has 537 coins. Ava buys 12 boxes of 45 coins. How many coins does Ava have now?"
    prompt = tok.decode(AgentLoop(None, tok, None, settings(system_prompt="Use the tools.")).prompt_ids(question))
    expert = ScriptedExpertEngine(tok)
    assert expert.next_step(prompt) == "<think>compute 537 + 12 * 45</think><python>print(537 + 12 * 45)</python>"
    # after its call's result it answers from that result
    step = expert.next_step(prompt + "<think>compute 537 + 12 * 45</think><python>print(537 + 12 * 45)</python>"
                            "<result>1077</result>")  # fmt: skip
    assert step.endswith("<answer>\\boxed{1077}</answer>")
    # the bundled model's frame is read as before
    assert question_frame(tiny_tokenizer) == ("<|user|>", "<|assistant|>")
    # a template that drops the system message is named, not misread
    tok.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(ModelLoadError, match="does not render a system message followed by the user's message"):
        question_frame(tok)
