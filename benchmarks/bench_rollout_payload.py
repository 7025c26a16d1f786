"""What a rollout batch costs to cross from the fleet's workers to the driver and become the learner's tensors:
``Trajectory`` as it is (per-token fields as numpy arrays) against the same trajectories with the per-token fields
as Python lists (what ``Trajectory`` held until 2026-11-28).

    .venv/bin/python benchmarks/bench_rollout_payload.py

For each shape (trajectories x response tokens, 200 prompt tokens each; ``/P`` cuts the trajectories into P
separate pickles, as P engines' results arrive), both forms in turn, median of ``--repeats``:
- ``build_ms``: a worker appending the response in 6 segments, as the agent loop does;
- ``dump_ms`` / ``load_ms``: one pickle round trip (protocol 5, as Ray's serializer uses), collector on, as in the
  driver; ``gc_ms`` is the collector's CPU within the dump, load and learner build;
- ``learner_ms``: the driver turning the loaded trajectories into a ``LearnerBatch`` (padded tensors);
- ``driver_ms`` = load + learner: what the driver's main thread spends on the step's tokens.
Shapes: one engine's result in the simulated fleet (4 x 144), the default job's step (64 x 105), the real-model
recipe's step on a CPU (8 x 500), one between (64 x 1,000), a GPU step of the paper's recipe (512 x 4,096: 64
prompts x G 8), and 1,000 engines' results (4,000 x 144 / 1,000). Results go to benchmarks/results/rollout_payload.json.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

from rapo_ray.core.devices import machine_record
from rapo_ray.core.metrics import gc_clock
from rapo_ray.types.learner_batch import LearnerBatch
from rapo_ray.types.trajectory import GENERATED, TOKEN_DTYPES, TOOL_RESULT, Trajectory

REPO = Path(__file__).resolve().parents[1]
SEGMENTS = 6


class ListTrajectory(Trajectory):
    """The per-token fields as Python lists, extended in place: ``Trajectory`` before its fields were arrays."""

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, list(value) if name in TOKEN_DTYPES else value)

    def append(self, kind, ids, logprobs=None, entropies=None) -> None:
        start, gen, n = len(self.response_ids), kind == GENERATED, len(ids)
        self.response_ids.extend(ids)
        self.segments.append((kind, start, start + n))
        self.loss_mask.extend([1 if gen else 0] * n)
        self.logprobs.extend(logprobs if gen and logprobs is not None else [0.0] * n)
        self.token_entropies.extend(entropies if gen and entropies is not None else [0.0] * n)


FORMS = {"numpy arrays": Trajectory, "python lists": ListTrajectory}


def engine_outputs(n: int, length: int, prompt: int = 200) -> list[tuple[list[int], list[tuple]]]:
    """Per trajectory: prompt ids, then its segments as the engine and tools hand them over (plain lists)."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        cuts = [length * k // SEGMENTS for k in range(SEGMENTS + 1)]
        segs = []
        for k in range(SEGMENTS):
            m = cuts[k + 1] - cuts[k]
            ids = [rng.randrange(49152) for _ in range(m)]
            if k % 2 == 0:
                segs.append((GENERATED, ids, [-rng.random() for _ in range(m)], [rng.random() for _ in range(m)]))
            else:
                segs.append((TOOL_RESULT, ids, None, None))
        out.append(([rng.randrange(49152) for _ in range(prompt)], segs))
    return out


def build(cls, outputs) -> list[Trajectory]:
    trajs = []
    for i, (prompt, segs) in enumerate(outputs):
        t = cls(f"g{i // 8}", i % 8, "on_policy", "p", "math", ("1",), prompt)
        for seg in segs:
            t.append(*seg)
        trajs.append(t)
    return trajs


def one_round(cls, outputs, pieces: int) -> dict:
    with gc_clock() as gc_s:
        t0 = time.perf_counter()
        trajs = build(cls, outputs)
        t1 = time.perf_counter()
        size = -(-len(trajs) // pieces)
        payloads = [pickle.dumps(trajs[k : k + size], protocol=5) for k in range(0, len(trajs), size)]
        t2 = time.perf_counter()
        back = [t for p in payloads for t in pickle.loads(p)]
        t3 = time.perf_counter()
        LearnerBatch.from_trajectories(back, pad_id=0, behaviour=True)
        t4 = time.perf_counter()
    assert back == trajs and type(back[0]) is cls
    return {
        "bytes": sum(len(p) for p in payloads),
        "build_ms": 1e3 * (t1 - t0),
        "dump_ms": 1e3 * (t2 - t1),
        "load_ms": 1e3 * (t3 - t2),
        "learner_ms": 1e3 * (t4 - t3),
        "driver_ms": 1e3 * (t4 - t2),
        "gc_ms": 1e3 * gc_s[0],
    }


def parse_shape(text: str) -> tuple[int, int, int]:
    """``NxL`` or ``NxL/P`` -> (trajectories, response tokens, pickles)."""
    try:
        shape, _, pieces = text.partition("/")
        n, length = map(int, shape.split("x"))
        p = int(pieces) if pieces else 1
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shapes: {text!r} is not NxL or NxL/P (e.g. 64x105, 4000x144/1000)"
        ) from None
    if min(n, length, p) < 1 or p > n:
        raise argparse.ArgumentTypeError(f"--shapes: {text!r} needs N, L, P >= 1 and P <= N")
    return n, length, p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4x144,64x105,8x500,64x1000,512x4096,4000x144/1000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rollout_payload.json"))
    args = ap.parse_args()
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    rows = []
    for n, length, pieces in shapes:
        outputs = engine_outputs(n, length)
        runs: dict = {form: [] for form in FORMS}
        for _ in range(args.repeats):
            for form, cls in FORMS.items():
                runs[form].append(one_round(cls, outputs, pieces))
        for form, rs in runs.items():
            row = {"trajectories": n, "response_tokens": length, "pickles": pieces, "form": form}
            row["mb"] = round(rs[0]["bytes"] / 1e6, 2)
            keys = ("build_ms", "dump_ms", "load_ms", "learner_ms", "driver_ms", "gc_ms")
            row.update({k: round(statistics.median(r[k] for r in rs), 2) for k in keys})
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "machine": machine_record()}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
