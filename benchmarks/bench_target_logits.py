"""One learner forward/backward with the LM head at every position against only at the generated targets
(``learner.logits_only_at_targets``, rapo_ray/model/target_logits.py): seconds and peak memory, on a saved step's rows.

    python benchmarks/bench_target_logits.py --model-dir MODEL --parquet RUN/trajectories/step-000002.parquet \\
        --rows 2,8 --out benchmarks/results/target_logits.json

For each row count N and each mode, a fresh process (so its peak RSS is its own) loads ``--model-dir`` in fp32 on one
thread, as a learner rank does, takes the step's N longest rows as one padded micro-batch, and times the policy
log-probs of their generated targets and the backward of their sum. Reports the process's RSS before the pass and
its peak, and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench_learner_update import step_batch
from rapo_ray.algos.loss import logprobs_of
from rapo_ray.core.devices import machine_record
from rapo_ray.core.files import write_json_atomic
from rapo_ray.model.factory import load_model, pad_token_id, set_torch_threads
from rapo_ray.model.target_logits import logits_at
from rapo_ray.types.learner_batch import LearnerBatch

MODES = {"all": False, "targets": True}  # -> logits_at(only_at=...)


def one_pass(model_dir: str, parquet: str, rows: int, mode: str) -> dict:
    """The pass itself, in this process: seconds, RSS before and peak (MB), and the micro-batch's shape."""
    set_torch_threads(1)
    model = load_model(model_dir).train()
    trajs = sorted(step_batch(Path(parquet))[0].trajectories, key=lambda t: -(len(t.prompt_ids) + len(t.response_ids)))
    mb = LearnerBatch.from_trajectories(trajs[:rows], pad_token_id(model_dir))
    ids, at = mb.long_ids(), mb.loss_mask > 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    logits = logits_at(model, ids, mb.attention_mask, at, MODES[mode]).float()
    logprobs_of(logits, ids[:, 1:][at]).sum().backward()
    seconds = time.perf_counter() - t0
    return {
        "mode": mode,
        "rows": len(mb),
        "T": int(ids.shape[1]),
        "targets": int(at.sum()),
        "positions": int(at.numel()),
        "seconds": seconds,
        "rss_before_mb": before,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="an HF model folder (the run's starting model)")
    ap.add_argument("--parquet", required=True, help="a saved step: RUN/trajectories/step-NNNNNN.parquet")
    ap.add_argument("--rows", default="2,8", help="comma-separated row counts (the step's longest rows)")
    ap.add_argument("--out", default="benchmarks/results/target_logits.json")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)  # "ROWS,MODE": run one pass, print its JSON
    args = ap.parse_args()
    if args.child:
        rows, mode = args.child.split(",")
        print(json.dumps(one_pass(args.model_dir, args.parquet, int(rows), mode)))
        return
    if not Path(args.model_dir, "config.json").is_file():
        ap.error(f"--model-dir {args.model_dir}: not an HF model folder (no config.json)")
    if not Path(args.parquet).is_file():
        ap.error(f"--parquet {args.parquet}: no such file")
    try:
        row_counts = [int(x) for x in args.rows.split(",") if x]
    except ValueError:
        ap.error(f"--rows {args.rows!r}: comma-separated positive integers")
    if not row_counts or min(row_counts) < 1:
        ap.error(f"--rows {args.rows!r}: comma-separated positive integers")
    results = []
    for rows in row_counts:
        for mode in MODES:
            cmd = [sys.executable, __file__, "--model-dir", args.model_dir, "--parquet", args.parquet]
            out = subprocess.run([*cmd, "--child", f"{rows},{mode}"], capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(res)
            print(
                f"{res['rows']} rows x {res['T']} ({res['targets']} of {res['positions']} targets), LM head at "
                f"{mode:8}: {res['seconds']:6.2f} s, peak RSS {res['peak_rss_mb']:6.0f} MB "
                f"({res['peak_rss_mb'] - res['rss_before_mb']:+.0f} MB over the loaded model)"
            )
    write_json_atomic(Path(args.out), {"machine": machine_record(), "args": vars(args), "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
