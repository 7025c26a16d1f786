"""A trajectory, token-in/token-out: the prompt ids, then response segments appended exactly as produced.

``response_ids`` is the concatenation of (a) token ids the engine generated, (b) tokenized tool results,
(c) retrieved step ids. Nothing is ever re-rendered to text and re-tokenized. ``loss_mask`` is 1 only on
(a). Per-token ``logprobs``/``token_entropies`` are the engine's, 0 outside generated segments.

The five per-token fields are always numpy arrays (``TOKEN_DTYPES``); whatever is assigned to them (a list, say) is
converted on assignment. Why: a rollout batch crosses from the fleet's workers to the driver every step, and numpy
arrays cross as raw buffers, where Python lists cross and arrive element by element (docs/RESULTS.md, Performance
by component). Code that wants a list asks for one (``token_ids``, ``segment_ids``, ``.tolist()``): ``+`` on two of
these fields adds them element-wise, it does not join them.
"""

from __future__ import annotations

import copy
from array import array
from dataclasses import asdict, dataclass, field, fields

import numpy as np

# Segment kinds of a response (``Trajectory.segments`` rows are ``(kind, start, end)``, ``end`` exclusive).
GENERATED = "generated"
TOOL_RESULT = "tool_result"
RETRIEVED = "retrieved"
SEGMENT_KINDS = (GENERATED, TOOL_RESULT, RETRIEVED)
Segment = tuple[str, int, int]

# Slot kinds: sampled by the policy alone, allowed to splice retrieved steps (RAPO), forked from a parent (ARPO).
ON_POLICY, HYBRID, BRANCH = "on_policy", "hybrid", "branch"

# Per-token fields and their array types. Token ids fit int32 in every vocabulary; the mask is int32 too, not
# uint8, so that Python arithmetic on its elements (``sum``, ``1 - m``) cannot wrap; the engines' log-probs and
# entropies stay float64, so that a value is the same after the trip as the engine gave it.
TOKEN_DTYPES = {
    "prompt_ids": np.int32,
    "response_ids": np.int32,
    "loss_mask": np.int32,
    "logprobs": np.float64,
    "token_entropies": np.float64,
}


def token_array(name: str, values) -> np.ndarray:
    """``values`` as the array type of per-token field ``name``; a value that does not fit it is refused by name."""
    dtype = TOKEN_DTYPES[name]
    if isinstance(values, np.ndarray) and values.dtype == dtype and values.ndim == 1:
        return values
    try:
        out = np.asarray(values, dtype=dtype)
    except (OverflowError, TypeError, ValueError) as e:
        raise ValueError(f"Trajectory.{name}: cannot hold these values as {np.dtype(dtype).name} ({e})") from e
    if out.ndim != 1:
        raise ValueError(f"Trajectory.{name}: expected one value per token, got an array of shape {out.shape}")
    return out


def _empty(name: str):
    return lambda: np.zeros(0, dtype=TOKEN_DTYPES[name])


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


@dataclass(eq=False)
class Trajectory:
    group_id: str
    slot: int
    slot_kind: str
    problem_id: str
    task_kind: str  # "math" | "qa"
    answers: tuple
    prompt_ids: np.ndarray  # [P] int32
    question: str = ""
    response_ids: np.ndarray = field(default_factory=_empty("response_ids"))  # [L] int32
    segments: list[tuple[str, int, int]] = field(default_factory=list)
    loss_mask: np.ndarray = field(default_factory=_empty("loss_mask"))  # [L] int32
    logprobs: np.ndarray = field(default_factory=_empty("logprobs"))  # [L] float64
    token_entropies: np.ndarray = field(default_factory=_empty("token_entropies"))  # [L] float64
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

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, token_array(name, value) if name in TOKEN_DTYPES else value)

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if not (np.array_equal(a, b) if f.name in TOKEN_DTYPES else a == b):
                return False
        return True

    # ------------------------------------------------------------ building

    def append(
        self, kind: str, ids: list[int], logprobs: list[float] | None = None, entropies: list[float] | None = None
    ) -> None:
        gen = kind == GENERATED
        new = {"response_ids": token_array("response_ids", ids)}
        n = len(new["response_ids"])
        new["loss_mask"] = np.full(n, 1 if gen else 0, dtype=np.int32)
        for name, values in (("logprobs", logprobs), ("token_entropies", entropies)):
            new[name] = token_array(name, values) if gen and values is not None else np.zeros(n, TOKEN_DTYPES[name])
            if len(new[name]) != n:
                raise ValueError(f"Trajectory.append: {len(new[name])} {name} for {n} tokens")
        start = len(self.response_ids)
        self.segments.append((kind, start, start + n))
        for name, values in new.items():
            setattr(self, name, np.concatenate([getattr(self, name), values]))

    def fork(self, slot: int) -> "Trajectory":
        """ARPO branch: a copy of everything so far (the shared prefix), with its own future."""
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
        return int(self.loss_mask.sum())

    @property
    def retrieved_fraction(self) -> float:
        return self.num_retrieved_tokens / max(len(self.response_ids), 1)

    def engine_step_entropies(self) -> list[float]:
        """Mean engine entropy per generated step (exact for the torch engine, an estimate for vLLM)."""
        # summed one by one in order, as over a list: the same float as before the fields were arrays
        return [
            float(sum(self.token_entropies[s:e].tolist())) / max(e - s, 1)
            for k, s, e in self.segments
            if k == GENERATED
        ]

    def segment_ids(self, kind: str) -> list[list[int]]:
        return [self.response_ids[s:e].tolist() for k, s, e in self.segments if k == kind]

    def token_ids(self) -> list[int]:
        """Prompt then response, as the list an engine is given to continue."""
        return self.prompt_ids.tolist() + self.response_ids.tolist()

    # ------------------------------------------------------------ crossing a process boundary

    def __setstate__(self, state: dict) -> None:
        # a trajectory pickled before the per-token fields were numpy arrays holds lists (or, for a while, packed
        # ``array``s): both load as the arrays of today (a checkpoint's rollout-ahead queue)
        for k, v in state.items():
            setattr(self, k, v.tolist() if isinstance(v, array) else v)

    def to_row(self) -> dict:
        """A flat dict for Arrow/parquet (the trajectory schema of DESIGN.md)."""
        row = asdict(self)
        row.update({name: getattr(self, name).tolist() for name in TOKEN_DTYPES})
        row["answers"] = list(self.answers)
        row["segments"] = [{"kind": k, "start": s, "end": e} for k, s, e in self.segments]
        row["retrievals"] = [asdict(r) for r in self.retrievals]
        row["step_entropies_engine"] = self.engine_step_entropies()
        row["num_retrievals"] = self.num_retrievals
        row["num_retrieved_tokens"] = self.num_retrieved_tokens
        row["retrieved_fraction"] = self.retrieved_fraction
        row["num_generated_tokens"] = self.num_generated_tokens
        return row
