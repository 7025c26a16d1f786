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

from rapo_ray.engines.base import GenerationResult, InferenceEngine
from rapo_ray.envs.tasks import arith_plan, multihop_plan
from rapo_ray.types import protocol

_FACT = re.compile(r"The (\w+) of (\w+) is (\w+)\.")
_CALL_RESULT = r"(?:{open_py}|{open_se})(.*?)(?:{close_py}|{close_se}).*?{open_r}(.*?){close_r}".format(
    open_py=re.escape(protocol.PYTHON[0]),
    open_se=re.escape(protocol.SEARCH[0]),
    close_py=re.escape(protocol.PYTHON[1]),
    close_se=re.escape(protocol.SEARCH[1]),
    open_r=re.escape(protocol.RESULT[0]),
    close_r=re.escape(protocol.RESULT[1]),
)
# one step in response order: a retrieved block (groups 1-3) or the expert's own call and its result (groups 4-5)
_BLOCK = re.compile(
    "("
    + re.escape(protocol.RETRIEVE[0])
    + ").*?"
    + _CALL_RESULT
    + ".*?"
    + re.escape(protocol.RETRIEVE[1])
    + "|"
    + _CALL_RESULT,
    re.S,
)


class ScriptedExpertEngine(InferenceEngine):
    name = "expert"

    def __init__(self, tokenizer, error_rate: float = 0.0, seed: int = 0):
        super().__init__()
        self.tok = tokenizer
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.frame = protocol.question_frame(tokenizer)  # the bundled frame, or a real model's chat template

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
        before, after = self.frame
        question = context.split(before, 1)[-1].split(after, 1)[0]
        response = context.split(after, 1)[-1]
        plan = arith_plan(question)
        if plan is not None:
            results = self._steps_done(response, lambda results: self._arith_call(plan, results))
            return self._arith_step(plan, results, len(results))
        plan = multihop_plan(question)
        if plan is not None:
            results = self._steps_done(response, lambda results: self._multihop_call(plan, results))
            return self._multihop_step(plan, results, len(results))
        return self._answer("unknown")

    @staticmethod
    def _steps_done(response: str, next_call) -> list[str]:
        """Tool results of the steps done so far: the expert's own, plus any retrieved step whose call is exactly
        ``next_call(results so far)``, the one the expert would make next (it continues from that step's result
        instead of redoing it); other retrieved blocks (another question's step, a wrong one) are ignored."""
        results: list[str] = []
        for block in _BLOCK.finditer(response):
            retrieved = block.group(1) is not None
            call, result = (block.group(2), block.group(3)) if retrieved else (block.group(4), block.group(5))
            if not retrieved or call.strip() == next_call(results):
                results.append(result)
        return results

    @classmethod
    def _arith_call(cls, plan, results) -> str | None:
        """The error-free next python call (None once every operation is done)."""
        ops = plan[1]
        return f"print({cls._arith_state(plan, results)} {ops[len(results)]})" if len(results) < len(ops) else None

    @classmethod
    def _multihop_call(cls, plan, results) -> str | None:
        """The error-free next search (None once every hop is done)."""
        rels = plan[1]
        return f"{rels[len(results)]} of {cls._multihop_state(plan, results)}" if len(results) < len(rels) else None

    @staticmethod
    def _arith_state(plan, results) -> str:
        return str(plan[0]) if not results else results[-1].strip()

    @staticmethod
    def _multihop_state(plan, results) -> str:
        start, rels = plan
        current = start
        for k, result in enumerate(results):  # follow the chain through the facts the searches actually returned
            facts = {(r, subj): obj for r, subj, obj in _FACT.findall(result)}
            current = facts.get((rels[k], current), current)
        return current

    def _err(self) -> bool:
        return self.rng.random() < self.error_rate

    def _arith_step(self, plan, results, done) -> str:
        ops = plan[1]
        current = self._arith_state(plan, results)
        if done >= len(ops) or (done > 0 and self._err()):
            return self._answer(current)
        op = ops[done]
        if self._err():
            op = re.sub(r"\d+$", lambda m: str(int(m.group(0)) + self.rng.randint(1, 9)), op)
        expr = f"{current} {op}"
        return (
            f"{protocol.THINK[0]}compute {expr}{protocol.THINK[1]}{protocol.PYTHON[0]}print({expr}){protocol.PYTHON[1]}"
        )

    def _multihop_step(self, plan, results, done) -> str:
        rels = plan[1]
        current = self._multihop_state(plan, results)
        if done >= len(rels) or (done > 0 and self._err()):
            return self._answer(current)
        rel = rels[done]
        if self._err():
            rel = self.rng.choice([r for r in ("mentor", "rival", "sibling", "neighbor", "partner") if r != rel])
        return f"{protocol.THINK[0]}find the {rel} of {current}{protocol.THINK[1]}{protocol.SEARCH[0]}{rel} of {current}{protocol.SEARCH[1]}"

    @staticmethod
    def _answer(value: str) -> str:
        return f"{protocol.THINK[0]}done{protocol.THINK[1]}{protocol.ANSWER[0]}\\boxed{{{value}}}{protocol.ANSWER[1]}"
