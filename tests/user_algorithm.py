"""A user's own algorithm, in a module of its own (``algo.modules=[tests.user_algorithm]``): importing it registers
it. tests/unit/test_custom_algorithm.py runs it in-process; tests/ray/test_trainer.py runs it in a Ray job, where the
rollout workers import it through ``algo.modules``.

RLOO with a second chance: groups start with half their slots; when every path of a group has ended, the
other half is sampled at once (the ``refill`` hook); an answer that breaks the tag format costs -2 instead of
-1 (the ``settle_reward`` hook); the advantage is reward minus the mean reward of the rest of the group
(REINFORCE leave-one-out). ``rloo-ramp`` is the same with an output per token: the row's advantage times
(t + 1) / L over its L response tokens, so later tokens carry more of it (a per-token output needs nothing outside
this file: the loss takes an advantage per row or per token)."""

from __future__ import annotations

from rapo_ray.algos.registry import Algorithm, algorithm_names, register
from rapo_ray.algos.rollout import RolloutPolicy
from rapo_ray.core.errors import ConfigError
from rapo_ray.types.trajectory import ON_POLICY


class SecondChanceRollout(RolloutPolicy):
    def begin(self, group_ids, group_size, rng, vocab_size):
        run = SecondChanceRollout()
        run.owed = {gid: group_size - group_size // 2 for gid in group_ids}
        run.group_size = group_size
        return run

    def initial_slots(self, group_size):
        return [ON_POLICY] * (group_size // 2)

    def refill(self, trajs):
        out, self.owed = {gid: n for gid, n in self.owed.items() if n > 0}, {}
        return out

    def settle_reward(self, t):
        if not t.format_ok:
            t.reward = -2.0


def rloo_advantages(columns: dict, algo_cfg) -> dict:
    """A_i = r_i - mean_{j != i, same group} r_j; no retrieval reward, no shaping."""
    by_group: dict[str, list[float]] = {}
    for gid, r in zip(columns["group_id"], columns["reward"]):
        by_group.setdefault(gid, []).append(r)
    adv = []
    for gid, r in zip(columns["group_id"], columns["reward"]):
        rest = by_group[gid]
        adv.append(r - (sum(rest) - r) / (len(rest) - 1) if len(rest) > 1 else 0.0)
    return {"row": list(columns["row"]), "advantage": adv}


def _validate(algo_cfg) -> None:
    if algo_cfg.group_size < 2:
        raise ConfigError(f"algo.group_size ({algo_cfg.group_size}) must be >= 2 for a leave-one-out baseline")


def _second_chance_rollout(algo_cfg) -> SecondChanceRollout:
    return SecondChanceRollout()


def ramped_rloo_advantages(columns: dict, algo_cfg) -> dict:
    """Per token: A_i (t + 1) / L_i for each of row i's L_i response tokens."""
    out = rloo_advantages(columns, algo_cfg)
    lengths = columns["num_response_tokens"]
    out["advantage"] = [[a * (t + 1) / n for t in range(n)] for a, n in zip(out["advantage"], lengths)]
    return out


RLOO_SECOND_CHANCE = Algorithm(
    "rloo-second-chance", advantages=rloo_advantages, rollout=_second_chance_rollout, validate=_validate
)
RLOO_RAMP = Algorithm(
    "rloo-ramp",
    advantages=ramped_rloo_advantages,
    rollout=_second_chance_rollout,
    validate=_validate,
    per_token=("advantage",),
)
for _algorithm in (RLOO_SECOND_CHANCE, RLOO_RAMP):
    if _algorithm.name not in algorithm_names():  # importing the module registers them, once per process
        register(_algorithm)
