"""Whether a step needs the learners' old-policy pass, or the update's own forward can stand in for it.

PPO's ratio is pi_theta / pi_old, with pi_old the policy before the update. When the update makes exactly one
optimizer step over the step's rows (one epoch, one mini-batch), the update's first and only forward runs at pi_old:
a separate no-grad pass computes the same log-probs again, up to float rounding. The update then uses its own
log-probs, detached, as pi_old (ratio 1, the clip inactive; the gradient is A * grad log pi, as with the pass) and
hands them back, with the full-vocabulary entropies, for the metrics (``logprob_gap_*``, ``entropy``). TRL's
GRPOTrainer skips the pass in the same case.

Rows rolled out ahead (``algo.max_staleness >= 1``) do not change this. The pass never ran at the weights that
sampled them: it runs at the learners' current weights, the proximal pi_old of the decoupled objective, just before
the update, as the update's own forward does. The sampling (behaviour) policy's log-probs are the engine's, recorded
with each token, and the behaviour correction (rapo_ray/algos/loss.py) weighs by pi_old / pi_behaviour with either
source of pi_old alike (tests/ray/test_workers.py checks loss, gradients and weights with stale rows).

The pass still runs when anything reads its values before the update (RAPO's retrieval reward reads the step
entropies), or when the update's forward would not be at pi_old (several epochs or mini-batches: every optimizer
step after the first), or with the streaming_split feed, where rows reach the ranks dynamically and could not be put
back in order.
"""

from __future__ import annotations

from rapo_ray.algos.registry import Algorithm


def one_update_reason(cfg, rows: int) -> str | None:
    """Why the update of a step of ``rows`` trajectories under ``cfg`` is not exactly one optimizer step over all of
    them, in row order, on the driver feed; None when it is (only then can its forward stand in for the pass)."""
    lc = cfg.learner
    if lc.ppo_epochs > 1:
        return f"learner.ppo_epochs={lc.ppo_epochs}: the later epochs' ratios are against the policy before the first"
    if rows > lc.mini_batch_size:
        return (
            f"{rows} rows in mini-batches of learner.mini_batch_size={lc.mini_batch_size}: the later mini-batches' "
            "ratios are against the policy before the first"
        )
    if cfg.trainer.learner_feed != "driver":
        return f"trainer.learner_feed={cfg.trainer.learner_feed}: rows reach the ranks dynamically"
    return None


def old_pass_reason(cfg, rows: int, algorithm: Algorithm) -> str | None:
    """Why a step of ``rows`` trajectories needs the separate old-policy pass under ``cfg`` (the run's Config);
    None when the update's own forward gives the same values (the pass is redundant and is skipped)."""
    if not cfg.learner.skip_redundant_old_pass:
        return "learner.skip_redundant_old_pass is off"
    if algorithm.reads_step_entropies(cfg.algo):
        return f"{algorithm.name}'s estimator reads the old policy's step entropies before the update"
    return one_update_reason(cfg, rows)
