"""Metrics: what each actor (rollout worker, learner rank) reports for one call, merged on the driver; and the run's
view across steps (moving means, lifetime counters, throughput) on RLlib's ``MetricsLogger``.

Actors send plain ``{key: (value, rule)}`` dicts, merged here by each key's rule in plain Python, which stays cheap
when a fleet of 1,000 workers reports every step (a ``MetricsLogger`` per report did not). The run's view uses
RLlib's logger because it is only a reduction library there: it keeps windows and throughput clocks, and its state is
plain JSON (saved in the trainer's checkpoint). Only the driver imports it: importing RLlib costs every actor process
1-2 s of CPU at start.
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import time

# How a key reported by several actors is combined (``actor_stats``' ``reduce``).
REDUCERS = {"sum": math.fsum, "mean": lambda xs: math.fsum(xs) / len(xs), "max": max, "min": min}
REDUCTIONS = tuple(REDUCERS)


def mean_or_zero(xs) -> float:
    """The mean of an iterable of numbers; 0.0 when it is empty (a step with no hybrid slot, no retrieval, ...)."""
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else 0.0


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
    """Merge ``actor_stats`` results from several actors (or several calls of one) into one flat dict, each key by
    its rule: ``sum``, ``mean`` (over the parts that report the key, each weighing the same), ``max`` or ``min``."""
    values: dict[str, list[float]] = {}
    rules: dict[str, str] = {}
    for part in parts:
        for key, (value, how) in part.items():
            if rules.setdefault(key, how) != how:
                raise ValueError(
                    f"merge_actor_stats: {key!r} is reduced by {rules[key]!r} in one part, {how!r} in another"
                )
            values.setdefault(key, []).append(value)
    return {key: float(REDUCERS[rules[key]](xs)) for key, xs in values.items()}


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


@contextlib.contextmanager
def gc_clock():
    """Yields ``[CPU seconds, collections, CPU seconds per generation]`` of Python's garbage collector in this process
    (on whichever thread it ran) while inside: what the driver's collections cost the benchmarks that time it."""
    total = [0.0, 0, [0.0, 0.0, 0.0]]
    started: dict = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[threading.get_ident()] = time.thread_time()
        elif threading.get_ident() in started:
            seconds = time.thread_time() - started.pop(threading.get_ident())
            total[0] += seconds
            total[1] += 1
            total[2][info["generation"]] += seconds

    gc.callbacks.append(on_gc)
    try:
        yield total
    finally:
        gc.callbacks.remove(on_gc)


class StageTimer:
    """Wall seconds per named stage, in the order the stages first ran (a stage entered twice adds up): a run's
    start-up as one line, ``start-up 41.2 s: ray 4.8 s, starting policy 0.1 s, ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def line(self, title: str) -> str:
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())
        return f"{title} {sum(self.seconds.values()):.1f} s: {parts}"
