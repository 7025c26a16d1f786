"""An engine that replays a fixed script of steps: drives the agent loop and the serving stack without a
model (tests, demos of tool behaviour). Step k is emitted when the conversation holds k tool results."""

from __future__ import annotations

from rapo_ray.engines.base import GenerationResult, InferenceEngine
from rapo_ray.types import protocol


class ScriptedEngine(InferenceEngine):
    name = "scripted"

    def __init__(self, tokenizer, steps: list[str]):
        super().__init__()
        if not steps:
            raise ValueError("ScriptedEngine needs at least one step")
        self.tok, self.steps = tokenizer, list(steps)

    def generate(self, prompts, params):
        out = []
        for ids, p in zip(prompts, self._per_prompt(params, len(prompts))):
            text = self.tok.decode(ids, skip_special_tokens=False)
            turn = text.rsplit(protocol.ASSISTANT, 1)[-1].count(protocol.RESULT[1])
            step = self.steps[min(turn, len(self.steps) - 1)]
            tokens = self.tok(step, add_special_tokens=False)["input_ids"][: p.max_new_tokens]
            out.append(
                GenerationResult(
                    tokens,
                    [0.0] * len(tokens),
                    [0.0] * len(tokens),
                    "stop" if len(tokens) < p.max_new_tokens else "length",
                )
            )
        return out

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.version = version  # no weights: only the version moves


def scripted_engine(model_dir, tokenizer, steps: list[str]) -> ScriptedEngine:
    """``serve.engine_factory`` entry point: ``rapo_ray.engines.scripted:scripted_engine``."""
    return ScriptedEngine(tokenizer, steps)
