"""What a step's learner data costs to move between processes: per-token Python lists (before the tensor batch) against
``LearnerBatch`` tensors (now).

    python benchmarks/bench_learner_batch.py --parquet RUN/trajectories/step-000010.parquet
    python benchmarks/bench_learner_batch.py --parquet ... --long 300,1500   # the same rows at a real model's lengths

Everything that crosses a process boundary on the training path in one step is serialized the way Ray serializes
it (pickle protocol 5) and read back, with the default job's layout: 2 learner ranks, PPO mini-batches of 16 rows,
a rank's whole share per micro-batch, 1 epoch:

- rollout -> driver: the step's trajectories;
- driver -> ranks -> driver: the old-policy pass (micro-batches out, log-probs and entropies back);
- driver -> ranks: the update's mini-batches (with old log-probs, advantages, shaping).

"before" builds the payloads that crossed before the tensor batch: each trajectory's fields as Python lists, the
learner's micro-batches as lists of trajectories with per-token float lists, per-row float lists back; and each rank
turned its lists into tensors (timed as ``rank_collate_s``). "now" is this code's: ``LearnerBatch`` slices out (numpy
buffers on the wire), numpy arrays back. The rollout's trajectories still travel as lists on both sides: packing them
into arrays on the way was measured slower than pickling the lists (the conversions cost more than they save). ``--long P,R`` stretches every row to P prompt and
R response tokens (tiling its own tokens), the lengths of an instruction model with a chat template on GSM8K.
Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import random
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from rapo_ray.core.devices import machine_record
from rapo_ray.types.learner_batch import LearnerBatch
from rapo_ray.types.trajectory import Trajectory
from rapo_ray.workers.learner import micro_batch_rows, split_for_ranks

WORLD, MINI = 2, 16


def trajectories(parquet: Path, long: tuple[int, int] | None) -> list[Trajectory]:
    out = []
    for r in pq.read_table(parquet).to_pylist():
        prompt, resp, mask, logp = r["prompt_ids"], r["response_ids"], r["loss_mask"], r["logprobs"]
        if long:
            prompt = (prompt * math.ceil(long[0] / len(prompt)))[: long[0]]
            reps = math.ceil(long[1] / len(resp))
            resp, mask, logp = ((x * reps)[: long[1]] for x in (resp, mask, logp))
        t = Trajectory(r["group_id"], r["slot"], r["slot_kind"], r["problem_id"], "qa", (), prompt_ids=list(prompt))
        t.response_ids, t.loss_mask, t.logprobs, t.token_entropies = list(resp), list(mask), list(logp), list(logp)
        out.append(t)
    return out


def roundtrip(obj) -> tuple[int, float]:
    """(bytes, seconds) of pickling ``obj`` with protocol 5 and reading it back."""
    t0 = time.perf_counter()
    blob = pickle.dumps(obj, protocol=5)
    pickle.loads(blob)
    return len(blob), time.perf_counter() - t0


def before_payloads(trajs: list[Trajectory]) -> tuple[list, float]:
    """The step's payloads as lists, and the ranks' list-to-tensor time (what ``_collate`` did per micro-batch)."""
    as_lists = [dict(t.__dict__) for t in trajs]  # a dataclass pickles its __dict__: lists of Python numbers
    rows = micro_batch_rows([len(t.prompt_ids) + len(t.response_ids) for t in trajs], WORLD, MINI // WORLD, "row-order")
    old = [[random.random() for _ in t.response_ids] for t in trajs]
    forward_in = [[[as_lists[i] for i in mb] for mb in mbs] for mbs in rows]
    forward_out = [[(old[i], old[i]) for mb in mbs for i in mb] for mbs in rows]
    order = list(range(len(trajs)))
    random.Random(0).shuffle(order)
    update_in = [[] for _ in range(WORLD)]
    for k in range(0, len(order), MINI):
        mini = order[k : k + MINI]
        for r in range(WORLD):
            share = mini[r::WORLD]
            update_in[r].append(([as_lists[i] for i in share], [old[i] for i in share], [0.5] * len(share), 1.0))
    t0 = time.perf_counter()
    for part in (forward_in, update_in):
        for rank in part:
            for mb in rank:
                rows_ = mb[0] if isinstance(mb, tuple) else mb
                for d in rows_:  # per row: ids, masks, old log-probs from lists, as the ranks did
                    torch.tensor(list(d["prompt_ids"]) + list(d["response_ids"]))
                    torch.tensor(d["loss_mask"], dtype=torch.float32)
                    torch.tensor(d["logprobs"], dtype=torch.float32)
    collate_s = time.perf_counter() - t0
    return [as_lists, forward_in, forward_out, update_in], collate_s


def now_payloads(trajs: list[Trajectory]) -> tuple[list, float]:
    """This code's payloads, and the driver's time to build and slice the LearnerBatch."""
    t0 = time.perf_counter()
    lb = LearnerBatch.from_trajectories(trajs, pad_id=0)
    forward_in, _ = split_for_ranks(lb, WORLD, MINI // WORLD, 0)
    forward_out = [[(mb.response_mask.numpy(), mb.response_mask.numpy()) for mb in mbs] for mbs in forward_in]
    lb.old_logprobs, lb.entropies = torch.zeros_like(lb.response_mask), torch.zeros_like(lb.response_mask)
    lb = lb.with_signal({"advantage": [0.5] * len(lb), "shaping": [1.0] * len(lb)})
    order = list(range(len(lb)))
    random.Random(0).shuffle(order)
    update_in = [[] for _ in range(WORLD)]
    for k in range(0, len(order), MINI):
        split, _ = split_for_ranks(lb.select(order[k : k + MINI]), WORLD, MINI // WORLD, 0)
        for r in range(WORLD):
            update_in[r].append((split[r], 1.0))
    build_s = time.perf_counter() - t0
    return [trajs, forward_in, forward_out, update_in], build_s


def measure(trajs: list[Trajectory], repeats: int) -> dict:
    names = ("rollout_to_driver", "forward_old_out", "forward_old_back", "update_out")
    out = {}
    for label, make in (("before", before_payloads), ("now", now_payloads)):
        payloads, extra_s = make(trajs)
        parts = {n: min((roundtrip(p) for _ in range(repeats)), key=lambda x: x[1]) for n, p in zip(names, payloads)}
        out[label] = {
            "bytes": {n: b for n, (b, _) in parts.items()},
            "seconds": {n: s for n, (_, s) in parts.items()},
            "total_bytes": sum(b for b, _ in parts.values()),
            "total_s": sum(s for _, s in parts.values()),
            ("rank_collate_s" if label == "before" else "driver_build_s"): extra_s,
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parquet", required=True, help="a step's trajectories/step-*.parquet of a default run")
    ap.add_argument("--long", default="", help="P,R: stretch every row to P prompt and R response tokens")
    ap.add_argument("--repeats", type=int, default=5, help="best of N serialize + read-back rounds")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as the driver and every actor run (rapo_ray.model.factory.set_torch_threads)
    long = tuple(int(x) for x in args.long.split(",")) if args.long else None
    trajs = trajectories(Path(args.parquet), long)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    res = {"rows": len(trajs), "tokens": tokens, "long": long, **measure(trajs, args.repeats)}
    res["machine"] = machine_record()
    b, n = res["before"], res["now"]
    print(f"{len(trajs)} rows, {tokens} tokens" + (f" (stretched to {long[0]} + {long[1]} per row)" if long else ""))
    print(f"{'payload':20} {'before MB':>10} {'now MB':>8} {'before ms':>10} {'now ms':>8}")
    for k in b["bytes"]:
        print(
            f"{k:20} {b['bytes'][k] / 1e6:10.2f} {n['bytes'][k] / 1e6:8.2f} "
            f"{b['seconds'][k] * 1e3:10.1f} {n['seconds'][k] * 1e3:8.1f}"
        )
    print(
        f"{'total':20} {b['total_bytes'] / 1e6:10.2f} {n['total_bytes'] / 1e6:8.2f} {b['total_s'] * 1e3:10.1f} "
        f"{n['total_s'] * 1e3:8.1f}"
    )
    print(f"ranks' list-to-tensor time before: {b['rank_collate_s'] * 1e3:.1f} ms; driver's LearnerBatch build now: "
          f"{n['driver_build_s'] * 1e3:.1f} ms")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
