"""The one inference interface used by rollout workers and the serving app.

Token-in, token-out: prompts are token ids, results are the generated token ids with their per-token
log-probabilities (of the model's distribution at temperature 1, i.e. what PPO's behaviour policy means)
and entropies. The torch engine's entropies are exact (full vocabulary); vLLM's are an estimate from the
top-k log-probabilities (ARPO's method) and say so in ``entropy_is_estimate``.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)  # generation stops after emitting one (kept)
    stop_strings: list[str] = field(default_factory=list)  # stops once one ends in the last token (``stop_string_at``)
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def stop_string_at(text: str, last_piece: str, stop_strings) -> str | None:
    """The stop string that ends inside the last token of ``text`` (``last_piece``: that token decoded), if any.

    With a real BPE vocabulary a tag is several tokens, and its last one can carry more characters: "</answer>."
    can end in the single token ">.". So a stop string counts when it ends within the last token, not only at the
    very end of the text; the extra characters stay (token-in/token-out: the sampled ids are kept as sampled).
    """
    start_of_last = len(text) - len(last_piece)
    for s in stop_strings:
        i = text.rfind(s)
        if i >= 0 and i + len(s) > start_of_last:
            return s
    return None


@dataclass
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    finish_reason: str  # "stop" (stop token/string or EOS) or "length"
    stop_reason: int | str | None = None  # the stop token id or string that ended generation
    entropy_is_estimate: bool = False


class InferenceEngine(abc.ABC):
    """Batched generation from token ids, with in-place weight updates stamped with a policy version."""

    name: str = "base"

    def __init__(self):
        self.version = 0
        # Threads start only on first use, so engines that never call submit() pay nothing for it.
        self._submit_pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix=f"{self.name}-submit")

    @abc.abstractmethod
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Generate one continuation per prompt; ``params`` may be one for all or one per prompt."""

    @abc.abstractmethod
    def load_weights(self, state_dict: dict, version: int) -> None:
        """Replace the model weights in place (full state dict, HF names) and set ``version``. Copy the tensors:
        the weight sync reuses their memory for the next push (rapo_ray/workers/sync.py ``receive_state``)."""

    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        """Start one request and return at once; the future resolves to its ``GenerationResult``.

        This is what lets the agent loop keep every trajectory in flight on its own, each pausing at its
        own tool calls while the others decode. Default: ``generate`` on a helper thread, which suits an
        engine that merges concurrent calls into one decode batch (the torch engine); vLLM overrides it
        with its own step loop.
        """
        return self._submit_pool.submit(lambda: self.generate([list(prompt)], [params])[0])

    def release_memory(self) -> int:
        """Give back what the engine holds between rollouts that it can rebuild (its KV cache), while the learner
        that shares its device updates (colocated mode); returns the bytes freed. The next ``generate`` rebuilds
        it. Default: nothing to free."""
        return 0

    def close(self) -> None:
        """Release resources; the engine is unusable afterwards."""
        self._submit_pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _per_prompt(params, n: int) -> list[SamplingParams]:
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
        return list(params)
