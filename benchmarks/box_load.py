"""What else used the box's CPUs while a benchmark ran: the kernel's CPU time per state (user, nice, system, idle,
steal, ...) and each process's CPU seconds, sampled every few seconds.

    python benchmarks/box_load.py --out box.jsonl [--interval 2] [--seconds 600]
    python benchmarks/box_load.py --speed --out speed.json [--interval 1] [--seconds 90]    # the box's own speed

On a shared 2-core VM a timing is only as good as the box was quiet. The command line writes one JSON line per
interval: the share of the box's CPU time in each state, and the processes that used the most CPU in it.
``compare_algorithms.py`` keeps the summary of each run's window (``BoxLoad``) beside the run, so that a slow run can
be told from a busy or stolen-from box.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import psutil
import torch

from rapo_ray.core.devices import machine_record
from rapo_ray.core.files import write_json_atomic

STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")  # Ray runs its workers niced
# the probe's fixed work: a fifth of speed_round's, a few tens of ms of one core, so a probe a second costs little
PROBE_LOOP, PROBE_MATMULS = 200_000, 20


def cpu_states() -> dict[str, float]:
    """Seconds of CPU time in each state since boot, summed over the box's CPUs."""
    times = psutil.cpu_times()
    return {s: float(getattr(times, s, 0.0)) for s in STATES}


def process_cpu() -> dict[tuple[int, float], tuple[float, str]]:
    """(pid, create time) -> (CPU seconds so far, short command line) for every process we may read."""
    out = {}
    for p in psutil.process_iter(["pid", "create_time", "cpu_times", "cmdline", "name"]):
        info = p.info
        if info["cpu_times"] is None or info["create_time"] is None:
            continue
        command = " ".join(info["cmdline"] or [info["name"] or "?"]).strip()[:120]
        out[(info["pid"], info["create_time"])] = (info["cpu_times"].user + info["cpu_times"].system, command)
    return out


def state_shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The share of CPU time spent in each state between two ``cpu_states()`` readings."""
    deltas = {s: after[s] - before[s] for s in STATES}
    total = sum(deltas.values()) or 1.0
    return {s: round(v / total, 4) for s, v in deltas.items()}


class BoxLoad:
    """Samples the box from ``start()`` to ``stop()``, every ``interval`` seconds in a daemon thread.

    A process's CPU seconds are counted from the first sample that sees it (a process new since the last sample is
    counted whole), so a process that starts and ends between two samples is missed: keep the interval short next to
    the processes that matter.

    With ``probe_interval``, a second thread times a small fixed workload (``speed_round``) that often: the box's
    speed while the benchmark ran. The probe runs at this process's priority, above Ray's workers (nice 15), yet it
    shares the cores with them: the benchmark's own load slows it too (its matmuls most), so it is a record to read
    beside a timing, not a divisor that corrects one (docs/RESULTS.md, Performance by component).
    """

    def __init__(self, interval: float = 2.0, top: int = 8, probe_interval: float | None = None):
        self.interval, self.top, self.probe_interval = interval, top, probe_interval
        self.samples: list[dict] = []
        self.speed_rounds: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._probe: threading.Thread | None = None

    def start(self) -> BoxLoad:
        self._t0 = time.monotonic()
        self._first_states = self._states = cpu_states()
        self._procs = process_cpu()
        # processes that were running before the window opened, other than this one (its probe is the sampler's)
        self._older = {key for key in self._procs if key[0] != os.getpid()}
        self._seconds_by_command: dict[str, float] = {}
        self._older_seconds_by_command: dict[str, float] = {}
        self.samples, self.speed_rounds = [], []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="box-load", daemon=True)
        self._thread.start()
        if self.probe_interval:
            self._torch_threads = torch.get_num_threads()
            torch.set_num_threads(1)  # the matmuls on one thread, as speed() times them
            self._probe = threading.Thread(target=self._run_probe, name="box-speed", daemon=True)
            self._probe.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self.sample())

    def _run_probe(self) -> None:
        while not self._stop.wait(self.probe_interval):
            self.speed_rounds.append({"wall": round(time.time(), 2), **speed_round(PROBE_LOOP, PROBE_MATMULS)})

    def sample(self) -> dict:
        """One interval: {"t": seconds since start, "wall": epoch seconds, "states": {state: share of CPU time},
        "top": [the processes that used the most CPU in it]}."""
        states, procs = cpu_states(), process_cpu()
        used = []
        for key, (cpu, command) in procs.items():
            spent = cpu - (self._procs[key][0] if key in self._procs else 0.0)
            if spent > 0:
                used.append((spent, key[0], command))
                self._seconds_by_command[command] = self._seconds_by_command.get(command, 0.0) + spent
                if key in self._older:
                    self._older_seconds_by_command[command] = self._older_seconds_by_command.get(command, 0.0) + spent
        used.sort(reverse=True)
        shares = state_shares(self._states, states)
        self._states, self._procs = states, procs
        return {
            "t": round(time.monotonic() - self._t0, 2),
            "wall": round(time.time(), 2),
            "states": shares,
            "top": [{"pid": pid, "cpu_s": round(s, 2), "command": c} for s, pid, c in used[: self.top]],
        }

    def stop(self) -> dict:
        """The whole window: {"seconds", "states": share of CPU time per state, "top_commands": by CPU seconds,
        "older_cpu_s": CPU seconds of the processes already running when it opened, "older_top_commands"}, and with
        a probe "speed_rounds": [{"wall": epoch seconds at its start, "python_s", "matmul_s"}]."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._probe is not None:
            self._probe.join()
            self._probe = None
            torch.set_num_threads(self._torch_threads)
        self.samples.append(self.sample())
        return {
            "seconds": round(time.monotonic() - self._t0, 1),
            "states": state_shares(self._first_states, self._states),
            "top_commands": self._ranked(self._seconds_by_command),
            "older_cpu_s": round(sum(self._older_seconds_by_command.values()), 1),
            "older_top_commands": self._ranked(self._older_seconds_by_command),
            **({"speed_rounds": self.speed_rounds} if self.probe_interval else {}),
        }

    def _ranked(self, seconds_by_command: dict[str, float]) -> list[dict]:
        ranked = sorted(seconds_by_command.items(), key=lambda kv: -kv[1])
        return [{"cpu_s": round(s, 1), "command": c} for c, s in ranked[: self.top]]


def speed_round(loop: int = 1_000_000, matmuls: int = 100) -> dict[str, float]:
    """Seconds for a fixed amount of work on one thread: a pure-Python loop and float32 256 x 256 matmuls. On an idle
    box a change in these is the host's doing (another tenant on the same cores), not ours."""
    t = time.perf_counter()
    total = 0
    for i in range(loop):
        total += i
    python_s = time.perf_counter() - t
    a = torch.randn(256, 256)
    t = time.perf_counter()
    for _ in range(matmuls):
        a @ a
    return {"python_s": round(python_s, 4), "matmul_s": round(time.perf_counter() - t, 4)}


def speed(seconds: float, interval: float) -> dict:
    """``speed_round()`` every ``interval`` seconds for ``seconds``: each round, and the spread (max / min)."""
    if not seconds > 0 or not interval > 0:
        raise ValueError(f"box speed: seconds and interval must be > 0, got seconds={seconds}, interval={interval}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rounds = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            rounds.append({"wall": round(time.time(), 2), **speed_round()})
            time.sleep(interval)
    finally:
        torch.set_num_threads(threads)
    summary = {}
    for key in ("python_s", "matmul_s"):
        values = sorted(r[key] for r in rounds)
        summary[key] = {
            "min": values[0],
            "median": values[len(values) // 2],
            "max": values[-1],
            "max_over_min": round(values[-1] / values[0], 2),
        }
    return {"machine": machine_record(), "seconds": seconds, "interval": interval, "summary": summary, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON lines, one per interval (appended); with --speed one JSON")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    ap.add_argument("--seconds", type=float, default=3600.0, help="stop after this long")
    ap.add_argument("--speed", action="store_true", help="time a fixed workload each interval instead (idle box)")
    args = ap.parse_args()
    if not args.seconds > 0 or not args.interval > 0:
        ap.error(f"--seconds and --interval must be > 0 (got {args.seconds} and {args.interval})")
    if args.speed:
        result = speed(args.seconds, args.interval)
        write_json_atomic(args.out, result)
        print(json.dumps(result["summary"]))
        return
    load = BoxLoad(args.interval).start()
    written = 0
    end = time.monotonic() + args.seconds
    with open(Path(args.out), "a") as f:
        while time.monotonic() < end:
            time.sleep(args.interval)
            for s in load.samples[written:]:
                f.write(json.dumps(s) + "\n")
            written = len(load.samples)
            f.flush()
    load.stop()


if __name__ == "__main__":
    main()
