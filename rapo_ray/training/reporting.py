"""What a run reports: the step's metrics, the metrics log (metrics.jsonl and the sinks of rapo_ray/training/sinks.py),
trajectories as parquet, the progress bar, the before/after table and the curves plot."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rapo_ray.agent.evaluation import paired_change
from rapo_ray.config import Config
from rapo_ray.core.errors import DataError
from rapo_ray.core.metrics import mean_or_zero
from rapo_ray.envs.suite import family_of
from rapo_ray.training.dynamic_sampling import groups_with_signal
from rapo_ray.training.sinks import make_sinks, numeric
from rapo_ray.types.batch import TrajectoryBatch
from rapo_ray.types.trajectory import HYBRID


def step_metrics(
    step: int,
    version: int,
    batch: TrajectoryBatch,
    rollout_stats: dict,
    update_stats: dict,
    seconds: dict[str, float],
    ppo_epochs: int,
    workers: int,
) -> dict:
    """One step's metrics from its finished batch (advantages filled), the fleet's and the learners' stats,
    and the stage timings (``rollout_s``, ``old_logprob_s``, ``advantages_s``, ``update_s``, ``sync_s``, ``step_s``)."""
    trajs = batch.trajectories
    gen_tokens = sum(t.num_generated_tokens for t in trajs)
    ent_means = [sum(h) / len(h) for h in batch.step_entropies if h]
    m = {
        "step": step,
        "version": version,
        "trajectories": len(trajs),
        "groups": len(set(batch.group_ids())),
        "groups_with_signal": len(groups_with_signal(batch)),  # rewards not all equal: a non-zero outcome advantage
        "reward": mean_or_zero(t.reward for t in trajs),
        "accuracy": mean_or_zero(float(t.correct) for t in trajs),
        "format_valid": mean_or_zero(float(t.format_ok) for t in trajs),
        "hybrid_reward": mean_or_zero(t.reward for t in trajs if t.slot_kind == HYBRID),
        "on_policy_reward": mean_or_zero(t.reward for t in trajs if t.slot_kind != HYBRID),
        **{k: seconds[k] for k in ("rollout_s", "old_logprob_s", "update_s", "sync_s")},
        "generate_s": rollout_stats["generate_s"],
        "tool_s": rollout_stats["tool_s"],
        "retrieve_s": rollout_stats["retrieve_s"],
        "slowest_chunk_s": rollout_stats.get("slowest_chunk_s", 0.0),  # the straggler that rollout_s waited for
        # the fleet's process CPU seconds in the rollout (engines and agent loops); the learners' are update/cpu_s
        # and update/old_pass_cpu_s: on a shared box the phases' CPU, unlike their wall times, does not overlap
        "rollout_cpu_s": rollout_stats.get("cpu_s", 0.0),
        "rollout_tokens": sum(len(t.response_ids) for t in trajs),
        "generated_tokens": gen_tokens,
        "tool_calls": sum(t.tool_calls for t in trajs),
        "retrievals": sum(t.num_retrievals for t in trajs),
        "retrieval_fallbacks": sum(t.retrieval_fallbacks for t in trajs),
        "retrieval_errors": sum(t.retrieval_errors for t in trajs),
        "retrieved_answers": sum(t.answer_retrieved for t in trajs),  # see algo.rapo.reward_retrieved_answers
        "retrieved_token_fraction": mean_or_zero(t.retrieved_fraction for t in trajs),
        "entropy": mean_or_zero(ent_means),
        "retrieval_reward": mean_or_zero(
            float(z) for t, z in zip(trajs, batch.learner.signal.get("retrieval_reward", ())) if t.num_retrievals
        ),
        "advantages_s": seconds["advantages_s"],
        "requeued_groups": rollout_stats["requeued_groups"],
        "replaced_workers": rollout_stats["replaced_workers"],
        "workers": workers,
        **{f"update/{k}": v for k, v in update_stats.items()},
    }
    m.update(logprob_gap(batch))
    m["step_s"] = seconds["step_s"]
    m["tokens_per_s"] = gen_tokens / max(seconds["rollout_s"], 1e-9)
    # learner throughput: every sequence token goes through forward and backward once per PPO epoch
    seq_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    m["learner_tokens_per_s"] = seq_tokens * ppo_epochs / max(seconds["update_s"], 1e-9)
    return m


def logprob_gap(batch: TrajectoryBatch) -> dict:
    """How far the engine's log-probs of the tokens it sampled are from the learner's old-policy log-probs of the
    same tokens: |log pi_engine - log pi_learner| over every generated token, mean and max. Both are the same
    policy, so the gap is numerical (kernels, dtype, batching); a large one means the importance ratios of the
    update are biased, the classic silent bug of RL stacks. Empty without the old-policy pass."""
    lb = batch.learner
    if lb is None or lb.old_logprobs is None:
        return {}
    gaps = []
    for i, t in enumerate(batch.trajectories):
        s, e = lb.response_span(i)
        generated = lb.loss_mask[i, s:e].bool()
        engine = torch.tensor(t.logprobs, dtype=torch.float32)[generated]
        gaps.append((engine - lb.old_logprobs[i, s:e][generated].float()).abs())
    gap = torch.cat(gaps) if gaps else torch.zeros(0)
    if not gap.numel():
        return {"logprob_gap_mean": 0.0, "logprob_gap_max": 0.0}
    return {"logprob_gap_mean": float(gap.mean()), "logprob_gap_max": float(gap.max())}


def write_trajectories(directory: Path, step: int, batch: TrajectoryBatch) -> None:
    """``<directory>/step-NNNNNN.parquet``, written to a temporary name and renamed (never half a file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".step-{step:06d}.parquet.tmp"
    pq.write_table(pa.Table.from_pylist(batch.to_rows()), tmp)
    tmp.replace(directory / f"step-{step:06d}.parquet")


class MetricsLog:
    """Every metrics dict of a run: in memory (``history``), appended to ``metrics.jsonl``, and sent to the
    sinks ``cfg.run`` enables (TensorBoard under ``tb/``, W&B, MLflow; rapo_ray/training/sinks.py). A sink that fails
    mid-run is reported through ``log`` once and dropped; the jsonl file is the record."""

    def __init__(self, run_path: Path, cfg: Config, log=print):
        self.path = run_path / "metrics.jsonl"
        self.history: list[dict] = []
        self.sinks = make_sinks(run_path, cfg)
        self._log = log

    def log(self, m: dict) -> None:
        self.history.append(m)
        with open(self.path, "a") as f:
            f.write(json.dumps(m) + "\n")
        scalars, step = numeric(m), int(m.get("step", 0))
        for sink in list(self.sinks):
            try:
                sink.log(scalars, step)
            except Exception as exc:
                self.sinks.remove(sink)
                self._log(f"metrics sink {sink.name} failed at step {step} and is off for the rest of the run: {exc!r}")

    def rewind(self, step: int) -> int:
        """A resume from the checkpoint of ``step``: the records of later steps, logged before the run stopped and
        about to be logged again, move from ``metrics.jsonl`` to ``metrics.superseded.jsonl`` (appended: nothing
        written is lost), and the records up to ``step`` become the history again, so the curves and the summary's
        means span the whole run. A line that does not parse (a driver killed mid-write) moves too. Returns how many
        lines moved."""
        if not self.path.is_file():
            return 0
        keep, later = [], []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                later.append(line)
                continue
            (later if int(record.get("step", 0)) > step else keep).append(line)
        if later:
            with open(self.path.with_name("metrics.superseded.jsonl"), "a") as f:
                f.write("".join(x + "\n" for x in later))
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text("".join(x + "\n" for x in keep))
            tmp.replace(self.path)
        self.history = [json.loads(x) for x in keep]
        return len(later)

    def mean(self, key: str) -> float:
        return mean_or_zero(m[key] for m in self.history if key in m)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                self._log(f"metrics sink {sink.name} did not close cleanly: {exc!r}")
        self.sinks = []


def read_metrics(run_dir: Path | str, steps_only: bool = False) -> list[dict]:
    """The records of a run folder's ``metrics.jsonl`` (what ``MetricsLog`` wrote), in the order logged. A training
    step's record has ``reward`` (and the stage times); a held-out evaluation's has ``step`` and ``eval/*`` only.
    ``steps_only``: the training steps' records, the last one of each step (a step replayed after a driver resume
    logs again), by step. Raises ``DataError`` naming the file and line when the file is missing or a line does not
    parse (benchmarks and reports read runs through this one function)."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise DataError(f"{path}: cannot read the run's metrics log ({exc.strerror or exc})") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{n}: not a JSON record ({exc.msg})") from None
    if not steps_only:
        return records
    by_step = {int(r.get("step", 0)): r for r in records if "reward" in r}
    return [by_step[s] for s in sorted(by_step)]


# ---------------------------------------------------------------- held-out results


def fmt_eval(metrics: dict) -> str:
    return ", ".join(
        f"{k.split('/')[1]} {v:.3f}" for k, v in metrics.items() if k.endswith("/accuracy") and k.count("/") == 2
    )


def paired_changes(before: dict, after: dict) -> dict:
    """Per family (and "all"): problems fixed / broken by training and the sign-test p-value."""
    fams = sorted({family_of(p) for p in after})
    out = {
        f: paired_change(
            {p: c for p, c in before.items() if family_of(p) == f},
            {p: c for p, c in after.items() if family_of(p) == f},
        )
        for f in fams
    }
    out["all"] = paired_change(before, after)
    return out


def before_after_table(before: dict, after: dict, change: dict | None = None) -> str:
    """Held-out accuracy before/after per family; with ``change``: problems fixed/broken and the paired
    sign-test p-value (a gain is measurable when p is small, e.g. < 0.05)."""
    change = change or {}
    fams = sorted({k.split("/")[1] for k in after if k.count("/") == 2})
    lines = [f"{'family':12} {'before':>8} {'after':>8} {'gain':>8} {'fixed':>6} {'broken':>6} {'p':>7}"]

    def row(name, b, a, c):
        paired = f" {c['fixed']:6d} {c['broken']:6d} {c['p_value']:7.3g}" if c else ""
        lines.append(f"{name:12} {b:8.3f} {a:8.3f} {a - b:+8.3f}{paired}")

    for f in fams:
        row(f, before.get(f"eval/{f}/accuracy", 0.0), after.get(f"eval/{f}/accuracy", 0.0), change.get(f))
    row("mean", before.get("eval/mean_accuracy", 0.0), after.get("eval/mean_accuracy", 0.0), change.get("all"))
    return "\n".join(lines)


# ---------------------------------------------------------------- console and plots


class Progress:
    """A tqdm bar over the run's steps (``run.progress``), or one log line per step without it."""

    def __init__(self, enabled: bool, total: int, start: int, desc: str, log=print):
        self.log = log
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True)

    def update(self, m: dict) -> None:
        text = (
            f"reward {m['reward']:+.3f} acc {m['accuracy']:.3f} tok/s {m['tokens_per_s']:.0f} step {m['step_s']:.1f}s"
        )
        if "dynamic_sampling/groups_kept" in m:  # groups trained on / groups rolled out
            drawn = m["dynamic_sampling/groups_kept"] + m["dynamic_sampling/groups_dropped"]
            text += f" kept {m['dynamic_sampling/groups_kept']:.0f}/{drawn + m['dynamic_sampling/groups_surplus']:.0f}"
        if "eval/mean_accuracy" in m:
            text += f" eval {m['eval/mean_accuracy']:.3f}"
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(1)
        else:
            self.log(f"step {m['step']}: {text}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_curves(path: Path, history: list[dict]) -> None:
    """``curves.png``: reward and train accuracy, held-out accuracy, and step-time parts per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m for m in history if "reward" in m]
    evals = [m for m in history if "eval/mean_accuracy" in m]
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.5))
    ax[0].plot([m["step"] for m in steps], [m["reward"] for m in steps], label="reward")
    ax[0].plot([m["step"] for m in steps], [m["accuracy"] for m in steps], label="train accuracy")
    ax[0].legend()
    ax[0].set_xlabel("step")
    for k in sorted({k for m in evals for k in m if k.endswith("/accuracy") and k.count("/") == 2}):
        ax[1].plot([m["step"] for m in evals], [m.get(k, 0) for m in evals], marker="o", label=k.split("/")[1])
    ax[1].set_title("held-out accuracy")
    ax[1].legend()
    ax[1].set_xlabel("step")
    for k in ("rollout_s", "update_s", "sync_s"):
        ax[2].plot([m["step"] for m in steps], [m[k] for m in steps], label=k)
    ax[2].set_title("step time (s)")
    ax[2].legend()
    ax[2].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path / "curves.png", dpi=90)
    plt.close(fig)
