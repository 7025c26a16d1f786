"""The agent environment: tasks, expert, tools, rewards, loaders and the multi-turn loop."""

import json
import os
import random
import re
from pathlib import Path

import pytest

from rapo_ray.agent import protocol
from rapo_ray.agent.loop import AgentLoop, LoopSettings, answer_handed
from rapo_ray.agent.retriever import InMemoryStepRetriever, StoredStep, steps_of
from rapo_ray.agent.trajectory import Task
from rapo_ray.algos.entropy import GENERATED, RETRIEVED, TOOL_RESULT
from rapo_ray.engines.base import GenerationResult, InferenceEngine
from rapo_ray.engines.expert import ScriptedExpertEngine
from rapo_ray.envs import tasks as bundled
from rapo_ray.envs.loaders import DataError, gsm8k_to_trajectory_text, load_examples
from rapo_ray.envs.rewards import format_ok, math_equal, score, token_f1
from rapo_ray.envs.suite import build_tools, task_difficulty, task_splits, to_task
from rapo_ray.envs.tools import LexicalIndex, PythonSandbox, SandboxLimits
from rapo_ray.retrieval.search_index import search_index_for

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data not present")


@pytest.fixture(scope="module")
def tools(tiny_cfg):
    ts = build_tools(tiny_cfg.tasks, tiny_cfg.rollout, search_index_for(tiny_cfg.tasks))
    yield ts
    ts.close()


def settings(**kw):
    s = LoopSettings(
        temperature=0.0,
        max_response_tokens=400,
        max_step_tokens=64,
        max_tool_calls=3,
        seed=0,
        system_prompt=protocol.SHORT_SYSTEM_PROMPT,
    )
    for k, v in kw.items():
        setattr(s, k, v)
    return s


# ---------------------------------------------------------------- tasks + expert


def test_splits_disjoint_and_seeded():
    for fam in bundled.TASK_FAMILIES:
        tr = bundled.generate(fam, "train", 400, 3)
        te = bundled.generate(fam, "test", 100, 3)
        assert not {p.question for p in tr} & {p.question for p in te}
        assert [p.question for p in bundled.generate(fam, "test", 100, 3)] == [p.question for p in te]
    with pytest.raises(ValueError, match="valid: \\['alias', 'arith', 'multihop'\\]"):
        bundled.generate("chess", "train", 1, 0)


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


def test_alias_family_asks_in_words_the_corpus_never_uses(tiny_cfg, tiny_tokenizer, tools):
    """The exploration family: questions use alias words only; the expert searches the corpus relation and
    solves every one, while a search with the question's own word never ranks the right fact first."""
    world = bundled.make_world(tiny_cfg.tasks.seed)
    corpus_words = {w.lower() for d in world.documents() for w in d.rstrip(".").split()}
    probs = bundled.generate("alias", "test", 50, tiny_cfg.tasks.seed)
    index, naive_first_hits = LexicalIndex(world.documents()), 0
    for p in probs:
        words = re.findall(r"the (\w+) of", p.question)
        assert words and set(words) <= set(bundled.ALIASES) and not set(words) & corpus_words, p.question
        start = p.question.rstrip("?").rsplit(" of ", 1)[-1]
        rel = bundled.ALIASES[words[-1]]
        naive_first_hits += (
            index.search(f"{words[-1]} of {start}", 3)[0][0] == f"The {rel} of {start} is {world.facts[(rel, start)]}."
        )
    assert naive_first_hits == 0  # ties break in document order: a mentor fact comes first
    loop = AgentLoop(ScriptedExpertEngine(tiny_tokenizer), tiny_tokenizer, tools, settings())
    trajs, _ = loop.run_groups([to_task(p) for p in probs], 1)
    assert all(t.correct and t.format_ok for t in trajs)
    first = re.search(r"<search>(\w+) of", tiny_tokenizer.decode(trajs[0].response_ids)).group(1)
    assert first == bundled.ALIASES[re.findall(r"the (\w+) of", probs[0].question)[-1]]


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
    from rapo_ray.sft import expert_trajectories

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


# ---------------------------------------------------------------- tools


def test_lexical_search_ranks_exact_fact_first(tiny_cfg):
    world = bundled.make_world(tiny_cfg.tasks.seed)
    idx = LexicalIndex(world.documents())
    (rel, ent), obj = next(iter(sorted(world.facts.items())))
    hits = idx.search(f"{rel} of {ent}", 3)
    assert len(hits) == 3 and hits[0][0] == f"The {rel} of {ent} is {obj}."


def test_lexical_search_is_the_same_in_every_process(tiny_cfg):
    """Rollout workers are separate processes with their own string-hash seeds; a query with tied documents
    ("rival of neighbor of X" matches many facts equally) must still get one answer everywhere."""
    import subprocess
    import sys

    code = (
        "from rapo_ray.envs import tasks as b\nfrom rapo_ray.envs.tools import LexicalIndex\n"
        f"idx = LexicalIndex(b.make_world({tiny_cfg.tasks.seed}).documents())\n"
        "print([d for d, _ in idx.search('rival of neighbor of Losi', 3)])\n"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in range(6)
    }
    assert len(outs) == 1, outs


HOSTILE = {
    "infinite loop": "while True: pass",
    "fork bomb": "import os\nwhile True: os.fork()",
    "10 GB allocation": "x = bytearray(10 * 1024**3)",
    "socket": "import socket\ns = socket.create_connection(('127.0.0.1', 9))",
    "write outside": "open('/tmp/rapo_sandbox_escape.txt', 'w').write('x')",
    "100 MB output": "import sys\nfor _ in range(100): sys.stdout.write('x' * (1 << 20))",
    "subprocess": "import subprocess; subprocess.run(['touch', '/tmp/rapo_sandbox_escape2'])",
}


@pytest.mark.parametrize("mode", PythonSandbox.MODES)
def test_sandbox_contains_hostile_programs(mode):
    sb = PythonSandbox(SandboxLimits(timeout_s=2.0, cpu_s=2, output_chars=200), max_concurrency=4, mode=mode)
    try:
        futures = {name: sb.submit(code) for name, code in HOSTILE.items()}
        benign = [sb.submit(f"print({i} * 7)") for i in range(6)]
        for name, fut in futures.items():
            res = fut.result(timeout=30)
            assert not res.ok and res.text.startswith("Error"), (name, res.text)
            assert res.elapsed_s < 5.0, name
            assert len(res.text) <= 200 + len("...(truncated)") + 40
        assert [f.result().text for f in benign] == [str(i * 7) for i in range(6)]
        assert not Path("/tmp/rapo_sandbox_escape.txt").exists() and not Path("/tmp/rapo_sandbox_escape2").exists()
        assert sb.run("print('still alive')").text == "still alive"
    finally:
        sb.close()


@pytest.mark.parametrize("mode", PythonSandbox.MODES)
def test_sandbox_private_dir_and_errors(mode):
    sb = PythonSandbox(max_concurrency=1, mode=mode)
    assert sb.run("open('a.txt','w').write('hi')\nprint(open('a.txt').read())").text == "hi"
    assert sb.run("print(open('a.txt').read())").text.startswith(
        "Error: FileNotFoundError"
    )  # a fresh directory per call
    assert sb.run("x = 5").text == "" and "NameError" in sb.run("print(x)").text  # no state carried between calls
    assert sb.run("   ").text == "Error: empty code"
    assert "ZeroDivisionError" in sb.run("1/0").text
    assert "SyntaxError" in sb.run("def (").text
    assert sb.run("import sys; print('bye'); sys.exit(3)").text == "Error: exit code 3"
    with pytest.raises(ValueError, match="valid: fork_server, subprocess"):
        PythonSandbox(mode="docker")
    sb.close()


def test_sandbox_fork_server_replaced_after_it_dies():
    """A server that died while idle is replaced before the call; one that fails a call is discarded and
    that call (only) gets an error result."""
    import os
    import signal

    sb = PythonSandbox(max_concurrency=1)
    try:
        assert sb.run("print(1)").text == "1"
        (server,) = sb._servers
        os.killpg(server.proc.pid, signal.SIGKILL)  # the server dies between calls
        server.proc.wait()
        assert sb.run("print(2)").text == "2" and sb._servers and sb._servers[0] is not server
        (server,) = sb._servers
        server.call = lambda code, timeout_s: (_ for _ in ()).throw(RuntimeError("did not answer"))  # hangs mid-call
        res = sb.run("print(3)")
        assert not res.ok and res.text == "Error: sandbox failure: RuntimeError: did not answer" and not sb._servers
        assert sb.run("print(4)").text == "4"
    finally:
        sb.close()


@needs_shared
def test_python_tool_reproduces_gsm8k_annotations():
    sb = PythonSandbox(max_concurrency=2)
    rows = [json.loads(x) for x in open(SHARED / "gsm8k_openai" / "train.jsonl")][:40]
    total = ok = 0
    for r in rows:
        _, matches = gsm8k_to_trajectory_text(r["answer"], r["answer"].rsplit("####", 1)[1].strip(), sb.run)
        total, ok = total + len(matches), ok + sum(matches)
    sb.close()
    assert total > 80 and ok / total >= 0.99


# ---------------------------------------------------------------- rewards


def test_rewards_hand_cases():
    good = "<think>x</think><answer>\\boxed{Paris}</answer>"
    assert score(good, ["paris"]).reward == 1.0
    assert score("<think>x</think><answer>\\boxed{London}</answer>", ["paris"]).reward == 0.0
    assert score("<answer>\\boxed{Paris}", ["paris"]).reward == -1.0  # unclosed answer
    assert score("<think><python>x</python></think><answer>\\boxed{Paris}</answer>", ["paris"]).reward == -1.0  # nested
    assert score("<think>x</think><answer>Paris</answer>", ["paris"]).reward == -1.0  # no boxed
    assert token_f1("the Eiffel tower", ["Eiffel Tower Paris"]) == pytest.approx(0.8)
    assert math_equal("\\frac{1}{2}", "0.5") and math_equal("1,234", "1234") and math_equal("\\boxed{12}", "12.0")
    assert math_equal("\\text{18 dollars}", "18") is False and math_equal("$18", "18")
    ok, why = format_ok("<retrieve>x</retrieve><answer>\\boxed{1}</answer>")
    assert not ok and "retrieve" in why


@needs_shared
@pytest.mark.parametrize("name", ["gsm8k", "hotpotqa", "bamboogle"])
def test_gold_answers_score_one(name):
    examples, _ = load_examples(SHARED / "eval" / name / "test.jsonl")
    for e in examples:
        assert score(f"<think>t</think><answer>\\boxed{{{e.answers[0]}}}</answer>", e.answers, e.kind).reward == 1.0, e
        assert score("<think>t</think><answer>\\boxed{zq 98765 xw}</answer>", e.answers, e.kind).reward == 0.0, e


# ---------------------------------------------------------------- loaders


@needs_shared
def test_loaders_normalise_every_shared_file():
    for path in sorted((SHARED / "eval").glob("*/test.jsonl")):
        ex, rep = load_examples(path)
        assert ex and rep.skipped == 0 and all(e.question and e.answers for e in ex), path
    ex, rep = load_examples(SHARED / "toolstar" / "valid.parquet")
    assert len(ex) == 180 and {e.kind for e in ex} <= {"math", "qa"}


def test_loader_errors_name_file_row_field(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(
        '{"question": "q1", "answer": "a"}\n{"problem": "q2"}\n{not json\n{"Question": "q4", "answer": ["x", "y"]}\n'
    )
    with pytest.raises(DataError, match=r"bad.jsonl: row 1: no answer field"):
        load_examples(f)
    ex, rep = load_examples(f, skip_bad_rows=True)
    assert [e.question for e in ex] == ["q1", "q4"] and rep.skipped == 2
    assert any("invalid JSON" in e for e in rep.errors)
    with pytest.raises(DataError, match="does not exist"):
        load_examples(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        load_examples(tmp_path / "x.csv")


# ---------------------------------------------------------------- the loop


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
    assert t.response_ids == eng.produced[0] + res + eng.produced[1]
    assert t.loss_mask == [1] * len(eng.produced[0]) + [0] * len(res) + [1] * len(eng.produced[1])
    assert t.correct and t.reward == 1.0 and t.logprobs[len(eng.produced[0])] == 0.0


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
        settings(retrieve_prob=1.0, schedule=schedule),
        retriever=retriever,
    )
    trajs, _ = loop.run_groups(test["multihop"][:3], group_size=4, n_hybrid=2)
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
        settings(retrieve_prob=1.0, schedule=schedule, query_max_chars=40),
        retriever=recording,
    )
    trajs, _ = loop.run_groups(tasks, group_size=2, n_hybrid=1)
    assert recording.queries and all(len(q) == 40 for q in recording.queries)
    full = [
        t.question + tiny_tokenizer.decode(t.response_ids[:s], skip_special_tokens=False)
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
        settings(retrieve_prob=1.0),
        retriever=InMemoryStepRetriever([answer_leak]),
    )
    (t,), _ = loop.run_groups([Task("q", "Q?", ("42",), "math")], 1, n_hybrid=1)
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
        settings(retrieve_prob=1.0, reward_retrieved_answers=reward_retrieved_answers),
        retriever=InMemoryStepRetriever([step]),
    )
    (t,), _ = loop.run_groups([Task("q", "Who is the rival of Pamisi?", ("Gavefu",))], 1, n_hybrid=1)
    assert t.num_retrievals == 1 and t.correct and t.answer_retrieved
    assert t.reward == (1.0 if reward_retrieved_answers else 0.0)
    # the same answer after its own call showed it: not handed, paid in full
    found = "<think>a</think><python>print('Gavefu')</python>"
    loop = AgentLoop(
        ScriptEngine(tiny_tokenizer, [found, answer]),
        tiny_tokenizer,
        tools,
        settings(retrieve_prob=1.0, reward_retrieved_answers=reward_retrieved_answers),
        retriever=InMemoryStepRetriever([step]),
    )
    (t,), _ = loop.run_groups([Task("q", "Who is the rival of Pamisi?", ("Gavefu",))], 1, n_hybrid=1)
    assert t.num_retrievals == 1 and t.correct and not t.answer_retrieved and t.reward == 1.0


def test_empty_buffer_falls_back_and_counts(tiny_cfg, tiny_tokenizer, tools):
    _, test = task_splits(tiny_cfg.tasks)
    loop = AgentLoop(
        ScriptedExpertEngine(tiny_tokenizer),
        tiny_tokenizer,
        tools,
        settings(retrieve_prob=1.0),
        retriever=InMemoryStepRetriever([]),
    )
    trajs, _ = loop.run_groups(test["arith"][:2], group_size=2, n_hybrid=2)
    assert all(t.num_retrievals == 0 and t.retrieval_fallbacks >= 1 and t.correct for t in trajs)


@pytest.mark.parametrize("schedule", ["lockstep", "per_trajectory"])
def test_a_failed_retrieval_degrades_the_slot_and_is_counted(tiny_cfg, tiny_tokenizer, tools, schedule):
    """The retrieval service failing (a dead replica, a timeout: ``RetrievalFailed``) costs only that retrieval:
    the slot takes a policy step instead, counted in ``retrieval_errors``; the rollout goes on (issue #22: the
    error used to escape the loop and the fleet replaced a healthy worker)."""
    from rapo_ray.agent.retriever import RetrievalFailed

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
        settings(retrieve_prob=1.0, schedule=schedule),
        retriever=DownRetriever(),
    )
    trajs, _ = loop.run_groups(test["arith"][:2], group_size=2, n_hybrid=1)
    hybrid = [t for t in trajs if t.slot_kind == "hybrid"]
    assert DownRetriever.calls >= 1 and all(t.finished and t.correct for t in trajs)
    assert all(t.num_retrievals == 0 and t.retrieval_errors >= 1 and t.retrieval_fallbacks == 0 for t in hybrid)
    assert sum(t.retrieval_errors for t in hybrid) == sum(t.num_generated_steps - 1 for t in hybrid)


def test_the_serve_retriever_turns_any_call_failure_into_retrieval_failed():
    from rapo_ray.agent.retriever import RetrievalFailed
    from rapo_ray.retrieval.service import HandleStepRetriever

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
            settings(retrieve_prob=0.5, max_response_tokens=120, max_step_tokens=30),
            retriever=retriever,
        )
        tasks = [Task(f"q{i}", "What?", ("1",)) for i in range(4)]
        trajs, _ = loop.run_groups(tasks, group_size=2, n_hybrid=1)
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
    s = settings(arpo_initial=2, arpo_beam_size=2, arpo_tau=1.0, arpo_beta=0.0, schedule=schedule)  # always branch
    loop = AgentLoop(ScriptedExpertEngine(tiny_tokenizer), tiny_tokenizer, tools, s)
    trajs, _ = loop.run_groups(test["multihop"][:2], group_size=5)
    for gid in {t.group_id for t in trajs}:
        group = [t for t in trajs if t.group_id == gid]
        assert len(group) == 5 and len({t.slot for t in group}) == 5
        branches = [t for t in group if t.slot_kind == "branch"]
        assert branches and all(
            t.response_ids[: t.branch_point] == group[t.parent].response_ids[: t.branch_point] for t in branches
        )


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
    from rapo_ray.model import load_model

    _, test = task_splits(tiny_cfg.tasks)
    tasks_ = test["arith"][:3] + test["multihop"][:3]
    engine = TorchEngine(load_model(tiny_model_dir), tiny_tokenizer)
    runs = {}
    for schedule in ("lockstep", "per_trajectory"):
        loop = AgentLoop(engine, tiny_tokenizer, tools, settings(schedule=schedule, max_response_tokens=160))
        runs[schedule] = loop.run_groups(tasks_, 2)[0]
    for a, b in zip(runs["lockstep"], runs["per_trajectory"]):
        assert (a.problem_id, a.slot) == (b.problem_id, b.slot)
        assert a.response_ids == b.response_ids and a.segments == b.segments and a.reward == b.reward
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-4


def test_context_window_bounds_prompt_plus_response(tiny_tokenizer, tools):
    """A prompt longer than the model's window ends at once (no engine call); otherwise the window caps steps."""
    steps = ["<think>a</think><python>print(1)</python>"] * 5
    eng = ScriptEngine(tiny_tokenizer, steps)
    loop = AgentLoop(eng, tiny_tokenizer, tools, settings(max_context=20, max_tool_calls=9))
    (t,), _ = loop.run_groups([Task("q", "word " * 50, ("1",))], 1)
    assert t.finish_reason == "length" and t.response_ids == [] and eng.calls.get("n", 0) == 0
    loop = AgentLoop(
        ScriptEngine(tiny_tokenizer, steps), tiny_tokenizer, tools, settings(max_context=80, max_tool_calls=9)
    )
    (t,), _ = loop.run_groups([Task("q", "Who?", ("1",))], 1)
    assert len(t.prompt_ids) + len(t.response_ids) < 80 and t.finish_reason == "length"


def test_a_failed_buffer_insertion_is_counted_and_the_step_goes_on(tiny_cfg, tiny_tokenizer, tools, monkeypatch):
    """``retrieval.insert_on_policy``: the Serve insert failing (a dead replica, a timeout) used to end the step;
    now ``Trainer._insert_on_policy`` returns -1 (``insert_errors`` in the step's metrics) and the step goes on."""
    from types import SimpleNamespace

    from ray import serve

    from rapo_ray.batch import TrajectoryBatch
    from rapo_ray.trainer import Trainer

    _, test = task_splits(tiny_cfg.tasks)
    loop = AgentLoop(ScriptedExpertEngine(tiny_tokenizer), tiny_tokenizer, tools, settings())
    trajs, _ = loop.run_groups(test["arith"][:2], group_size=2)
    assert all(t.correct for t in trajs)
    sent, timeouts = [], []

    class Insert:
        def __init__(self, fail):
            self.fail = fail

        def remote(self, steps):
            sent.append(len(steps))
            return self

        def result(self, timeout_s=None):
            timeouts.append(timeout_s)
            if self.fail:
                raise TimeoutError("the replica did not answer")
            return sent[-1]

    trainer = SimpleNamespace(cfg=tiny_cfg, tok=tiny_tokenizer, retrieval_app="retrieval", step_idx=3)
    for fail, expected in ((False, None), (True, -1)):
        monkeypatch.setattr(
            serve, "get_deployment_handle", lambda *a, fail=fail, **k: SimpleNamespace(insert=Insert(fail))
        )
        got = Trainer._insert_on_policy(trainer, TrajectoryBatch(trajs))
        assert got == (sent[-1] if expected is None else expected) and sent[-1] > 0
    assert timeouts == [tiny_cfg.retrieval.timeout_s] * 2
