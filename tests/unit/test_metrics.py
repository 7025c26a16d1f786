"""Metric reduction (RLlib's MetricsLogger) and the metrics sinks (TensorBoard, W&B offline, MLflow sqlite)."""

from __future__ import annotations

import gc
import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from rapo_ray.config import Config
from rapo_ray.core.errors import ConfigError, DataError
from rapo_ray.core.metrics import RunMetrics, StageTimer, actor_stats, gc_clock, merge_actor_stats
from rapo_ray.training.reporting import MetricsLog, read_metrics


def _wandb_history(run_path: Path) -> dict[str, list[dict]]:
    """The history rows of every offline W&B run under ``run_path/wandb``, by run id, read from the .wandb
    files (W&B's record log: 32 KiB blocks of crc32/length/type-framed protobuf ``Record``s)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, list[dict]] = {}
    for path in sorted(run_path.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, payloads, partial = path.read_bytes(), 7, [], b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind == 1:
                payloads.append(chunk)
            elif kind in (2, 3):
                partial += chunk
            elif kind == 4:
                payloads.append(partial + chunk)
                partial = b""
        run_id = None
        for payload in payloads:
            rec = pb.Record()
            rec.ParseFromString(payload)
            if rec.WhichOneof("record_type") == "run":
                run_id = rec.run.run_id
            elif rec.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                out.setdefault(run_id, []).append(row)
    return out


def _sink_cfg(**run) -> Config:
    cfg = Config()
    return replace(cfg, run=replace(cfg.run, **{"tensorboard": False, **run}))


def test_actor_stats_merge_each_key_by_its_rule():
    a = actor_stats({"generate_s": 1.5, "kl": 0.2, "chunk_s": 3.0}, {"kl": "mean", "chunk_s": "max"})
    b = actor_stats({"generate_s": 2.0, "kl": 0.4, "chunk_s": 5.0}, {"kl": "mean", "chunk_s": "max"})
    merged = merge_actor_stats([a, b])
    assert merged == pytest.approx({"generate_s": 3.5, "kl": 0.3, "chunk_s": 5.0})
    assert merge_actor_stats([]) == {}
    # a key only some actors report is reduced over those that sent it (kl: three parts of four)
    c = actor_stats({"generate_s": 0.5, "kl": 0.8}, {"kl": "mean"})
    assert merge_actor_stats([a, b, c, actor_stats({"retrievals": 2})]) == pytest.approx(
        {"generate_s": 4.0, "kl": (0.2 + 0.4 + 0.8) / 3, "chunk_s": 5.0, "retrievals": 2.0}
    )
    with pytest.raises(ValueError, match="'kl' is reduced by 'mean' in one part, 'max' in another"):
        merge_actor_stats([a, actor_stats({"kl": 0.1}, {"kl": "max"})])


def test_actor_stats_refuses_an_unknown_reduction():
    with pytest.raises(ValueError, match=r"reduce\['kl'\]='median'"):
        actor_stats({"kl": 0.1}, {"kl": "median"})


def test_run_metrics_windows_totals_and_checkpoint_state():
    rm = RunMetrics(window=3)
    for reward in (0.0, 1.0, 2.0, 3.0):
        out = rm.update({"reward": reward, "trajectories": 8, "generated_tokens": 100})
    assert out["reward_mean3"] == pytest.approx(2.0)  # mean of the last three: 1, 2, 3
    assert out["lifetime/trajectories"] == 32 and out["lifetime/generated_tokens"] == 400
    assert out["lifetime/generated_tokens_per_s"] > 0 and out["lifetime/trajectories_per_s"] > 0
    assert out["lifetime/tool_calls"] == 0  # a total the steps never reported stays at zero

    state = json.loads(json.dumps(rm.get_state()))  # saved in trainer_state.json
    restored = RunMetrics(window=3)
    restored.set_state(state)
    out = restored.update({"reward": 7.0, "trajectories": 8})
    assert out["reward_mean3"] == pytest.approx(4.0)  # 2, 3, 7: the window went through the checkpoint
    assert out["lifetime/trajectories"] == 40

    other = RunMetrics(window=5)  # run.metrics_window changed on resume: totals kept, windows restarted
    other.set_state(state)
    out = other.update({"reward": 7.0, "trajectories": 8})
    assert out["reward_mean5"] == pytest.approx(7.0) and out["lifetime/trajectories"] == 40


def test_wandb_offline_and_mlflow_sqlite_sinks_record_the_run_and_continue_it(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = _sink_cfg(wandb=True, mlflow=True, tensorboard=True)
    log = MetricsLog(tmp_path, cfg, log=print)
    for step in (1, 2):
        log.log({"step": step, "reward": 0.25 * step, "update/loss_sum": -1.0, "note": "text is jsonl-only"})
    log.log({"step": 2, "eval/mean_accuracy": 0.5})
    log.close()

    wandb_id = (tmp_path / "wandb_run_id").read_text().strip()
    mlflow_id = (tmp_path / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert [(m.step, m.value) for m in client.get_metric_history(mlflow_id, "reward")] == [(1, 0.25), (2, 0.5)]
    assert client.get_metric_history(mlflow_id, "eval/mean_accuracy")[0].value == 0.5
    run = client.get_run(mlflow_id)
    assert run.data.params["algo.name"] == cfg.algo.name and run.data.params["algo.rapo.n_hybrid"] == str(
        cfg.algo.rapo.n_hybrid
    )
    assert run.info.status == "FINISHED" and "note" not in run.data.metrics
    rows = _wandb_history(tmp_path)[wandb_id]
    assert [(r["_step"], r["reward"]) for r in rows] == [(1, 0.25), (2, 0.5)]
    assert rows[1]["eval/mean_accuracy"] == 0.5  # W&B merges the dicts logged at one step into one row
    assert list(tmp_path.glob("tb/events.out.tfevents.*"))

    # the run folder resumed: the same W&B and MLflow runs go on
    log = MetricsLog(tmp_path, cfg, log=print)
    log.log({"step": 3, "reward": 0.75})
    log.close()
    assert (tmp_path / "wandb_run_id").read_text().strip() == wandb_id
    assert [m.step for m in client.get_metric_history(mlflow_id, "reward")] == [1, 2, 3]
    assert [r["reward"] for r in _wandb_history(tmp_path)[wandb_id] if "reward" in r] == [0.25, 0.5, 0.75]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 2, 3] and lines[0]["note"] == "text is jsonl-only"


def test_a_sink_failing_mid_run_is_dropped_and_the_jsonl_goes_on(tmp_path):
    class Broken:
        name = "broken"

        def __init__(self):
            self.calls = 0

        def log(self, metrics, step):
            self.calls += 1
            raise OSError("tracking server went away")

        def close(self):
            pass

    said = []
    log = MetricsLog(tmp_path, _sink_cfg(), log=said.append)
    broken = Broken()
    log.sinks.append(broken)
    log.log({"step": 1, "reward": 1.0})
    log.log({"step": 2, "reward": 2.0})
    log.close()
    assert broken.calls == 1 and len(said) == 1 and "broken failed at step 1" in said[0]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_read_metrics_gives_what_metrics_log_wrote_and_each_steps_last_record(tmp_path):
    log = MetricsLog(tmp_path, _sink_cfg())
    records = [
        {"step": 1, "reward": 0.1, "step_s": 2.0},
        {"step": 2, "reward": 0.2, "step_s": 2.5},
        {"step": 2, "eval/mean_accuracy": 0.5},  # a held-out evaluation: no "reward"
        {"step": 2, "reward": 0.3, "step_s": 2.4},  # step 2 again, as a resumed driver replays it
    ]
    for r in records:
        log.log(r)
    log.close()
    assert read_metrics(tmp_path) == records
    assert read_metrics(str(tmp_path), steps_only=True) == [records[0], records[3]]


def test_read_metrics_names_the_file_and_line_it_cannot_read(tmp_path):
    with pytest.raises(DataError, match=r"metrics\.jsonl: cannot read"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.0}\n\n{"step": 2, "rew\n')
    with pytest.raises(DataError, match=r"metrics\.jsonl:3: not a JSON record"):
        read_metrics(tmp_path)


def test_a_sink_that_cannot_start_names_itself(tmp_path):
    with pytest.raises(RuntimeError, match=r"mlflow metrics sink \(run\.mlflow\)"):
        MetricsLog(tmp_path, _sink_cfg(mlflow=True, mlflow_tracking_uri="bogus-scheme://nowhere"))


def test_enabling_a_sink_without_its_package_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"run\.wandb=true needs the wandb package"):
        _sink_cfg(wandb=True).validate()
    with pytest.raises(ConfigError, match=r"run\.metrics_window \(0\)"):
        _sink_cfg(metrics_window=0).validate()


def test_gc_clock_counts_the_collections_inside_it_by_generation():
    with gc_clock() as clock:
        gc.collect(0)
        gc.collect()
    seconds, collections, by_generation = clock
    assert collections == 2 and by_generation[1] == 0.0
    assert seconds >= 0 and seconds == sum(by_generation)
    gc.collect()  # outside: not counted, and the callback is gone
    assert clock[1] == 2


def test_stage_timer_adds_a_stage_entered_twice_and_keeps_first_order():
    timer = StageTimer()
    with timer.stage("ray"):
        pass
    timer.add("learners", 2.0)
    with pytest.raises(RuntimeError):
        with timer.stage("buffer"):
            raise RuntimeError("a failed stage still counts")
    timer.add("ray", 1.25)
    assert list(timer.seconds) == ["ray", "learners", "buffer"]
    assert 1.25 <= timer.seconds["ray"] < 1.5 and timer.seconds["learners"] == 2.0 and timer.seconds["buffer"] >= 0
    line = timer.line("start-up")
    assert line.startswith(f"start-up {sum(timer.seconds.values()):.1f} s: ray 1.")
    assert "learners 2.0 s, buffer 0.0 s" in line
