"""The scripted expert agent: an ``InferenceEngine`` that writes the expert's next step.

Because it is an engine, the expert runs through the real agent loop with the real tools: its
trajectories are token-exact protocol trajectories with genuine tool results, usable as warm-start
demonstrations and as the off-policy step-trace buffer. It reads the question and the latest tool result
from the context, so a wrong tool result really derails it.

``error_rate`` makes it imperfect (a wrong operand, a wrong relation, or a premature answer), so N samples
per question differ in reward and the buffer's top-K filter has something to do.
"""

from __future__ import annotations

import random
import re

from rapo_ray.agent import protocol
from rapo_ray.engines.base import GenerationResult, InferenceEngine

_ARITH_OPS = re.compile(r"(buys (\d+) boxes of (\d+))|(gives away (\d+))|(finds (\d+) more)")
_ARITH_START = re.compile(r"^\w+ has (\d+) ")
_HOP = re.compile(r"the (\w+) of ")
_RESULT = re.compile(re.escape(protocol.RESULT[0]) + r"(.*?)" + re.escape(protocol.RESULT[1]), re.S)
_FACT = re.compile(r"The (\w+) of (\w+) is (\w+)\.")


def arith_plan(question: str) -> tuple[int, list[str]] | None:
    m = _ARITH_START.match(question)
    if not m:
        return None
    ops = []
    for g in _ARITH_OPS.finditer(question):
        if g.group(1):
            ops.append(f"+ {g.group(2)} * {g.group(3)}")
        elif g.group(4):
            ops.append(f"- {g.group(5)}")
        else:
            ops.append(f"+ {g.group(7)}")
    return int(m.group(1)), ops


def multihop_plan(question: str) -> tuple[str, list[str]] | None:
    if not question.startswith("Who is "):
        return None
    rels = _HOP.findall(question)
    start = question.rstrip("?").rsplit(" of ", 1)[-1]
    return start, list(reversed(rels))


class ScriptedExpertEngine(InferenceEngine):
    name = "expert"

    def __init__(self, tokenizer, error_rate: float = 0.0, seed: int = 0):
        super().__init__()
        self.tok = tokenizer
        self.error_rate = error_rate
        self.rng = random.Random(seed)

    def load_weights(self, state_dict, version):
        raise NotImplementedError("the scripted expert has no weights")

    def generate(self, prompts, params):
        per = self._per_prompt(params, len(prompts))
        out = []
        for ids, p in zip(prompts, per):
            text = self.tok.decode(ids, skip_special_tokens=False)
            step = self.next_step(text)
            tokens = self.tok(step, add_special_tokens=False)["input_ids"][: p.max_new_tokens]
            finish = "stop" if len(tokens) < p.max_new_tokens or step.endswith(protocol.ANSWER[1]) else "length"
            out.append(GenerationResult(tokens, [0.0] * len(tokens), [0.0] * len(tokens), finish, None))
        return out

    # ------------------------------------------------------------ the policy

    def next_step(self, context: str) -> str:
        question = context.split(protocol.USER, 1)[-1].split(protocol.ASSISTANT, 1)[0]
        response = context.split(protocol.ASSISTANT, 1)[-1]
        # Only the expert's own steps count: text inside <retrieve> blocks is ignored.
        own = re.sub(re.escape(protocol.RETRIEVE[0]) + ".*?" + re.escape(protocol.RETRIEVE[1]), "", response, flags=re.S)
        results = _RESULT.findall(own)
        done = len(results)
        plan = arith_plan(question)
        if plan is not None:
            return self._arith_step(plan, results, done)
        plan = multihop_plan(question)
        if plan is not None:
            return self._multihop_step(plan, results, done)
        return self._answer("unknown")

    def _err(self) -> bool:
        return self.rng.random() < self.error_rate

    def _arith_step(self, plan, results, done) -> str:
        start, ops = plan
        current = start if done == 0 else results[-1].strip()
        if done >= len(ops) or (done > 0 and self._err()):
            return self._answer(current)
        op = ops[done]
        if self._err():
            op = re.sub(r"\d+$", lambda m: str(int(m.group(0)) + self.rng.randint(1, 9)), op)
        expr = f"{current} {op}"
        return f"{protocol.THINK[0]}compute {expr}{protocol.THINK[1]}{protocol.PYTHON[0]}print({expr}){protocol.PYTHON[1]}"

    def _multihop_step(self, plan, results, done) -> str:
        start, rels = plan
        current = start
        for k in range(done):  # follow the chain through the facts the searches actually returned
            facts = {(r, subj): obj for r, subj, obj in _FACT.findall(results[k])}
            current = facts.get((rels[k], current), current)
        if done >= len(rels) or (done > 0 and self._err()):
            return self._answer(current)
        rel = rels[done]
        if self._err():
            rel = self.rng.choice([r for r in ("mentor", "rival", "sibling", "neighbor", "partner") if r != rel])
        return f"{protocol.THINK[0]}find the {rel} of {current}{protocol.THINK[1]}{protocol.SEARCH[0]}{rel} of {current}{protocol.SEARCH[1]}"

    @staticmethod
    def _answer(value: str) -> str:
        return f"{protocol.THINK[0]}done{protocol.THINK[1]}{protocol.ANSWER[0]}\\boxed{{{value}}}{protocol.ANSWER[1]}"
