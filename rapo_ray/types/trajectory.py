"""A trajectory, token-in/token-out: the prompt ids, then response segments appended exactly as produced.

``response_ids`` is the concatenation of (a) token ids the engine generated, (b) tokenized tool results,
(c) retrieved step ids. Nothing is ever re-rendered to text and re-tokenized. ``loss_mask`` is 1 only on
(a). Per-token ``logprobs``/``token_entropies`` are the engine's, 0 outside generated segments.

A trajectory pickles its per-token lists as they are. Packing them into arrays for the trip was tried and measured
(docs/RESULTS.md, Performance by component): dumping cost about twice as much and loading was cheaper only at the
largest shape, so it was taken out; a pickle written while it was in (a checkpoint's rollout-ahead queue) still loads.
"""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass, field

# Segment kinds of a response (``Trajectory.segments`` rows are ``(kind, start, end)``, ``end`` exclusive).
GENERATED = "generated"
TOOL_RESULT = "tool_result"
RETRIEVED = "retrieved"
SEGMENT_KINDS = (GENERATED, TOOL_RESULT, RETRIEVED)
Segment = tuple[str, int, int]

# Slot kinds: sampled by the policy alone, allowed to splice retrieved steps (RAPO), forked from a parent (ARPO).
ON_POLICY, HYBRID, BRANCH = "on_policy", "hybrid", "branch"


@dataclass
class Task:
    """What the loop needs of a problem (bundled ``Problem`` and loader ``Example`` both adapt to it)."""

    id: str
    question: str
    answers: tuple
    kind: str = "qa"  # "math" | "qa"
    # A chat conversation ({"role", "content"} dicts) to continue instead of ``question`` (serving).
    messages: tuple = ()


@dataclass
class Retrieval:
    step_before: int  # index of the generated step just before the retrieval
    step_after: int | None  # index of the generated step right after it; None if the trajectory ended
    score: float = 0.0
    source_id: str = ""  # question id of the stored trajectory the step came from
    noise: bool = False  # replaced by a random stored step (noisy-retrieval study)


@dataclass
class Trajectory:
    group_id: str
    slot: int
    slot_kind: str
    problem_id: str
    task_kind: str  # "math" | "qa"
    answers: tuple
    prompt_ids: list[int]
    question: str = ""
    response_ids: list[int] = field(default_factory=list)
    segments: list[tuple[str, int, int]] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_entropies: list[float] = field(default_factory=list)
    entropy_is_estimate: bool = False
    retrievals: list[Retrieval] = field(default_factory=list)
    retrieval_fallbacks: int = 0  # retrieval fired but the buffer had nothing: a policy step instead
    retrieval_errors: int = 0  # retrieval fired but the service failed (RetrievalFailed): a policy step instead
    tool_calls: int = 0
    tool_errors: int = 0
    finished: bool = False
    finish_reason: str = ""
    reward: float = 0.0
    correct: bool = False
    f1: float = 0.0
    format_ok: bool = False
    answer: str | None = None
    # scored > 0 with an answer that a retrieved step showed and none of its own tool results did (answer_handed)
    answer_retrieved: bool = False
    policy_version: int = 0
    tool_time_s: float = 0.0
    parent: int | None = None  # ARPO: slot this trajectory branched from
    branch_point: int = 0  # ARPO: response position where it diverged

    # ------------------------------------------------------------ building

    def append(
        self, kind: str, ids: list[int], logprobs: list[float] | None = None, entropies: list[float] | None = None
    ) -> None:
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.segments.append((kind, start, start + len(ids)))
        gen = kind == GENERATED
        self.loss_mask.extend([1 if gen else 0] * len(ids))
        self.logprobs.extend(logprobs if gen and logprobs is not None else [0.0] * len(ids))
        self.token_entropies.extend(entropies if gen and entropies is not None else [0.0] * len(ids))

    def fork(self, slot: int) -> "Trajectory":
        """ARPO branch: a copy of everything so far (the shared prefix), with its own future."""
        import copy

        child = copy.deepcopy(self)
        child.slot, child.slot_kind, child.parent, child.branch_point = slot, BRANCH, self.slot, len(self.response_ids)
        return child

    # ------------------------------------------------------------ derived

    @property
    def num_generated_steps(self) -> int:
        return sum(1 for k, _, _ in self.segments if k == GENERATED)

    @property
    def num_retrievals(self) -> int:
        return len(self.retrievals)

    @property
    def num_retrieved_tokens(self) -> int:
        return sum(e - s for k, s, e in self.segments if k == RETRIEVED)

    @property
    def num_tool_tokens(self) -> int:
        return sum(e - s for k, s, e in self.segments if k == TOOL_RESULT)

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def retrieved_fraction(self) -> float:
        return self.num_retrieved_tokens / max(len(self.response_ids), 1)

    def engine_step_entropies(self) -> list[float]:
        """Mean engine entropy per generated step (exact for the torch engine, an estimate for vLLM)."""
        return [sum(self.token_entropies[s:e]) / max(e - s, 1) for k, s, e in self.segments if k == GENERATED]

    def segment_ids(self, kind: str) -> list[list[int]]:
        return [self.response_ids[s:e] for k, s, e in self.segments if k == kind]

    # ------------------------------------------------------------ crossing a process boundary

    def __setstate__(self, state: dict) -> None:
        # a state pickled while the per-token lists were packed holds arrays: they load as lists
        self.__dict__.update({k: (v.tolist() if isinstance(v, array) else v) for k, v in state.items()})

    def to_row(self) -> dict:
        """A flat dict for Arrow/parquet (the trajectory schema of DESIGN.md)."""
        row = asdict(self)
        row["answers"] = list(self.answers)
        row["segments"] = [{"kind": k, "start": s, "end": e} for k, s, e in self.segments]
        row["retrievals"] = [asdict(r) for r in self.retrievals]
        row["step_entropies_engine"] = self.engine_step_entropies()
        row["num_retrievals"] = self.num_retrievals
        row["num_retrieved_tokens"] = self.num_retrieved_tokens
        row["retrieved_fraction"] = self.retrieved_fraction
        row["num_generated_tokens"] = self.num_generated_tokens
        return row
