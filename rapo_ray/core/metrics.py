"""Metric reduction on RLlib's ``MetricsLogger``: what each actor (rollout worker, learner rank) reports for one
call, merged on the driver; and the run's view across steps (moving means, lifetime counters, throughput).

RLlib's logger fits here because it is only a reduction library: it merges stats by each key's own rule, keeps
windows, and its state is plain JSON (saved in the trainer's checkpoint). Only the driver imports it: actors send
plain ``{key: (value, rule)}`` dicts, because importing RLlib costs every actor process 1-2 s of CPU at start.
"""

from __future__ import annotations

REDUCTIONS = ("sum", "mean", "max", "min")


def actor_stats(values: dict[str, float], reduce: dict[str, str] | None = None) -> dict[str, tuple[float, str]]:
    """One actor's numbers for one call, to send to the driver: ``{key: (value, rule)}``.

    ``reduce[key]`` says how ``merge_actor_stats`` combines the key across actors: ``sum`` (the default: times,
    counts), ``mean`` (each actor weighs the same), ``max`` or ``min``."""
    reduce = reduce or {}
    out = {}
    for key, value in values.items():
        how = reduce.get(key, "sum")
        if how not in REDUCTIONS:
            raise ValueError(f"actor_stats: reduce[{key!r}]={how!r} is not one of {REDUCTIONS}")
        out[key] = (float(value), how)
    return out


def merge_actor_stats(parts: list[dict[str, tuple[float, str]]]) -> dict[str, float]:
    """Merge ``actor_stats`` results from several actors (or several calls of one) into one flat dict: each
    part becomes one actor's reduced RLlib stats, and the root logger aggregates them by each key's rule."""
    from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

    root = MetricsLogger(root=True)
    reduced = []
    for part in parts:
        actor = MetricsLogger()
        for key, (value, how) in part.items():
            actor.log_value(key, value, reduce=how)
        reduced.append(actor.reduce())
    if reduced:
        root.aggregate(reduced)
    return {key: float(value) for key, value in root.peek().items()}


class RunMetrics:
    """The run across steps, added to each step's metrics:

    - ``<key>_mean<W>``: the mean of ``key`` over the last ``window`` steps (for the noisy per-step curves);
    - ``lifetime/<key>``: a running total (``lifetime/trajectories``, ``lifetime/generated_tokens``, ...);
    - ``lifetime/<key>_per_s``: that total's growth per wall-clock second since the trainer started or was
      restored (evaluation and checkpoint time included: the rate a user's budget sees).

    ``get_state``/``set_state`` carry windows and totals through a checkpoint (plain JSON)."""

    WINDOWED = ("reward", "accuracy", "hybrid_reward", "on_policy_reward", "entropy", "step_s")
    LIFETIME = ("trajectories", "generated_tokens", "rollout_tokens", "tool_calls", "retrievals")
    THROUGHPUT = ("trajectories", "generated_tokens")

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"RunMetrics: window must be >= 1, got {window}")
        from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

        self.window = window
        self.logger = MetricsLogger(root=True)
        self._create_totals()

    def _create_totals(self) -> None:
        # A total's throughput clock starts when its stats object is made: make them all now, at zero.
        for key in self.LIFETIME:
            if ("lifetime", key) not in self.logger:
                self.logger.log_value(
                    ("lifetime", key), 0.0, reduce="lifetime_sum", with_throughput=key in self.THROUGHPUT
                )

    def update(self, step: dict) -> dict[str, float]:
        """Log one step's metrics; return the run-level entries to add to them."""
        for key in self.WINDOWED:
            if key in step:
                self.logger.log_value(key, float(step[key]), reduce="mean", window=self.window)
        for key in self.LIFETIME:
            if key in step:
                self.logger.log_value(("lifetime", key), float(step[key]), reduce="lifetime_sum")
        out = {f"{key}_mean{self.window}": float(self.logger.peek(key)) for key in self.WINDOWED if key in self.logger}
        out.update({f"lifetime/{key}": float(self.logger.peek(("lifetime", key))) for key in self.LIFETIME})
        rates = self.logger.peek(throughput=True).get("lifetime", {})
        for key in self.THROUGHPUT:
            out[f"lifetime/{key}_per_s"] = float(rates[f"{key}_throughput"]["throughput_since_last_restore"])
        return out

    def get_state(self) -> dict:
        return {"window": self.window, "logger": self.logger.get_state()}

    def set_state(self, state: dict) -> None:
        if state.get("window") != self.window:
            # windows of another length cannot be cut or padded honestly; keep the totals, restart the windows
            kept = {k: v for k, v in state["logger"]["stats"].items() if k.startswith("lifetime")}
            self.logger.set_state({"stats": kept})
        else:
            self.logger.set_state(state["logger"])
        self._create_totals()
