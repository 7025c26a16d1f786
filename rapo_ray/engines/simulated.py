"""An engine that models decoding instead of doing it, for scheduler and capacity studies (``rollout.engine=simulated``).

Each prompt gets a sampled number of tokens (uniform in [min_tokens, max_tokens], capped by ``max_new_tokens``) of
one filler token, and the call sleeps as long as a batched engine would decode them: its longest sequence's tokens
x ``token_ms`` (a batched engine advances all its sequences one token per step). It uses no core while it
"decodes", so a 2-core box can stand in for a fleet of GPU engines when the question is how the driver schedules
them. Its log-probs and entropies are 0.
"""

from __future__ import annotations

import random
import time

from rapo_ray.engines.base import GenerationResult, InferenceEngine


class SimulatedEngine(InferenceEngine):
    name = "simulated"

    def __init__(self, tokenizer, token_ms: float, min_tokens: int, max_tokens: int, seed: int = 0):
        super().__init__()
        if token_ms < 0:
            raise ValueError(f"SimulatedEngine: token_ms must be >= 0, got {token_ms}")
        if not 1 <= min_tokens <= max_tokens:
            raise ValueError(f"SimulatedEngine: need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
        self.token_ms, self.min_tokens, self.max_tokens = token_ms, min_tokens, max_tokens
        # plain text that closes no tag: a simulated step is a final step without an answer (reward -1)
        self.filler = tokenizer(" so", add_special_tokens=False)["input_ids"][-1]
        self.rng = random.Random(seed)
        self.decoded_tokens = 0  # what the engine would have decoded, for the benchmark's own accounting

    def generate(self, prompts, params):
        out = []
        for p in self._per_prompt(params, len(prompts)):
            n = min(self.rng.randint(self.min_tokens, self.max_tokens), p.max_new_tokens)
            reason = "length" if n == p.max_new_tokens else "stop"
            out.append(GenerationResult([self.filler] * n, [0.0] * n, [0.0] * n, reason))
        longest = max((len(r.token_ids) for r in out), default=0)
        self.decoded_tokens += sum(len(r.token_ids) for r in out)
        time.sleep(longest * self.token_ms / 1000.0)
        return out

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.version = version  # no weights: only the version moves
