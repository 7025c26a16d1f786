"""The multi-turn tool agent loop with hybrid-policy rollout (spec Algorithm 1) and ARPO branching.

Two schedules run the same turns. ``lockstep``: all live trajectories advance together, one batched
``engine.generate`` per turn, the turn's tool calls concurrently, its retrievals in one batch.
``per_trajectory``: every trajectory is its own request stream (``engine.submit``); the moment its tool
result (or retrieved step) is in, its next step joins the engine's running batch, so tool calls overlap
decoding instead of every trajectory waiting for the slowest of the turn. One turn of one trajectory:

  1. hybrid slot, at least one policy step done, draw u < p  ->  append <retrieve>value</retrieve> (mask 0)
  2. generate a policy step until a closing tool tag, </answer>, EOS, or the step/response budget
  3. closing tool tag -> parse the call, run the tool, append <result>...</result> (mask 0)
  4. </answer>, EOS, budget, or tool-call limit -> the trajectory ends

A retrieval is always followed by a policy step (step 2 runs in the same turn), so two retrievals are never
adjacent, and the first step is never retrieved.
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from rapo_ray.agent.retriever import StepRetriever, query_text
from rapo_ray.algos.arpo import BranchBudget, EntropyBrancher, normalized_segment_entropy
from rapo_ray.algos.entropy import GENERATED, RETRIEVED, TOOL_RESULT
from rapo_ray.algos.registry import get_algorithm
from rapo_ray.core.errors import RetrievalFailed
from rapo_ray.engines.base import InferenceEngine, SamplingParams
from rapo_ray.types import protocol
from rapo_ray.types.environment import Environment, ToolResult
from rapo_ray.types.trajectory import HYBRID, ON_POLICY, Retrieval, Task, Trajectory

_TOOL_TAGS = {protocol.PYTHON[1]: "python", protocol.SEARCH[1]: "search"}
_OPEN_TAGS = {"python": protocol.PYTHON[0], "search": protocol.SEARCH[0]}


@dataclass
class LoopSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_tokens: int = 256
    max_step_tokens: int = 96
    max_tool_calls: int = 3
    retrieve_prob: float = 0.5
    query_max_chars: int = 1300  # retrieval.query_max_chars: the tail of question + history a query sends
    tool_bonus: float = 0.0
    # RAPO option (algo.rapo.reward_retrieved_answers): False zeroes the reward of a handed answer (``answer_handed``)
    reward_retrieved_answers: bool = True
    max_context: int = 0  # the model's window: prompt + response never exceed it (0: no limit known)
    seed: int | None = None
    schedule: str = "lockstep"  # "lockstep" | "per_trajectory" (see the module docstring)
    # ARPO
    arpo_initial: int | None = None  # None: no branching
    arpo_beam_size: int = 2
    arpo_tau: float = 0.5
    arpo_beta: float = 0.2
    arpo_entropy_tokens: int = 20
    system_prompt: str = protocol.SYSTEM_PROMPT

    @classmethod
    def from_config(cls, cfg, evaluation: bool = False) -> "LoopSettings":
        """Settings of a run (``Config``); ``evaluation``: greedy, no retrieval, no branching."""
        rollout_cfg, algo_cfg = cfg.rollout, cfg.algo
        s = cls(
            temperature=0.0 if evaluation else rollout_cfg.temperature,
            top_p=1.0 if evaluation else rollout_cfg.top_p,
            max_response_tokens=rollout_cfg.max_response_tokens,
            max_step_tokens=rollout_cfg.max_step_tokens,
            max_tool_calls=rollout_cfg.max_tool_calls,
            system_prompt=protocol.system_prompt_for(cfg.tasks.system_prompt, bundled=not cfg.model.path),
            schedule=rollout_cfg.schedule,
            query_max_chars=cfg.retrieval.query_max_chars,
        )
        if not evaluation:  # the algorithm's own rollout settings (RAPO's retrieval probability, ARPO's branching)
            s = replace(s, **get_algorithm(algo_cfg.name).rollout_settings(algo_cfg))
        return s


@dataclass
class RolloutStats:
    """Lockstep: wall time of each phase. Per-trajectory (phases overlap): ``generate_s`` is the wall time
    with at least one generation in flight, ``tool_s`` and ``retrieve_s`` are summed over calls."""

    generate_s: float = 0.0
    tool_s: float = 0.0
    retrieve_s: float = 0.0
    turns: int = 0
    engine_calls: int = 0


class AgentLoop:
    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer,
        tools: Environment,
        settings: LoopSettings,
        retriever: StepRetriever | None = None,
        on_append: Callable[[Trajectory, str, list[int]], None] | None = None,
    ):
        self.engine, self.tok, self.tools, self.s = engine, tokenizer, tools, settings
        self.retriever = retriever
        self.on_append = on_append  # called after every segment (generated / tool_result / retrieved): streaming
        self.system_prompt = settings.system_prompt
        self.rng = random.Random(settings.seed)
        self.eos_id = tokenizer.eos_token_id
        # Stop on closing tool tags and </answer>: by token id where the tag is one token (the bundled
        # tokenizer), by string otherwise (real checkpoints).
        self.stop_ids, self.stop_strings = [], []
        for tag in list(_TOOL_TAGS) + [protocol.ANSWER[1]]:
            ids = self._encode(tag)
            (self.stop_ids.append(ids[0]) if len(ids) == 1 else self.stop_strings.append(tag))
        self.retrieve_open = self._encode(protocol.RETRIEVE[0])
        self.retrieve_close = self._encode(protocol.RETRIEVE[1])

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, question: str) -> list[int]:
        if getattr(self.tok, "chat_template", None) and protocol.ASSISTANT not in self.tok.get_vocab():
            msgs = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]
            return list(
                self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
            )
        return self._encode(protocol.render_prompt(question, self.system_prompt))

    def messages_prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """Prompt for a chat conversation; a leading system message replaces the loop's system prompt."""
        msgs = list(messages)
        system = self.system_prompt
        if msgs and msgs[0]["role"] == "system":
            system, msgs = msgs[0]["content"], msgs[1:]
        if getattr(self.tok, "chat_template", None) and protocol.ASSISTANT not in self.tok.get_vocab():
            full = [{"role": "system", "content": system}] + msgs
            return list(
                self.tok.apply_chat_template(full, add_generation_prompt=True, tokenize=True, return_dict=False)
            )
        return self._encode(protocol.render_conversation(msgs, system))

    def task_prompt_ids(self, task: Task) -> list[int]:
        return self.messages_prompt_ids(task.messages) if task.messages else self.prompt_ids(task.question)

    # ------------------------------------------------------------ public

    def run_groups(
        self, tasks: Sequence[Task], group_size: int, n_hybrid: int = 0, group_ids: Sequence[str] | None = None
    ) -> tuple[list[Trajectory], RolloutStats]:
        """Roll out ``group_size`` trajectories per task: slots [0, G - n_hybrid) on-policy, the rest hybrid.
        With ARPO settings, each group starts ``arpo_initial`` trajectories and fills the rest by branching."""
        group_ids = list(group_ids) if group_ids is not None else [t.id for t in tasks]
        trajs: list[Trajectory] = []
        budgets: dict[str, BranchBudget] = {}
        for task, gid in zip(tasks, group_ids):
            prompt = self.task_prompt_ids(task)
            n_start = group_size if self.s.arpo_initial is None else self.s.arpo_initial
            if self.s.arpo_initial is not None:
                budgets[gid] = BranchBudget(total=group_size, initial=n_start, beam_size=self.s.arpo_beam_size)
            for slot in range(n_start):
                kind = HYBRID if slot >= group_size - n_hybrid else ON_POLICY
                trajs.append(self._new(task, gid, slot, kind, prompt))
        stats = RolloutStats()
        run = self._run_per_trajectory if self.s.schedule == "per_trajectory" else self._run
        trajs = run(trajs, stats, budgets, {gid: task for task, gid in zip(tasks, group_ids)})
        return trajs, stats

    def _new(self, task: Task, gid: str, slot: int, kind: str, prompt: list[int]) -> Trajectory:
        return Trajectory(
            group_id=gid,
            slot=slot,
            slot_kind=kind,
            problem_id=task.id,
            task_kind=task.kind,
            answers=tuple(task.answers),
            prompt_ids=list(prompt),
            question=task.question,
            policy_version=self.engine.version,
        )

    # ------------------------------------------------------------ the turn loop

    def _run(
        self, trajs: list[Trajectory], stats: RolloutStats, budgets: dict, tasks_by_group: dict
    ) -> list[Trajectory]:
        brancher = EntropyBrancher(self.s.arpo_tau, self.s.arpo_beta, self.rng) if budgets else None
        pending_retrieval: dict[int, Retrieval] = {}
        while True:
            active = [i for i, t in enumerate(trajs) if not t.finished]
            if not active:
                if budgets and self._refill(trajs, budgets, tasks_by_group):
                    continue
                break
            stats.turns += 1
            # 1. retrievals (hybrid slots only, never before the first policy step)
            want = [
                i
                for i in active
                if trajs[i].slot_kind == HYBRID
                and trajs[i].num_generated_steps > 0
                and self.retriever is not None
                and self.rng.random() < self.s.retrieve_prob
            ]
            if want:
                t0 = time.perf_counter()
                self._insert_retrievals(trajs, want, pending_retrieval)
                stats.retrieve_s += time.perf_counter() - t0
            # 2. one policy step for every live trajectory
            prompts, params, rows = [], [], []
            for i in active:
                t = trajs[i]
                room = self._room(t)
                if room <= 0:  # out of response budget or context (a prompt longer than the window ends here)
                    self._finish(t, "length")
                    continue
                prompts.append(t.prompt_ids + t.response_ids)
                params.append(self._step_params(room, self.rng))
                rows.append(i)
            if not rows:
                continue
            t0 = time.perf_counter()
            results = self.engine.generate(prompts, params)
            stats.generate_s += time.perf_counter() - t0
            stats.engine_calls += 1
            calls: list[tuple[int, str, str]] = []
            for i, res in zip(rows, results):
                call = self._take_step(trajs[i], res, pending_retrieval.pop(i, None))
                if call is not None:
                    calls.append((i, *call))
            # 3. tools, concurrently
            if calls:
                t0 = time.perf_counter()
                self._run_tools(trajs, calls)
                stats.tool_s += time.perf_counter() - t0
            # ARPO: branch after tool results, decided by the entropy of the first k tokens of the step that
            # followed the previous tool result, against the rollout's initial entropy.
            if budgets:
                self._arpo_branch(trajs, [i for i, _, _ in calls], budgets, brancher)
        for t in trajs:
            self._score(t)
        return trajs

    # ------------------------------------------------------------ the per-trajectory schedule

    def _run_per_trajectory(
        self, trajs: list[Trajectory], stats: RolloutStats, budgets: dict, tasks_by_group: dict
    ) -> list[Trajectory]:
        """Same turns as ``_run``, each trajectory on its own: the main thread reacts to whichever
        generation, tool call or retrieval finishes first and submits that trajectory's next request.
        Sampling seeds and retrieval draws come from a per-trajectory RNG, so they do not depend on the
        order in which requests finish (ARPO's branching draws still do)."""
        brancher = EntropyBrancher(self.s.arpo_tau, self.s.arpo_beta, self.rng) if budgets else None
        run_seed = self.rng.randrange(2**31)
        rngs: dict[int, random.Random] = {}
        in_flight: dict = {}  # future -> (kind, trajectory index, started at)
        retrievals: dict[int, Retrieval] = {}
        generating = [0, 0.0]  # generations in flight, when the count last left 0
        retrieve_pool = (
            ThreadPoolExecutor(max_workers=32, thread_name_prefix="retrieve") if self.retriever is not None else None
        )

        def rng_of(i: int) -> random.Random:
            if i not in rngs:
                rngs[i] = random.Random(f"{run_seed}:{trajs[i].group_id}:{trajs[i].slot}")
            return rngs[i]

        def start_turn(i: int) -> None:
            t = trajs[i]
            if (
                t.slot_kind == HYBRID
                and t.num_generated_steps > 0
                and self.retriever is not None
                and rng_of(i).random() < self.s.retrieve_prob
            ):
                query = self._query(t)
                fut = retrieve_pool.submit(self.retriever.retrieve, [query], [t.problem_id])
                in_flight[fut] = ("retrieve", i, time.perf_counter())
                return
            start_generation(i)

        def start_generation(i: int) -> None:
            t = trajs[i]
            room = self._room(t)
            if room <= 0:
                self._finish(t, "length")
                return
            if generating[0] == 0:
                generating[1] = time.perf_counter()
            generating[0] += 1
            fut = self.engine.submit(t.prompt_ids + t.response_ids, self._step_params(room, rng_of(i)))
            in_flight[fut] = ("generate", i, time.perf_counter())

        try:
            for i in range(len(trajs)):
                start_turn(i)
            while True:
                if not in_flight:
                    n_before = len(trajs)
                    if budgets and self._refill(trajs, budgets, tasks_by_group):
                        for i in range(n_before, len(trajs)):
                            start_turn(i)
                        continue
                    break
                done, _ = wait(list(in_flight), return_when=FIRST_COMPLETED)
                for fut in done:
                    kind, i, started = in_flight.pop(fut)
                    t = trajs[i]
                    if kind == "retrieve":
                        stats.retrieve_s += time.perf_counter() - started
                        try:
                            r = self._insert_retrieval(t, fut.result()[0])
                        except RetrievalFailed:
                            t.retrieval_errors += 1
                            r = None
                        if r is not None:
                            retrievals[i] = r
                        start_generation(i)
                    elif kind == "generate":
                        generating[0] -= 1
                        if generating[0] == 0:
                            stats.generate_s += time.perf_counter() - generating[1]
                        stats.engine_calls += 1
                        call = self._take_step(t, fut.result(), retrievals.pop(i, None))
                        if call is None:
                            continue
                        tool, content = call
                        malformed = _malformed_call_result(content)
                        if malformed is not None:
                            self._append_tool_result(t, malformed)
                            self._after_tool(trajs, i, budgets, brancher, start_turn)
                        else:
                            in_flight[self.tools.submit(tool, content)] = ("tool", i, time.perf_counter())
                    else:  # tool
                        res = fut.result()
                        stats.tool_s += res.elapsed_s
                        self._append_tool_result(t, res)
                        self._after_tool(trajs, i, budgets, brancher, start_turn)
            stats.turns = max((t.num_generated_steps for t in trajs), default=0)
        finally:
            if retrieve_pool is not None:
                retrieve_pool.shutdown(wait=False, cancel_futures=True)
        for t in trajs:
            self._score(t)
        return trajs

    def _after_tool(self, trajs, i, budgets, brancher, start_turn) -> None:
        n_before = len(trajs)
        if budgets and not trajs[i].finished:
            self._arpo_branch(trajs, [i], budgets, brancher)
        for j in [i] + list(range(n_before, len(trajs))):  # the trajectory, then any branch forked from it
            if not trajs[j].finished:
                start_turn(j)

    # ------------------------------------------------------------ one turn's pieces (both schedules)

    def _step_params(self, room: int, rng: random.Random) -> SamplingParams:
        return SamplingParams(
            temperature=self.s.temperature,
            top_p=self.s.top_p,
            max_new_tokens=min(self.s.max_step_tokens, room),
            stop_token_ids=self.stop_ids,
            stop_strings=self.stop_strings,
            seed=None if self.s.seed is None else rng.randrange(2**31),
        )

    def _take_step(self, t: Trajectory, res, retrieval: Retrieval | None) -> tuple[str, str] | None:
        """Append a generated step; returns the (tool, content) call it ended with, if any."""
        t.entropy_is_estimate = res.entropy_is_estimate
        t.append(GENERATED, list(res.token_ids), list(res.logprobs), list(res.entropies))
        self._emit(t, GENERATED, res.token_ids)
        if retrieval is not None:
            retrieval.step_after = t.num_generated_steps - 1
        return self._classify_step(t, res)

    def _query(self, t: Trajectory) -> str:
        """The retrieval query for ``t``'s next step: the tail of its question and history so far (spec §2)."""
        history = self.tok.decode(t.response_ids, skip_special_tokens=False)
        return query_text(t.question, history, self.s.query_max_chars)

    def _insert_retrievals(self, trajs, want, pending):
        queries = [self._query(trajs[i]) for i in want]
        try:
            hits = self.retriever.retrieve(queries, [trajs[i].problem_id for i in want])
        except RetrievalFailed:  # every asking slot takes a policy step instead, counted
            for i in want:
                trajs[i].retrieval_errors += 1
            return
        for i, hit in zip(want, hits):
            r = self._insert_retrieval(trajs[i], hit)
            if r is not None:
                pending[i] = r

    def _insert_retrieval(self, t: Trajectory, hit) -> Retrieval | None:
        """Append ``<retrieve>step</retrieve>`` (loss-masked) when there is a hit and room for it."""
        if hit is None:
            t.retrieval_fallbacks += 1
            return None
        ids = self.retrieve_open + (list(hit.value_ids) or self._encode(hit.value)) + self.retrieve_close
        room = self._room(t) - 1
        if len(ids) > room:  # no room for the retrieved step and a policy step after it
            t.retrieval_fallbacks += 1
            return None
        t.append(RETRIEVED, ids)
        self._emit(t, RETRIEVED, ids)
        r = Retrieval(
            step_before=t.num_generated_steps - 1,
            step_after=None,
            score=hit.score,
            source_id=hit.question_id,
            noise=hit.noise,
        )
        t.retrievals.append(r)
        return r

    def _classify_step(self, t: Trajectory, res) -> tuple[str, str] | None:
        """End the trajectory or return the (tool, content) call its step ended with."""
        ids = res.token_ids
        if not ids:
            self._finish(t, "empty")
            return None
        text = self.tok.decode(ids, skip_special_tokens=False)
        if ids[-1] == self.eos_id or text.endswith(protocol.ANSWER[1]):
            self._finish(t, "answer" if protocol.ANSWER[1] in text else "eos")
            return None
        tool = next((name for tag, name in _TOOL_TAGS.items() if text.endswith(tag)), None)
        if tool is None:
            self._finish(t, "length")
            return None
        if t.tool_calls >= self.s.max_tool_calls:
            self._finish(t, "tool_limit")
            return None
        t.tool_calls += 1
        return tool, self._parse_call(text, tool)

    @staticmethod
    def _parse_call(step_text: str, tool: str) -> str:
        """The content of the call that closes the step; malformed calls yield an ``\\x00error`` marker."""
        open_tag, close_tag = _OPEN_TAGS[tool], protocol.PYTHON[1] if tool == "python" else protocol.SEARCH[1]
        body = step_text[: -len(close_tag)]
        start = body.rfind(open_tag)
        if start < 0:
            other = [o for o in _OPEN_TAGS.values() if o in body]
            return "\x00error:" + (
                f"{close_tag} closes {other[-1]} (mismatched tags)" if other else f"{close_tag} without {open_tag}"
            )
        content = body[start + len(open_tag) :]
        for tag in protocol.ALL_TAGS:
            if tag in content:
                return f"\x00error:nested tag {tag} inside {open_tag}"
        return content.strip()

    def _run_tools(self, trajs, calls):
        results: list[ToolResult | None] = [None] * len(calls)
        todo = []
        for k, (_, _tool, content) in enumerate(calls):
            malformed = _malformed_call_result(content)
            if malformed is not None:
                results[k] = malformed
            else:
                todo.append(k)
        for k, res in zip(todo, self.tools.call_many([(calls[k][1], calls[k][2]) for k in todo])):
            results[k] = res
        for (i, _, _), res in zip(calls, results):
            self._append_tool_result(trajs[i], res)

    def _append_tool_result(self, t: Trajectory, res: ToolResult) -> None:
        t.tool_time_s += res.elapsed_s
        t.tool_errors += 0 if res.ok else 1
        ids = self._encode(protocol.RESULT[0] + res.text + protocol.RESULT[1])
        room = self._room(t)
        if room <= 1:
            self._finish(t, "length")
            return
        if len(ids) > room - 1:  # truncate the result, keep the closing tag
            close = self._encode(protocol.RESULT[1])
            ids = ids[: max(room - 1 - len(close), 0)] + close
        t.append(TOOL_RESULT, ids)
        self._emit(t, TOOL_RESULT, ids)

    def _arpo_branch(self, trajs: list[Trajectory], just_called: list[int], budgets: dict, brancher: EntropyBrancher):
        k, vocab = self.s.arpo_entropy_tokens, len(self.tok)
        for i in just_called:
            t = trajs[i]
            if t.finished:
                continue
            steps = [(s, e) for kind, s, e in t.segments if kind == GENERATED]
            key = (t.group_id, t.slot if t.parent is None else t.parent)  # a branch shares its root's initial entropy
            first = normalized_segment_entropy(t.token_entropies[steps[0][0] : steps[0][1]], k, vocab)
            brancher.set_initial(key, first)
            s, e = steps[-1]
            now = normalized_segment_entropy(t.token_entropies[s:e], k, vocab)
            for _ in budgets[t.group_id].allocate([i], lambda _i: brancher.decide(key, now)):
                child = t.fork(slot=max(x.slot for x in trajs if x.group_id == t.group_id) + 1)
                trajs.append(child)

    def _refill(self, trajs, budgets, tasks_by_group) -> bool:
        """ARPO: when every path of a group ended before its budget was used, add full samples."""
        added = False
        for gid, budget in budgets.items():
            n = budget.fill_with_full_samples()
            if n <= 0:
                continue
            task = tasks_by_group[gid]
            prompt = self.task_prompt_ids(task)
            top = max(x.slot for x in trajs if x.group_id == gid)
            for j in range(n):
                trajs.append(self._new(task, gid, top + 1 + j, ON_POLICY, prompt))
            added = True
        return added

    def _room(self, t: Trajectory) -> int:
        room = self.s.max_response_tokens - len(t.response_ids)
        if self.s.max_context:
            room = min(room, self.s.max_context - len(t.prompt_ids) - len(t.response_ids) - 1)
        return room

    def _emit(self, t: Trajectory, kind: str, ids) -> None:
        if self.on_append is not None:
            self.on_append(t, kind, list(ids))

    @staticmethod
    def _finish(t: Trajectory, reason: str):
        t.finished, t.finish_reason = True, reason

    def _score(self, t: Trajectory):
        # Policy-generated text only: tool results and retrieved blocks earn nothing.
        sc = self.tools.score(generated_text(self.tok, t), t.answers, t.task_kind, self.s.tool_bonus)
        t.reward, t.correct, t.f1, t.format_ok, t.answer = sc.reward, sc.correct, sc.f1, sc.format_ok, sc.answer
        if t.retrievals and sc.reward > 0 and sc.answer:
            t.answer_retrieved = answer_handed(
                sc.answer, segment_text(self.tok, t, RETRIEVED), segment_text(self.tok, t, TOOL_RESULT)
            )
            if t.answer_retrieved and not self.s.reward_retrieved_answers:
                t.reward = 0.0


def _malformed_call_result(content: str) -> ToolResult | None:
    """The error result a malformed call gets instead of running (``_parse_call``'s marker), else None."""
    return ToolResult("Error: " + content[len("\x00error:") :], False) if content.startswith("\x00error:") else None


def segment_text(tokenizer, t: Trajectory, kind: str) -> str:
    """The text of ``t``'s segments of one kind (GENERATED, TOOL_RESULT, RETRIEVED), in order."""
    return "".join(tokenizer.decode(seg, skip_special_tokens=False) for seg in t.segment_ids(kind))


def generated_text(tokenizer, t: Trajectory) -> str:
    return segment_text(tokenizer, t, GENERATED)


def answer_handed(answer: str, retrieved_text: str, own_tool_text: str) -> bool:
    """Whether a rollout's answer was handed to it: it occurs (whole words, any case) in the retrieved steps'
    text and in none of the results of the rollout's own tool calls. Such a rollout is rewarded for what the
    off-policy expert found, and its own (often wrong) calls are reinforced with it (docs/RESULTS.md, Algorithms)."""
    words = re.escape(" ".join(answer.split())).replace(r"\ ", r"\s+")
    pattern = re.compile(rf"(?<!\w){words}(?!\w)", re.IGNORECASE)
    return bool(answer.strip()) and bool(pattern.search(retrieved_text)) and not pattern.search(own_tool_text)


def full_text(tokenizer, t: Trajectory) -> str:
    return tokenizer.decode(t.response_ids, skip_special_tokens=False)


__all__ = [
    "AgentLoop",
    "LoopSettings",
    "RolloutStats",
    "Task",
    "answer_handed",
    "generated_text",
    "full_text",
    "segment_text",
]
