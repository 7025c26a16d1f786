"""What a rollout batch costs to cross a process boundary: per-token Python lists (what rollout workers return to the
driver today) against the same trajectories packed into flat numpy arrays for the trip and unpacked to lists again.

    .venv/bin/python benchmarks/bench_rollout_payload.py

For each shape (trajectories x response tokens, 200 prompt tokens each), one pickle round trip (protocol 5, as Ray's
serializer uses), median of ``--repeats``: payload bytes, dump and load milliseconds. The packed variant includes
its packing and unpacking, since the driver's code reads the lists. Shapes: the real-model recipe's step on a CPU
(8 x 500), a GPU step of the paper's recipe (512 x 4,096: 64 prompts x G 8), and one between. Results go to
benchmarks/results/rollout_payload.json.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from rapo_ray.core.devices import machine_record
from rapo_ray.types.trajectory import Trajectory

REPO = Path(__file__).resolve().parents[1]
PER_TOKEN = {"prompt_ids": np.int32, "response_ids": np.int32, "loss_mask": np.int8}
PER_TOKEN_FLOAT = {"logprobs": np.float32, "token_entropies": np.float32}


def make_trajectories(n: int, length: int, prompt: int = 200) -> list[Trajectory]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        t = Trajectory(
            f"g{i // 8}", i % 8, "on_policy", "p", "math", ("1",), [rng.randrange(49152) for _ in range(prompt)]
        )
        t.response_ids = [rng.randrange(49152) for _ in range(length)]
        t.loss_mask = [1] * length
        t.logprobs = [-rng.random() for _ in range(length)]
        t.token_entropies = [rng.random() for _ in range(length)]
        out.append(t)
    return out


def pack(trajs: list[Trajectory]) -> tuple[list[Trajectory], dict]:
    columns = {}
    for name, dtype in {**PER_TOKEN, **PER_TOKEN_FLOAT}.items():
        lists = [getattr(t, name) for t in trajs]
        lengths = np.fromiter(map(len, lists), np.int64, len(lists))
        columns[name] = (np.fromiter((x for xs in lists for x in xs), dtype, int(lengths.sum())), lengths)
    empty = {name: [] for name in columns}
    return [replace(t, **empty) for t in trajs], columns


def unpack(trajs: list[Trajectory], columns: dict) -> list[Trajectory]:
    for name, (flat, lengths) in columns.items():
        for t, part in zip(trajs, np.split(flat, np.cumsum(lengths)[:-1])):
            setattr(t, name, part.tolist())
    return trajs


def round_trip(trajs, packed: bool) -> dict:
    t0 = time.perf_counter()
    payload = pickle.dumps(pack(trajs) if packed else trajs, protocol=5)
    t1 = time.perf_counter()
    back = pickle.loads(payload)
    if packed:
        back = unpack(*back)
    t2 = time.perf_counter()
    assert back[0].logprobs[:3] == (
        [float(np.float32(x)) for x in trajs[0].logprobs[:3]] if packed else trajs[0].logprobs[:3]
    )
    return {"bytes": len(payload), "dump_ms": 1e3 * (t1 - t0), "load_ms": 1e3 * (t2 - t1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8x500,64x1000,512x4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rollout_payload.json"))
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        n, length = map(int, shape.split("x"))
        trajs = make_trajectories(n, length)
        for packed in (False, True):
            runs = [round_trip(trajs, packed) for _ in range(args.repeats)]
            row = {
                "trajectories": n,
                "response_tokens": length,
                "form": "packed numpy" if packed else "python lists",
                "mb": round(runs[0]["bytes"] / 1e6, 2),
                "dump_ms": round(statistics.median(r["dump_ms"] for r in runs), 1),
                "load_ms": round(statistics.median(r["load_ms"] for r in runs), 1),
            }
            rows.append(row)
            print(json.dumps(row))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "machine": machine_record()}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
