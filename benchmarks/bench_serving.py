"""Serving benchmark: closed-loop load against the agent's OpenAI endpoint on Ray Serve (127.0.0.1).

    python benchmarks/bench_serving.py --checkpoint runs [--clients 1,8,32] [--seconds 30]

Each client sends held-out bundled questions (so the agent really calls python and search) one after the
other with the official ``openai`` client, for ``--seconds`` per concurrency level: requests/s, p50/p99
latency, errors (goal: zero), tool calls per request, accuracy, and how many prompts each engine call
carried (cross-request batching, from the replica's /health counters).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from benchmarks.load import percentile_ms, run_clients  # noqa: E402
from rapo_ray.core.net import free_port  # noqa: E402

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def closed_loop(client, questions, clients: int, seconds: float, max_tokens: int) -> dict:
    from rapo_ray.envs.rewards import score

    lat, tools, correct = [], [], []
    errors: list[str] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def run(k):
        i = k
        while time.perf_counter() < stop:
            task = questions[i % len(questions)]
            t = time.perf_counter()
            try:
                resp = client.chat.completions.create(
                    model="agent",
                    messages=[{"role": "user", "content": task.question}],
                    max_tokens=max_tokens,
                    temperature=0.0,
                )
                dt = time.perf_counter() - t
                sc = score(resp.choices[0].message.model_extra["reasoning_content"], task.answers, task.kind)
                with lock:
                    lat.append(dt)
                    tools.append(resp.model_extra["agent"]["tool_calls"])
                    correct.append(sc.correct)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
            i += clients

    wall = run_clients(run, clients)
    lat.sort()
    return {
        "clients": clients,
        "requests": len(lat),
        "seconds": round(wall, 1),
        "requests_per_s": round(len(lat) / wall, 2),
        "p50_ms": round(percentile_ms(lat, 0.50), 1),
        "p99_ms": round(percentile_ms(lat, 0.99), 1),
        "errors": len(errors),
        "error_samples": errors[:3],
        "tool_calls_per_request": round(sum(tools) / max(len(tools), 1), 2),
        "accuracy": round(sum(correct) / max(len(correct), 1), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="runs", help="HF folder, checkpoint, run directory, or folder of runs")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "serving.json"))
    ap.add_argument("overrides", nargs="*", help="rapo_ray config overrides (serve.batch_wait_ms=5 ...)")
    args = ap.parse_args()

    import openai
    import ray
    import requests
    from ray import serve

    from rapo_ray.config import load_config
    from rapo_ray.envs.suite import task_splits
    from rapo_ray.serving.app import build_agent_app, resolve_checkpoint

    # one replica unless overridden: the engine counters below come from /health, i.e. from one replica
    base_overrides = ["serve.model_name=agent", "serve.max_ongoing_requests=64", "serve.min_replicas=1"]
    cfg = load_config(overrides=base_overrides + ["serve.max_replicas=1"] + args.overrides)
    _, test = task_splits(cfg.tasks)
    questions = [t for pair in zip(*test.values()) for t in pair]  # interleave the families
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.perf_counter()
        serve.run(build_agent_app(cfg, args.checkpoint), name="bench_agent", route_prefix="/")
        startup = time.perf_counter() - t0
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        client.chat.completions.create(
            model="agent", messages=[{"role": "user", "content": questions[0].question}], max_tokens=8
        )
        report = {
            "checkpoint": str(resolve_checkpoint(args.checkpoint)),
            "replica_startup_s": round(startup, 1),
            "max_tokens": args.max_tokens,
            "batch_wait_ms": cfg.serve.batch_wait_ms,
            "levels": [],
        }
        for n in [int(c) for c in args.clients.split(",")]:
            h0 = requests.get(base + "/health", timeout=30).json()
            level = closed_loop(client, questions, n, args.seconds, args.max_tokens)
            h1 = requests.get(base + "/health", timeout=30).json()
            calls = h1["engine_calls"] - h0["engine_calls"]
            level["prompts_per_engine_call"] = round((h1["prompts"] - h0["prompts"]) / max(calls, 1), 2)
            if "decode_steps" in h1:  # a continuously batching engine: its mean decode batch says more
                steps = h1["decode_steps"] - h0["decode_steps"]
                level["mean_decode_batch"] = round((h1["decode_rows"] - h0["decode_rows"]) / max(steps, 1), 2)
            report["levels"].append(level)
            print(json.dumps(level), flush=True)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(f"wrote {out}")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
