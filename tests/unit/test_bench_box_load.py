"""benchmarks/box_load.py: the share of CPU time per state, and the CPU of processes older than a window."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
import torch

from tests.helpers import benchmark_module

BUSY = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"


def test_state_shares_by_hand():
    box_load = benchmark_module("box_load")
    before = dict.fromkeys(box_load.STATES, 0.0) | {"nice": 100.0, "idle": 50.0}
    after = before | {"nice": 160.0, "idle": 70.0, "steal": 20.0}  # 60 + 20 + 20 = 100 s of CPU time
    shares = box_load.state_shares(before, after)
    assert shares == dict.fromkeys(box_load.STATES, 0.0) | {"nice": 0.6, "idle": 0.2, "steal": 0.2}


def test_a_process_running_before_the_window_is_counted_as_older():
    box_load = benchmark_module("box_load")
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(0.3)  # started before the window opens
        load = box_load.BoxLoad(interval=0.2).start()
        time.sleep(1.0)
        summary = load.stop()
    finally:
        busy.kill()
        busy.wait()
    assert len(load.samples) >= 2
    assert summary["older_cpu_s"] > 0.2  # a busy loop gets some of the window's second, however loaded the box
    older = {c["command"] for c in summary["older_top_commands"]}
    assert any("while time.time() < end" in c for c in older), summary["older_top_commands"]
    # the sampling process itself is not another process (by its own command line: a background command of this
    # session, tests/background.py, may have "pytest" in its folder names)
    assert " ".join(psutil.Process().cmdline()).strip()[:120] not in older
    assert abs(sum(summary["states"].values()) - 1.0) < 1e-3


def test_the_speed_rounds_time_the_same_work_and_summarise_its_spread():
    box_load = benchmark_module("box_load")
    threads = torch.get_num_threads()
    result = box_load.speed(seconds=0.3, interval=0.05)
    assert torch.get_num_threads() == threads  # timed on one thread, then the caller's setting is back
    assert len(result["rounds"]) >= 2 and result["machine"]["cpu_count"]
    for key in ("python_s", "matmul_s"):
        values = [r[key] for r in result["rounds"]]
        spread = result["summary"][key]
        assert spread["min"] == min(values) and spread["max"] == max(values)
        assert spread["min"] <= spread["median"] <= spread["max"]
        assert spread["max_over_min"] == round(max(values) / min(values), 2)


def test_a_speed_window_that_cannot_hold_a_round_is_a_clear_error():
    box_load = benchmark_module("box_load")
    with pytest.raises(ValueError, match="seconds and interval must be > 0, got seconds=0"):
        box_load.speed(seconds=0, interval=0.5)


def test_the_probe_times_the_fixed_work_while_the_window_is_open():
    box_load = benchmark_module("box_load")
    threads = torch.get_num_threads()
    load = box_load.BoxLoad(interval=0.2, probe_interval=0.05).start()
    time.sleep(0.6)
    summary = load.stop()
    assert torch.get_num_threads() == threads  # the probe's one thread, then the caller's setting is back
    rounds = summary["speed_rounds"]
    assert len(rounds) >= 2 and rounds == load.speed_rounds
    assert all(r["python_s"] > 0 and r["matmul_s"] > 0 for r in rounds)
    walls = [r["wall"] for r in rounds]
    assert walls == sorted(walls) and walls[-1] - walls[0] < 2.0  # stamped as they ran, and stopped with the window
    assert "speed_rounds" not in box_load.BoxLoad(interval=0.2).start().stop()  # no probe unless asked for
