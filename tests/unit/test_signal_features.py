"""The learning-signal features against hand-computed values: dynamic sampling (the filter, the refill rounds, the
cap, the fallback) alone and inside ``Trainer``'s rollout stage, the pass-rate prompt pool, the learning-rate
schedule, the GSM8K calculator-step filter and the pass@k benchmark's estimators."""

from __future__ import annotations

import json
import random
from math import comb
from pathlib import Path

import numpy as np
import pytest

from rapo_ray.algos.lr_schedule import lr_factor
from rapo_ray.config import load_config
from rapo_ray.core.errors import ConfigError, DataError
from rapo_ray.envs.loaders import calc_note_count, gsm8k_solutions, load_examples
from rapo_ray.training.dynamic_sampling import dynamic_sample, groups_with_signal
from rapo_ray.training.prompt_pool import PromptPool
from rapo_ray.training.trainer import Trainer
from rapo_ray.types.batch import TrajectoryBatch
from rapo_ray.types.trajectory import Task, Trajectory
from tests.helpers import benchmark_module

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _traj(gid: str, reward: float) -> Trajectory:
    return Trajectory(
        gid, 0, "on_policy", gid, "math", ("1",), np.zeros(2, np.int32), reward=reward, correct=reward > 0
    )


def _batch(rewards_by_group: dict[str, list[float]]) -> TrajectoryBatch:
    return TrajectoryBatch([_traj(g, r) for g, rs in rewards_by_group.items() for r in rs])


# ---------------------------------------------------------------- dynamic sampling


def test_groups_with_signal_are_those_whose_rewards_differ():
    batch = _batch({"a": [1, 0, 0], "b": [0, 0, 0], "c": [1, 1, 1], "d": [1], "e": [-1, 0, -1]})
    assert groups_with_signal(batch) == {"a", "e"}


class ScriptedRollOut:
    """A fleet stand-in: group k's rewards are ``rewards[k]`` (groups numbered across rounds); records each call."""

    def __init__(self, rewards: list[list[float]]):
        self.rewards, self.calls = rewards, []

    def __call__(self, n: int, first: int):
        self.calls.append((n, first))
        groups = [(f"g{k}", Task(f"t{k}", "q", ("1",))) for k in range(first, first + n)]
        batch = _batch({gid: self.rewards[int(gid[1:])] for gid, _ in groups})
        return groups, batch, {"generate_s": 1.0, "rollouts": float(len(batch))}


def test_dynamic_sampling_drops_groups_without_signal_and_refills_them():
    # 4 groups drawn, 1 with signal (rate 1/4): the refill draws ceil(3 / 0.25) = 12, capped at 3 x 4 - 4 = 8;
    # of g4..g11, g5 g6 g9 g11 have signal: g5 g6 g9 fill the step, g11 is surplus
    flat, mixed = [0.0, 0.0], [1.0, 0.0]
    rewards = [flat, mixed, flat, flat, flat, mixed, mixed, flat, flat, mixed, flat, mixed]
    roll = ScriptedRollOut(rewards)
    groups, batch, stats = dynamic_sample(4, 3.0, roll)
    assert roll.calls == [(4, 0), (8, 4)]
    assert [g for g, _ in groups] == ["g1", "g5", "g6", "g9"]
    assert batch.group_ids() == ["g1", "g1", "g5", "g5", "g6", "g6", "g9", "g9"]
    assert stats["dynamic_sampling/groups_kept"] == 4
    assert stats["dynamic_sampling/groups_dropped"] == 3 + 4  # g0 g2 g3, then g4 g7 g8 g10
    assert stats["dynamic_sampling/groups_surplus"] == 1
    assert stats["dynamic_sampling/extra_rollouts"] == 16  # 8 refill groups x 2 rollouts
    assert stats["dynamic_sampling/refill_rounds"] == 1 and stats["dynamic_sampling/no_signal"] == 0
    assert stats["generate_s"] == 2.0 and stats["rollouts"] == 24  # both rounds' fleet stats, added


def test_dynamic_sampling_stops_at_its_cap_and_trains_on_what_it_kept():
    flat, mixed = [1.0, 1.0], [1.0, 0.0]
    roll = ScriptedRollOut([flat, mixed, flat, flat] + [flat] * 4)
    groups, batch, stats = dynamic_sample(4, 1.5, roll)  # cap: ceil(1.5 x 4) = 6 groups in all
    assert roll.calls == [(4, 0), (2, 4)]
    assert [g for g, _ in groups] == ["g1"] and len(batch) == 2
    assert stats["dynamic_sampling/groups_kept"] == 1 and stats["dynamic_sampling/groups_dropped"] == 5


def test_a_step_without_any_signal_trains_on_its_first_draw_and_says_so():
    roll = ScriptedRollOut([[0.0, 0.0]] * 8)
    groups, batch, stats = dynamic_sample(2, 2.0, roll)
    assert roll.calls == [(2, 0), (2, 2)]
    assert [g for g, _ in groups] == ["g0", "g1"] and batch.group_ids() == ["g0", "g0", "g1", "g1"]
    assert stats["dynamic_sampling/no_signal"] == 1 and stats["dynamic_sampling/groups_kept"] == 0


def test_budget_one_drops_without_refilling_and_bad_budgets_are_refused():
    roll = ScriptedRollOut([[0.0, 1.0], [0.0, 0.0]])
    groups, _, stats = dynamic_sample(2, 1.0, roll)
    assert roll.calls == [(2, 0)] and [g for g, _ in groups] == ["g0"] and stats["dynamic_sampling/refill_rounds"] == 0
    with pytest.raises(ValueError, match="dynamic_sampling_budget"):
        dynamic_sample(2, 0.5, roll)
    with pytest.raises(ConfigError, match=r"trainer.dynamic_sampling_budget \(0.5\)"):
        load_config(None, ["trainer.dynamic_sampling_budget=0.5"])


class FakeFleet:
    """``RolloutFleet.run_step``'s contract: a task is solved by half its group when its id is in ``mixed``."""

    def __init__(self, mixed: set[str]):
        self.mixed, self.calls = mixed, []

    def run_step(self, groups, group_size, seed):
        self.calls.append([gid for gid, _ in groups])
        trajs = []
        for gid, task in groups:
            for s in range(group_size):
                r = float(s % 2 == 0) if task.id in self.mixed else 0.0
                trajs.append(_traj(gid, r))
        return TrajectoryBatch(trajs), {"generate_s": 0.5, "requeued_groups": 0, "replaced_workers": 0}


def _trainer(overrides: list[str], tasks: list[Task], fleet: FakeFleet) -> Trainer:
    """A Trainer with only what its rollout stage reads (no Ray, no learners)."""
    cfg = load_config(None, ["algo.name=grpo", "algo.group_size=4", "trainer.prompts_per_step=2", *overrides])
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.train_tasks, trainer.fleet = cfg, {"fam": tasks}, fleet
    trainer.rng = random.Random(cfg.trainer.seed)
    trainer.prompt_pool = PromptPool() if cfg.trainer.prompt_sampling == "pass_rate" else None
    return trainer


def test_the_trainer_rolls_out_refills_with_the_steps_numbering_and_keeps_only_groups_with_signal():
    tasks = [Task(f"t{i}", "q", ("1",), "math") for i in range(20)]
    fleet = FakeFleet(mixed={f"t{i}" for i in range(0, 20, 3)})
    ahead = _trainer(["trainer.dynamic_sampling=true"], tasks, fleet)._roll_out(5)
    assert len(ahead.groups) == 2 and all(task.id in fleet.mixed for _, task in ahead.groups)
    assert len(fleet.calls) >= 2 and fleet.calls[1][0].startswith("s5-g2-")  # refills continue the numbering
    assert ahead.stats["dynamic_sampling/groups_kept"] == 2 and ahead.batch.group_ids()[0] == ahead.groups[0][0]
    # without the feature, the same draws are trained on whether or not they carry signal
    plain = _trainer([], tasks, FakeFleet(mixed=fleet.mixed))._roll_out(5)
    assert [g for g, _ in plain.groups] == fleet.calls[0] and "dynamic_sampling/groups_kept" not in plain.stats


# ---------------------------------------------------------------- the prompt pool


def test_prompt_pool_weights_favour_prompts_of_middling_pass_rate():
    pool = PromptPool()
    tasks = [Task(t, "q", ("1",)) for t in ("unseen", "never", "half", "always")]
    pool.observe(
        _batch({"g1": [0] * 6, "g2": [1, 0, 1, 0, 1, 0], "g3": [1] * 6}),
        {"g1": tasks[1], "g2": tasks[2], "g3": tasks[3]},
    )
    assert pool.pass_rate("never") == pytest.approx(1 / 8) and pool.pass_rate("half") == pytest.approx(0.5)
    assert pool.weights(tasks) == pytest.approx([0.25, 7 / 64, 0.25, 7 / 64])
    assert pool.metrics() == {
        "prompt_pool/seen": 3.0,
        "prompt_pool/never_solved": 1.0,
        "prompt_pool/always_solved": 1.0,
        "prompt_pool/mean_pass_rate": pytest.approx(0.5),
    }
    again = PromptPool()
    again.set_state(json.loads(json.dumps(pool.get_state())))  # as trainer_state.json stores it
    assert again.weights(tasks) == pool.weights(tasks)
    with pytest.raises(ValueError, match="prompt 'x' has counts"):
        again.set_state({"x": [3, 2]})


def test_the_trainer_draws_by_the_pool_and_counts_every_rollout():
    tasks = [Task(f"t{i}", "q", ("1",), "math") for i in range(4)]
    trainer = _trainer(["trainer.prompt_sampling=pass_rate"], tasks, FakeFleet(mixed={"t3"}))
    trainer.prompt_pool.set_state({"t0": [0, 400], "t1": [0, 400], "t2": [400, 400]})  # t3 unseen: p = 1/2
    drawn = [task.id for _, task in trainer._sample_groups(200, 0)]
    assert drawn.count("t3") > 190  # weight 0.25 against ~0.0025 each
    uniform = _trainer([], tasks, FakeFleet(mixed=set()))
    assert [task.id for _, task in uniform._sample_groups(200, 0)].count("t3") < 80
    trainer._roll_out(0)
    assert sum(n for _, n in trainer.prompt_pool.counts.values()) == 1200 + 2 * 4


# ---------------------------------------------------------------- the learning-rate schedule


def test_lr_factor_by_hand():
    assert [lr_factor(s, 10, 4, "constant") for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # decay after a warm-up of 4 over the 6 steps left: progress (s - 4) / 6
    assert lr_factor(7, 10, 4, "linear") == pytest.approx(0.5)
    assert lr_factor(7, 10, 4, "cosine") == pytest.approx(0.5)
    assert lr_factor(5, 10, 4, "cosine") == pytest.approx(0.5 * (1 + np.cos(np.pi / 6)))
    assert lr_factor(10, 10, 4, "linear", min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(99, 10, 0, "cosine", min_ratio=0.2) == pytest.approx(0.2)  # past the end: the floor
    assert lr_factor(0, 10, 0, "cosine") == 1.0 and lr_factor(0, 10, 0, "linear") == 1.0
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_factor(0, 10, 0, "step")
    with pytest.raises(ConfigError, match=r"learner.lr_min_ratio \(1.5\)"):
        load_config(None, ["learner.lr_min_ratio=1.5"])


# ---------------------------------------------------------------- GSM8K by calculator steps


def test_calc_steps_keeps_rows_by_their_calculator_notes(tmp_path):
    rows = [
        {"question": "q0", "answer": "no notes\n#### 3"},
        {"question": "q1", "answer": "a <<1+2=3>> b\n#### 3"},
        {"question": "q2", "answer": "<<1+2=3>> then <<3*2=6>>\n#### 6"},
        {"question": "q3", "answer": "<<1+1=2>><<2+1=3>><<3+1=4>>\n#### 4"},
    ]
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [calc_note_count(r["answer"]) for r in rows] == [0, 1, 2, 3]
    kept, report = load_examples(f, calc_steps=(1, 2))
    assert [e.question for e in kept] == ["q1", "q2"] and (report.loaded, report.filtered) == (2, 2)
    assert [e.question for e in load_examples(f, calc_steps=(1, 2, 3), limit=2)[0]] == ["q1", "q2"]
    solved = gsm8k_solutions(f, None, (2, 3))
    assert [(e.question, r.count("<<")) for e, r in solved] == [("q2", 2), ("q3", 3)]
    # the same examples (ids by place in the whole file) as load_examples gives, and limit counts the rows kept
    assert [e for e, _ in solved] == load_examples(f, calc_steps=(2, 3))[0]
    assert [e.id for e, _ in gsm8k_solutions(f, 1, (2, 3))] == [solved[0][0].id] and solved[0][0].id.endswith("-2")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "42"}) + "\n")
    load_examples(bad)  # a plain answer is fine without the filter
    with pytest.raises(DataError, match=r"bad.jsonl: row 0: field 'answer' is not a GSM8K rationale"):
        load_examples(bad, calc_steps=(1,))
    with pytest.raises(DataError, match=r"bad.jsonl: row 0: field 'answer' is not a GSM8K rationale"):
        gsm8k_solutions(bad, None)
    with pytest.raises(ConfigError, match="tasks.calc_steps"):
        load_config(None, ["tasks.calc_steps=[-1]"])


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is not beside the checkout")
def test_gsm8k_test_split_by_calculator_notes():
    kept, report = load_examples(SHARED / "eval" / "gsm8k" / "test.jsonl", calc_steps=(1, 2))
    assert (len(kept), report.filtered) == (422, 1319 - 422)
    everything = {e.id: e for e in load_examples(SHARED / "eval" / "gsm8k" / "test.jsonl")[0]}
    assert all(everything[e.id] == e for e in kept)  # each kept row has the id it has without the filter


# ---------------------------------------------------------------- benchmarks/pass_at_k.py


def test_pass_at_k_estimators_by_hand():
    pk = benchmark_module("pass_at_k")
    assert pk.unbiased_pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pk.unbiased_pass_at_k(8, 2, 4) == pytest.approx(1 - comb(6, 4) / comb(8, 4))  # 1 - 15/70
    assert pk.group_signal_probability(8, 2, 4) == pytest.approx(1 - 0 - 15 / 70)
    assert pk.group_signal_probability(8, 0, 4) == 0.0 and pk.group_signal_probability(8, 8, 2) == 0.0
    s = pk.summarize([0, 2, 8, 4], 8)
    assert s["mean_success"] == pytest.approx(14 / 32)
    assert s["histogram"]["0"] == 1 and s["histogram"]["2"] == 1 and s["histogram"]["8"] == 1
    assert s["never_solved"] == 0.25 and s["always_solved"] == 0.25
    assert s["group_signal"]["2"] == pytest.approx((0 + 2 * 2 * 6 / 56 + 0 + 2 * 4 * 4 / 56) / 4)
    with pytest.raises(ValueError, match=r"successes must lie in \[0, 8\]"):
        pk.summarize([9], 8)


# ---------------------------------------------------------------- the validation split


def test_the_validation_split_follows_the_rl_questions_and_replaces_the_test_set(tmp_path):
    from rapo_ray.training.trainer import rl_task_pool

    f = tmp_path / "train.jsonl"
    f.write_text(
        "".join(
            json.dumps({"question": f"q{i}", "answer": f"<<{i}+1={i + 1}>>\n#### {i + 1}"}) + "\n" for i in range(30)
        )
    )
    base = ["model.preset=smollm2-135m-instruct", "tasks.families=[]", f"tasks.data_files=[{f}]"]
    base += ["trainer.rl_questions=10", "cold_start.examples=5", f"cold_start.file={f}"]
    pool, test = rl_task_pool(load_config(None, [*base, "trainer.validation_questions=4"]))
    assert test == {}  # eval_on=test without eval_files: nothing held out is scored, the validation split neither
    pool, val = rl_task_pool(load_config(None, [*base, "trainer.validation_questions=4", "trainer.eval_on=validation"]))
    fam = next(iter(pool))
    assert [t.question for t in pool[fam]] == [f"q{i}" for i in range(5, 15)]
    assert [t.question for t in val[fam]] == ["q15", "q16", "q17", "q18"]
    with pytest.raises(ConfigError, match=r"needs trainer.validation_questions \(20\)"):
        rl_task_pool(load_config(None, [*base, "trainer.validation_questions=20", "trainer.eval_on=validation"]))
    with pytest.raises(ConfigError, match="trainer.eval_on=validation needs trainer.validation_questions > 0"):
        load_config(None, [*base, "trainer.eval_on=validation"])


def test_the_progress_line_shows_the_groups_kept_of_those_rolled_out():
    from rapo_ray.training.reporting import Progress

    said = []
    m = {"step": 3, "reward": 0.25, "accuracy": 0.25, "tokens_per_s": 90.0, "step_s": 12.0}
    m.update({"dynamic_sampling/groups_kept": 4, "dynamic_sampling/groups_dropped": 5})
    Progress(False, 10, 0, "grpo", log=said.append).update({**m, "dynamic_sampling/groups_surplus": 1})
    assert said == ["step 3: reward +0.250 acc 0.250 tok/s 90 step 12.0s kept 4/10"]


def test_power_of_the_paired_sign_test_by_hand():
    pw = benchmark_module("power")
    # 6 discordant pairs: only 0 or 6 wins reject at 0.05 (p = 2 / 64 = 0.031; 1 or 5 wins give p = 14 / 64)
    assert pw.sign_test_rejects(6, 0.05) == [True, False, False, False, False, False, True]
    assert pw.power(6, 1.0, 0.05) == pytest.approx(1.0) and pw.power(6, 0.5, 0.05) == pytest.approx(2 / 64)
    assert pw.power(6, 0.9, 0.05) == pytest.approx(0.9**6 + 0.1**6)
    # 100 pairs, 6 discordant: even 6-0 has power 1 >= 0.8 only at q = 1: a difference of 6 points
    assert pw.min_detectable_difference(100, 0.06) == pytest.approx(0.06)
    assert pw.min_detectable_difference(1266, 0.08) < pw.min_detectable_difference(422, 0.08)  # seeds pooled
    with pytest.raises(ValueError, match="discordant share"):
        pw.min_detectable_difference(100, 0.0)


def test_a_resume_moves_the_records_of_steps_past_its_checkpoint_aside(tmp_path):
    """Steps logged after the last checkpoint are logged again by the resumed run: before, metrics.jsonl held step
    21 twice after a resume from step 20."""
    from rapo_ray.training.reporting import MetricsLog

    lines = [{"step": 0, "eval/mean_accuracy": 0.5}, *({"step": k, "reward": k / 10} for k in (1, 2, 3))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 4, "rew')
    log = MetricsLog(tmp_path, load_config(None, []), log=lambda *_: None)
    assert log.rewind(2) == 2
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert (tmp_path / "metrics.superseded.jsonl").read_text() == json.dumps(lines[3]) + '\n{"step": 4, "rew\n'
    assert [m["step"] for m in log.history] == [0, 1, 2] and log.mean("reward") == pytest.approx(0.15)
    log.log({"step": 3, "reward": 0.9})
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    log.close()
