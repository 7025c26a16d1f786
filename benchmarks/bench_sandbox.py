"""Python tool sandbox latency: per-call p50/p99 of a trivial call and of the default run's typical call.

    python benchmarks/bench_sandbox.py [--calls 400] [--concurrency 1,4] [--out benchmarks/results/sandbox.json]

For each sandbox mode (fork_server, subprocess) and isolation (namespaces, process), ``--calls`` sequential
calls (after 20 warm-up calls), then the same number from ``--concurrency`` threads at once (the rollout
worker's tool pool). The typical call is what the default run's policy writes most (``print(411 + 8 * 14)``,
from a step's trajectories). Runs against whatever ``rapo_ray`` is importable, so the same script measures an
older checkout (``PYTHONPATH=<checkout>``); an old checkout without the ``isolation`` argument is reported as
``isolation: "n/a (before #17)"``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rapo_ray.envs.tools import PythonSandbox, SandboxLimits

CALLS = {"trivial": "print(1)", "typical": "print(411 + 8 * 14)"}


def measure(sb: PythonSandbox, code: str, calls: int, concurrency: int) -> dict:
    for _ in range(20):
        sb.run(code)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda _: sb.run(code), range(calls)))
    wall = time.perf_counter() - t0
    bad = [r.text for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} calls failed, e.g. {bad[0]!r}")
    ms = sorted(r.elapsed_s * 1000 for r in results)
    return {
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
        "calls_per_s": round(calls / wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--modes", default="fork_server,subprocess")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    has_isolation = "isolation" in inspect.signature(PythonSandbox).parameters
    isolations = PythonSandbox.ISOLATIONS if has_isolation else ("n/a (before #17)",)
    rows = []
    for mode in args.modes.split(","):
        for isolation in isolations:
            kwargs = {"isolation": isolation} if has_isolation else {}
            for conc in map(int, args.concurrency.split(",")):
                sb = PythonSandbox(SandboxLimits(timeout_s=5.0), max_concurrency=conc, mode=mode, **kwargs)
                try:
                    for name, code in CALLS.items():
                        calls = args.calls if mode == "fork_server" else max(40, args.calls // 8)
                        row = {"mode": mode, "isolation": isolation, "concurrency": conc, "call": name}
                        row.update(measure(sb, code, calls, conc))
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                finally:
                    sb.close()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
