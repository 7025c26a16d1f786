"""What a rollout batch costs to cross a process boundary: trajectories as ``Trajectory`` pickles them (the per-token
lists as they are, element by element) against the same lists packed into arrays for the trip and turned back into
lists on arrival (what ``Trajectory`` did for a while; this measurement is why it no longer does).

    .venv/bin/python benchmarks/bench_rollout_payload.py

For each shape (trajectories x response tokens, 200 prompt tokens each), one pickle round trip (protocol 5, as Ray's
serializer uses) with Python's garbage collector on, as in the driver, median of ``--repeats``, the two forms in
turn: payload bytes, dump and load milliseconds, and of them the collector's CPU milliseconds. Shapes: the real-model
recipe's step on a CPU (8 x 500), a GPU step of the paper's recipe (512 x 4,096: 64 prompts x G 8), and one
between. Results go to benchmarks/results/rollout_payload.json.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

from rapo_ray.core.devices import machine_record
from rapo_ray.core.metrics import gc_clock
from rapo_ray.types.trajectory import Trajectory

REPO = Path(__file__).resolve().parents[1]


class PackedTrajectory(Trajectory):
    """Pickles its per-token lists packed into arrays (int32 where every value fits, else int64; floats as float64);
    ``Trajectory.__setstate__`` turns them back into lists."""

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in ("prompt_ids", "response_ids", "loss_mask"):
            state[name] = _packed(state[name], "i", "q")
        for name in ("logprobs", "token_entropies"):
            state[name] = _packed(state[name], "d")
        return state


def _packed(values: list, *typecodes: str):
    for code in typecodes:
        try:
            return array(code, values)
        except (OverflowError, TypeError):
            continue
    return values


def make_trajectories(n: int, length: int, cls=Trajectory, prompt: int = 200) -> list[Trajectory]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        t = cls(f"g{i // 8}", i % 8, "on_policy", "p", "math", ("1",), [rng.randrange(49152) for _ in range(prompt)])
        t.response_ids = [rng.randrange(49152) for _ in range(length)]
        t.loss_mask = [1] * length
        t.logprobs = [-rng.random() for _ in range(length)]
        t.token_entropies = [rng.random() for _ in range(length)]
        out.append(t)
    return out


def round_trip(trajs: list[Trajectory]) -> dict:
    with gc_clock() as gc_s:
        t0 = time.perf_counter()
        payload = pickle.dumps(trajs, protocol=5)
        t1 = time.perf_counter()
        back = pickle.loads(payload)
        t2 = time.perf_counter()
    assert back == trajs and type(back[0].logprobs) is list
    return {"bytes": len(payload), "dump_ms": 1e3 * (t1 - t0), "load_ms": 1e3 * (t2 - t1), "gc_ms": 1e3 * gc_s[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8x500,64x1000,512x4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rollout_payload.json"))
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        n, length = map(int, shape.split("x"))
        forms = {
            "packed arrays": make_trajectories(n, length, PackedTrajectory),
            "python lists": make_trajectories(n, length),
        }
        runs: dict = {form: [] for form in forms}
        for _ in range(args.repeats):
            for form, trajs in forms.items():
                runs[form].append(round_trip(trajs))
        for form, rs in runs.items():
            row = {"trajectories": n, "response_tokens": length, "form": form, "mb": round(rs[0]["bytes"] / 1e6, 2)}
            row.update({k: round(statistics.median(r[k] for r in rs), 1) for k in ("dump_ms", "load_ms", "gc_ms")})
            rows.append(row)
            print(json.dumps(row))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "machine": machine_record()}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
