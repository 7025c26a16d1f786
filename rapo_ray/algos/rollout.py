"""What an algorithm decides during a rollout: the hooks the agent loop calls.

The agent loop (``rapo_ray.agent``) owns the turn: generate a policy step, run its tool call, append the
result. Where algorithms differ, the loop asks the rollout policy of the running algorithm:

- ``initial_slots``: the slots a group starts with, and their kinds (RAPO: the last N_hybrid are hybrid;
  ARPO: only its initial rollouts, the rest of the group comes from branching);
- ``wants_retrieval``: whether a trajectory splices a retrieved step before its next policy step (RAPO);
- ``after_tool``: whether trajectories that just got a tool result fork (ARPO);
- ``refill``: extra full samples for groups whose paths all ended before their budget was used (ARPO);
- ``settle_reward``: the final say on a scored trajectory's reward (RAPO's handed-answer switch).

``RolloutPolicy`` itself is plain on-policy group sampling (GRPO, evaluation, serving). A policy object is a
recipe; ``begin`` returns the state of one rollout call, so one policy can serve many calls.
"""

from __future__ import annotations

import random
from typing import Sequence

from rapo_ray.types.trajectory import ON_POLICY, Trajectory


class RolloutPolicy:
    """On-policy group sampling: every slot samples from the policy alone, nothing is spliced or forked."""

    # Slots per group that may splice retrieved steps. A run builds the retrieval service only when this is > 0.
    hybrid_slots: int = 0

    def begin(self, group_ids: Sequence[str], group_size: int, rng: random.Random, vocab_size: int) -> RolloutPolicy:
        """The state of one rollout over ``group_ids``; ``rng`` is the loop's, for draws that must follow its
        order. Stateless policies return themselves."""
        return self

    def initial_slots(self, group_size: int) -> list[str]:
        """The slot kinds a group starts with; slot ``k`` gets ``initial_slots(G)[k]``."""
        return [ON_POLICY] * group_size

    def wants_retrieval(self, t: Trajectory, rng: random.Random) -> bool:
        """Whether ``t`` splices a retrieved step before its next policy step. Called only when a retriever is
        attached, once per turn of a live trajectory, so draws from ``rng`` keep a fixed order."""
        return False

    def after_tool(self, trajs: list[Trajectory], just_called: Sequence[int]) -> None:
        """Called after ``trajs[i]`` (``i`` in ``just_called``) got a tool result; may append forks to ``trajs``."""

    def refill(self, trajs: Sequence[Trajectory]) -> dict[str, int]:
        """Called when no trajectory is live: full samples to add, by group id (none by default)."""
        return {}

    def settle_reward(self, t: Trajectory) -> None:
        """Called once per finished, scored trajectory; may change ``t.reward``."""


ON_POLICY_ROLLOUT = RolloutPolicy()
