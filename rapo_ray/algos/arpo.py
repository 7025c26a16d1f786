"""ARPO (arXiv 2507.19849): entropy-guided branching after tool calls and advantage attribution.

Spec section 7. The branching rule follows ARPO's code: after a tool result, the entropy of the first k
generated tokens is compared with the rollout's initial entropy, and the node branches with probability
``clamp(tau + beta * dH, 0, 1)``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Sequence

from rapo_ray.algos.rollout import RolloutPolicy
from rapo_ray.core.options import option
from rapo_ray.types.trajectory import GENERATED, ON_POLICY, Trajectory


@dataclass
class ArpoConfig:
    """ARPO's section, ``algo.arpo``: entropy-guided branching after tool calls."""

    initial_rollouts: int = option(8, "N full samples per prompt; the rest of the group comes from branching.")
    beam_size: int = option(2, "Branches per source per round + 1.")
    branch_prob: float = option(0.5, "tau, base branch probability.")
    entropy_weight: float = option(0.2, "beta, weight of the entropy change.")
    entropy_tokens: int = option(20, "Entropy over the first k tokens after a tool result.")


def normalized_segment_entropy(
    token_entropy: Sequence[float], first_k: int = 20, vocab_size: int | None = None
) -> float:
    """ARPO's entropy of a generation segment: the sum of the first ``min(k, len)`` token entropies,
    divided by ``log(vocab_size)`` when given (ARPO's normalisation). Returns 0.0 for an empty segment."""
    head = list(token_entropy)[:first_k]
    total = float(sum(head))
    if vocab_size:
        total /= math.log(vocab_size)
    return total


def branch_probability(entropy_delta: float, tau: float = 0.5, beta: float = 0.2) -> float:
    """P_branch = clamp(tau + beta * dH, 0, 1), with dH = H_now - H_initial."""
    return min(1.0, max(0.0, tau + beta * entropy_delta))


def should_branch(entropy_delta: float, u: float, tau: float = 0.5, beta: float = 0.2) -> bool:
    """ARPO's decision for a uniform draw ``u``: branch iff ``clamp(u - beta dH, 0, 1) <= tau``.

    Equivalent to ``u <= tau + beta dH`` for u in [0, 1), i.e. branching with ``branch_probability``.
    """
    return min(1.0, max(0.0, u - beta * entropy_delta)) <= tau


@dataclass
class BranchBudget:
    """Per-prompt slot bookkeeping: M total trajectories, N sampled from scratch, the rest by branching.

    Each source trajectory may create at most ``beam_size - 1`` branches per round (ARPO's code).
    """

    total: int  # M
    initial: int  # N
    beam_size: int = 2
    branches: int = 0
    extra_full: int = 0  # full samples added when every path ended before the budget was used

    def __post_init__(self):
        if not (1 <= self.initial <= self.total):
            raise ValueError(f"need 1 <= initial ({self.initial}) <= total ({self.total})")
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {self.beam_size}")

    @property
    def used(self) -> int:
        return self.initial + self.branches + self.extra_full

    @property
    def remaining(self) -> int:
        return self.total - self.used

    def allocate(self, candidates: Sequence[int], decide) -> list[int]:
        """One branching round.

        Args:
            candidates: ids of active trajectories that just received a tool result, in order.
            decide: callable(candidate_id) -> bool, the entropy-guided decision for that node.

        Returns:
            The source id of each new branch (a source may appear up to ``beam_size - 1`` times). Never
            exceeds ``remaining``.
        """
        sources: list[int] = []
        for cand in candidates:
            for _ in range(self.beam_size - 1):
                if self.remaining <= 0:
                    return sources
                if decide(cand):
                    sources.append(cand)
                    self.branches += 1
        return sources

    def fill_with_full_samples(self) -> int:
        """When every path has ended, the rest of the budget is filled with full trajectories."""
        n = self.remaining
        self.extra_full += n
        return n


@dataclass
class EntropyBrancher:
    """Stateful decision maker for one rollout batch: remembers each rollout's initial entropy.

    Unlike ARPO's code (whose dict of initial entropies is never cleared across batches, spec §7), a
    new ``EntropyBrancher`` is made per batch.
    """

    tau: float = 0.5
    beta: float = 0.2
    rng: random.Random = field(default_factory=random.Random)
    initial: dict = field(default_factory=dict)

    def set_initial(self, rollout_id, entropy: float) -> None:
        self.initial.setdefault(rollout_id, entropy)

    def decide(self, rollout_id, entropy_now: float) -> bool:
        delta = entropy_now - self.initial.get(rollout_id, entropy_now)
        return should_branch(delta, self.rng.random(), self.tau, self.beta)


class BranchingRollout(RolloutPolicy):
    """ARPO's rollout: each group starts ``initial`` trajectories; after every tool result a trajectory forks
    (up to ``beam_size - 1`` times) with ``branch_probability`` of the entropy change of its latest step,
    until the group holds ``group_size`` trajectories. Groups whose paths all end early are refilled with
    full samples."""

    def __init__(self, initial: int, beam_size: int = 2, tau: float = 0.5, beta: float = 0.2, entropy_tokens: int = 20):
        self.initial, self.beam_size, self.tau, self.beta = initial, beam_size, tau, beta
        self.entropy_tokens = entropy_tokens

    def begin(self, group_ids, group_size, rng, vocab_size) -> RolloutPolicy:
        budgets = {
            gid: BranchBudget(total=group_size, initial=self.initial, beam_size=self.beam_size) for gid in group_ids
        }
        return _BranchingRun(self, budgets, EntropyBrancher(self.tau, self.beta, rng), vocab_size)

    def initial_slots(self, group_size: int) -> list[str]:
        return [ON_POLICY] * self.initial


class _BranchingRun(BranchingRollout):
    """The state of one ARPO rollout: each group's budget and the rollouts' initial entropies."""

    def __init__(self, recipe: BranchingRollout, budgets: dict, brancher: EntropyBrancher, vocab_size: int):
        super().__init__(recipe.initial, recipe.beam_size, recipe.tau, recipe.beta, recipe.entropy_tokens)
        self.budgets, self.brancher, self.vocab_size = budgets, brancher, vocab_size

    def after_tool(self, trajs: list[Trajectory], just_called: Sequence[int]) -> None:
        # The entropy of the first k tokens of the step that followed the tool result, against the rollout's
        # initial entropy (its first step's); a branch shares its root's initial entropy.
        k = self.entropy_tokens
        for i in just_called:
            t = trajs[i]
            if t.finished:
                continue
            steps = [(s, e) for kind, s, e in t.segments if kind == GENERATED]
            key = (t.group_id, t.slot if t.parent is None else t.parent)
            first = normalized_segment_entropy(t.token_entropies[steps[0][0] : steps[0][1]], k, self.vocab_size)
            self.brancher.set_initial(key, first)
            s, e = steps[-1]
            now = normalized_segment_entropy(t.token_entropies[s:e], k, self.vocab_size)
            for _ in self.budgets[t.group_id].allocate([i], lambda _i: self.brancher.decide(key, now)):
                trajs.append(t.fork(slot=max(x.slot for x in trajs if x.group_id == t.group_id) + 1))

    def refill(self, trajs: Sequence[Trajectory]) -> dict[str, int]:
        return {gid: n for gid, budget in self.budgets.items() if (n := budget.fill_with_full_samples()) > 0}
