"""The pieces of one agent turn that both rollout schedules share (rapo_ray/agent/lockstep.py and
rapo_ray/agent/per_trajectory.py). One turn of one trajectory:

  1. the algorithm's rollout policy asks for a retrieval  ->  append <retrieve>value</retrieve> (mask 0)
  2. generate a policy step until a closing tool tag, </answer>, EOS, or the step/response budget
  3. closing tool tag -> parse the call, run the tool, append <result>...</result> (mask 0)
  4. </answer>, EOS, budget, or tool-call limit -> the trajectory ends

A retrieval is always followed by a policy step (step 2 runs in the same turn), so two retrievals are never
adjacent. Token-in/token-out: every segment is appended as the ids that were produced or tokenized once.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from rapo_ray.agent.retriever import StepRetriever, query_text
from rapo_ray.algos.rollout import RolloutPolicy
from rapo_ray.core.errors import RetrievalFailed
from rapo_ray.engines.base import InferenceEngine, SamplingParams, stop_string_at
from rapo_ray.types import protocol
from rapo_ray.types.environment import Environment, ToolResult
from rapo_ray.types.trajectory import GENERATED, RETRIEVED, TOOL_RESULT, Retrieval, Task, Trajectory

_TOOL_TAGS = {protocol.PYTHON[1]: "python", protocol.SEARCH[1]: "search"}
_OPEN_TAGS = {"python": protocol.PYTHON[0], "search": protocol.SEARCH[0]}


@dataclass
class LoopSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_tokens: int = 256
    max_step_tokens: int = 96
    max_tool_calls: int = 3
    query_max_chars: int = 1300  # retrieval.query_max_chars: the tail of question + history a query sends
    tool_bonus: float = 0.0
    max_context: int = 0  # the model's window: prompt + response never exceed it (0: no limit known)
    seed: int | None = None
    schedule: str = "lockstep"  # "lockstep" | "per_trajectory" (see the module docstring)
    system_prompt: str = protocol.SYSTEM_PROMPT

    @classmethod
    def from_config(cls, cfg, evaluation: bool = False) -> "LoopSettings":
        """Settings of a run (``Config``); ``evaluation``: greedy sampling."""
        rollout_cfg = cfg.rollout
        return cls(
            temperature=0.0 if evaluation else rollout_cfg.temperature,
            top_p=1.0 if evaluation else rollout_cfg.top_p,
            max_response_tokens=rollout_cfg.max_response_tokens,
            max_step_tokens=rollout_cfg.max_step_tokens,
            max_tool_calls=rollout_cfg.max_tool_calls,
            system_prompt=protocol.system_prompt_for(cfg.tasks.system_prompt, bundled=cfg.model.bundled),
            schedule=rollout_cfg.schedule,
            query_max_chars=cfg.retrieval.query_max_chars,
        )


@dataclass
class RolloutStats:
    """Lockstep: wall time of each phase. Per-trajectory (phases overlap): ``generate_s`` is the wall time
    with at least one generation in flight, ``tool_s`` and ``retrieve_s`` are summed over calls."""

    generate_s: float = 0.0
    tool_s: float = 0.0
    retrieve_s: float = 0.0
    turns: int = 0
    engine_calls: int = 0


class AgentTurns:
    """An engine, a tokenizer and the tools, and what one turn does with them. ``AgentLoop`` adds the public
    ``run_groups``; the schedules drive these pieces."""

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
        self._closing_tags = [protocol.ANSWER[1], *_TOOL_TAGS]
        self.retrieve_open = self._encode(protocol.RETRIEVE[0])
        self.retrieve_close = self._encode(protocol.RETRIEVE[1])

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, question: str) -> list[int]:
        if protocol.uses_chat_template(self.tok):
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
        if protocol.uses_chat_template(self.tok):
            full = [{"role": "system", "content": system}] + msgs
            return list(
                self.tok.apply_chat_template(full, add_generation_prompt=True, tokenize=True, return_dict=False)
            )
        return self._encode(protocol.render_conversation(msgs, system))

    def task_prompt_ids(self, task: Task) -> list[int]:
        return self.messages_prompt_ids(task.messages) if task.messages else self.prompt_ids(task.question)

    def add_samples(self, trajs: list[Trajectory], task: Task, gid: str, slot_kinds: Sequence[str]) -> None:
        """Append new trajectories of group ``gid`` with the given slot kinds, numbered after its last slot."""
        prompt = self.task_prompt_ids(task)
        top = max((x.slot for x in trajs if x.group_id == gid), default=-1)
        for j, kind in enumerate(slot_kinds):
            trajs.append(self._new(task, gid, top + 1 + j, kind, prompt))

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

    # ------------------------------------------------------------ one turn's pieces (both schedules)

    def step_params(self, room: int, rng: random.Random) -> SamplingParams:
        return SamplingParams(
            temperature=self.s.temperature,
            top_p=self.s.top_p,
            max_new_tokens=min(self.s.max_step_tokens, room),
            stop_token_ids=self.stop_ids,
            stop_strings=self.stop_strings,
            seed=None if self.s.seed is None else rng.randrange(2**31),
        )

    def take_step(self, t: Trajectory, res, retrieval: Retrieval | None) -> tuple[str, str] | None:
        """Append a generated step; returns the (tool, content) call it ended with, if any."""
        t.entropy_is_estimate = res.entropy_is_estimate
        t.append(GENERATED, list(res.token_ids), list(res.logprobs), list(res.entropies))
        self._emit(t, GENERATED, res.token_ids)
        if retrieval is not None:
            retrieval.step_after = t.num_generated_steps - 1
        return self._classify_step(t, res)

    def query(self, t: Trajectory) -> str:
        """The retrieval query for ``t``'s next step: the tail of its question and history so far (spec §2)."""
        history = self.tok.decode(t.response_ids.tolist(), skip_special_tokens=False)
        return query_text(t.question, history, self.s.query_max_chars)

    def insert_retrievals(self, trajs, want, pending):
        queries = [self.query(trajs[i]) for i in want]
        try:
            hits = self.retriever.retrieve(queries, [trajs[i].problem_id for i in want])
        except RetrievalFailed:  # every asking slot takes a policy step instead, counted
            for i in want:
                trajs[i].retrieval_errors += 1
            return
        for i, hit in zip(want, hits):
            r = self.insert_retrieval(trajs[i], hit)
            if r is not None:
                pending[i] = r

    def insert_retrieval(self, t: Trajectory, hit) -> Retrieval | None:
        """Append ``<retrieve>step</retrieve>`` (loss-masked) when there is a hit and room for it."""
        if hit is None:
            t.retrieval_fallbacks += 1
            return None
        ids = self.retrieve_open + (list(hit.value_ids) or self._encode(hit.value)) + self.retrieve_close
        room = self.room(t) - 1
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
            self.finish(t, "empty")
            return None
        text = self.tok.decode(ids, skip_special_tokens=False)
        # the closing tag the engine stopped at (a multi-token tag may end inside the step's last token)
        tag = stop_string_at(text, self.tok.decode(ids[-1:], skip_special_tokens=False), self._closing_tags)
        if ids[-1] == self.eos_id or tag == protocol.ANSWER[1]:
            self.finish(t, "answer" if protocol.ANSWER[1] in text else "eos")
            return None
        tool = _TOOL_TAGS.get(tag)
        if tool is None:
            self.finish(t, "length")
            return None
        if t.tool_calls >= self.s.max_tool_calls:
            self.finish(t, "tool_limit")
            return None
        t.tool_calls += 1
        return tool, self._parse_call(text, tool)

    @staticmethod
    def _parse_call(step_text: str, tool: str) -> str:
        """The content of the call that closes the step; malformed calls yield an ``\\x00error`` marker."""
        open_tag, close_tag = _OPEN_TAGS[tool], protocol.PYTHON[1] if tool == "python" else protocol.SEARCH[1]
        body = step_text[: step_text.rfind(close_tag)]
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

    def run_tools(self, trajs, calls):
        results: list[ToolResult | None] = [None] * len(calls)
        todo = []
        for k, (_, _tool, content) in enumerate(calls):
            malformed = malformed_call_result(content)
            if malformed is not None:
                results[k] = malformed
            else:
                todo.append(k)
        for k, res in zip(todo, self.tools.call_many([(calls[k][1], calls[k][2]) for k in todo])):
            results[k] = res
        for (i, _, _), res in zip(calls, results):
            self.append_tool_result(trajs[i], res)

    def append_tool_result(self, t: Trajectory, res: ToolResult) -> None:
        t.tool_time_s += res.elapsed_s
        t.tool_errors += 0 if res.ok else 1
        ids = self._encode(protocol.RESULT[0] + res.text + protocol.RESULT[1])
        room = self.room(t)
        if room <= 1:
            self.finish(t, "length")
            return
        if len(ids) > room - 1:  # truncate the result, keep the closing tag
            close = self._encode(protocol.RESULT[1])
            ids = ids[: max(room - 1 - len(close), 0)] + close
        t.append(TOOL_RESULT, ids)
        self._emit(t, TOOL_RESULT, ids)

    def room(self, t: Trajectory) -> int:
        room = self.s.max_response_tokens - len(t.response_ids)
        if self.s.max_context:
            room = min(room, self.s.max_context - len(t.prompt_ids) - len(t.response_ids) - 1)
        return room

    def _emit(self, t: Trajectory, kind: str, ids) -> None:
        if self.on_append is not None:
            self.on_append(t, kind, list(ids))

    @staticmethod
    def finish(t: Trajectory, reason: str):
        t.finished, t.finish_reason = True, reason

    def score(self, t: Trajectory, rollout: RolloutPolicy) -> None:
        """Score the policy-generated text only (tool results and retrieved blocks earn nothing), mark a handed
        answer, then let the rollout policy settle the reward."""
        sc = self.tools.score(generated_text(self.tok, t), t.answers, t.task_kind, self.s.tool_bonus)
        t.reward, t.correct, t.f1, t.format_ok, t.answer = sc.reward, sc.correct, sc.f1, sc.format_ok, sc.answer
        if t.retrievals and sc.reward > 0 and sc.answer:
            t.answer_retrieved = answer_handed(
                sc.answer, segment_text(self.tok, t, RETRIEVED), segment_text(self.tok, t, TOOL_RESULT)
            )
        rollout.settle_reward(t)


def malformed_call_result(content: str) -> ToolResult | None:
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


__all__ = [
    "AgentTurns",
    "LoopSettings",
    "RolloutStats",
    "Task",
    "answer_handed",
    "generated_text",
    "segment_text",
]
