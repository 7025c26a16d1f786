"""The step retriever the hybrid rollout asks for an off-policy step (spec §2, Eq. 3), and ``steps_of``, which
splits a trajectory into the (history, next step) pairs a buffer stores.

``StepRetriever.retrieve(queries)`` returns, per query, the best stored step or None (empty buffer). The
query is the on-policy history after the system prompt (question + steps so far); only its last
``max_chars`` characters are used, as in the RAPO authors' index code. The production retriever is the
Milvus-backed Ray Serve deployment (rapo_ray.retrieval); ``InMemoryStepRetriever`` serves tests and small
runs with the same semantics (top-1 by inner product, optional noise, optional same-question exclusion).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from rapo_ray.types.trajectory import GENERATED, Trajectory


@dataclass
class StoredStep:
    key: str  # history text before the step
    value: str  # the step's text (thought + call + result)
    value_ids: list[int] = field(default_factory=list)  # its token ids, inserted verbatim
    reward: float = 0.0
    question_id: str = ""
    step_index: int = 0
    source: str = ""


@dataclass
class RetrievedStep:
    value: str
    value_ids: list[int]
    score: float
    reward: float = 0.0
    question_id: str = ""
    noise: bool = False


class StepRetriever(Protocol):
    """``retrieve`` may raise ``RetrievalFailed``; any other exception is a bug and ends the rollout."""

    def retrieve(
        self, queries: Sequence[str], question_ids: Sequence[str] | None = None
    ) -> list[RetrievedStep | None]: ...


QUESTION_SCOPES = ("any", "other", "own")


def question_filter(scope: str, question_ids, n: int) -> list[tuple[str, str]] | None:
    """Per-query filter for a retrieval scope: "any" -> None (no filter); "other" -> skip the querying
    question's own steps; "own" -> only its own steps. Needs the querying question ids unless "any"."""
    if scope not in QUESTION_SCOPES:
        raise ValueError(f"retrieval question scope {scope!r}; valid: {', '.join(QUESTION_SCOPES)}")
    if scope == "any" or question_ids is None:
        return None
    if len(question_ids) != n:
        raise ValueError(f"{len(question_ids)} question ids for {n} queries")
    return [(scope, q) if q else None for q in question_ids]


def query_text(question: str, history: str, max_chars: int = 1300) -> str:
    """The text a retrieval query (or a stored step's key) embeds for the state "``question``, then
    ``history``": the last ``max_chars`` characters of both (the paper's S_<t, cut as in the RAPO authors' index
    code). Cheaper forms (the last step only, an incremental embedding) were measured against it and lose too
    many neighbours: ``benchmarks/bench_query_forms.py``, docs/RESULTS.md, Performance."""
    return (question + history)[-max_chars:]


def hashing_embedder(dim: int = 256) -> Callable[[Sequence[str]], np.ndarray]:
    """A dependency-free text embedder (character trigram hashing, L2-normalised) for tests and tiny runs."""

    def embed(texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), dim), dtype=np.float32)
        for i, t in enumerate(texts):
            t = f"  {t.lower()}  "
            for j in range(len(t) - 2):
                out[i, zlib.crc32(t[j : j + 3].encode()) % dim] += 1.0
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)

    return embed


class InMemoryStepRetriever:
    """Brute-force inner-product search over embedded keys."""

    def __init__(
        self,
        steps: Sequence[StoredStep],
        embed: Callable[[Sequence[str]], np.ndarray] | None = None,
        max_chars: int = 1300,
        noise_prob: float = 0.0,
        question_scope: str = "any",
        seed: int = 0,
    ):
        self.steps = list(steps)
        self.embed = embed or hashing_embedder()
        self.max_chars = max_chars
        self.noise_prob = noise_prob
        self.question_scope = question_scope
        self.rng = random.Random(seed)
        self.keys = self.embed([query_text("", s.key, max_chars) for s in self.steps]) if self.steps else None

    def retrieve(self, queries, question_ids=None):
        if not self.steps:
            return [None] * len(queries)
        q = self.embed([query_text("", x, self.max_chars) for x in queries])
        scores = q @ self.keys.T
        out = []
        filters = question_filter(self.question_scope, question_ids, len(queries)) or [None] * len(queries)
        for i in range(len(queries)):
            row = scores[i].copy()
            if filters[i] is not None:
                scope, qid = filters[i]
                for j, s in enumerate(self.steps):
                    if (s.question_id == qid) == (scope == "other"):
                        row[j] = -np.inf
            if not np.isfinite(row).any():
                out.append(None)
                continue
            j = int(np.argmax(row))
            noise = self.rng.random() < self.noise_prob
            if noise:
                j = self.rng.randrange(len(self.steps))
            s = self.steps[j]
            out.append(RetrievedStep(s.value, list(s.value_ids), float(row[j]), s.reward, s.question_id, noise))
        return out


def steps_of(tokenizer, traj: Trajectory, source: str = "expert") -> list[StoredStep]:
    """Split a trajectory into (key = history before the step, value = the step) pairs; answer steps and
    retrieved blocks are excluded (spec §8.3)."""
    out, history_ids = [], []
    segs = traj.segments
    for k, (kind, s, e) in enumerate(segs):
        ids = traj.response_ids[s:e].tolist()
        if kind == GENERATED:
            next_is_result = k + 1 < len(segs) and segs[k + 1][0] == "tool_result"
            if not next_is_result:  # an answer step or a truncated one: not stored
                history_ids += ids
                continue
            rs, re_ = segs[k + 1][1], segs[k + 1][2]
            value_ids = ids + traj.response_ids[rs:re_].tolist()
            key = traj.question + tokenizer.decode(history_ids, skip_special_tokens=False)
            out.append(
                StoredStep(
                    key=key,
                    value=tokenizer.decode(value_ids, skip_special_tokens=False),
                    value_ids=value_ids,
                    reward=traj.reward,
                    question_id=traj.problem_id,
                    step_index=len(out),
                    source=source,
                )
            )
        if kind != "retrieved":
            history_ids += ids
    return out
