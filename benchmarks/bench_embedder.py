"""MiniLM query embedding: the whole model vs the last layer at the last position only (issue #21).

    python benchmarks/bench_embedder.py [--chars 650] [--batch 8] [--repeats 10] [--threads 1]

The embedder (last-token pooling) runs MiniLM's last layer for the last position only
(``embedder.last_position_of_layer``). This times both ways on the same texts in one process, alternating
repeat by repeat so a busy or drifting machine hits both alike, and checks the vectors agree. Texts are
rollout-like histories cut to ``--chars`` characters (a default run's queries average ~128 MiniLM tokens,
~650 characters; a full 1,300-character history is ~341 tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def history(i: int, chars: int) -> str:
    step = (
        f"Fay has {150 + i} beads and gives 12 to each of her 7 friends. <think>compute {150 + i} - 12 * 7</think>"
        f"<python>print({150 + i} - 12 * 7)</python><result>{150 + i - 84}</result> "
    )
    return (step * (chars // len(step) + 1))[-chars:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chars", type=int, default=650, help="characters per text")
    ap.add_argument("--batch", type=int, default=8, help="texts per embedding call (a decode wave's retrievals)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a retrieval replica uses 1)")
    ap.add_argument("--out", type=Path, default=None, help="JSON report")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from rapo_ray.retrieval.embedder import Embedder

    trimmed = Embedder(pooling="last")
    whole = Embedder(pooling="last", last_position_only=False)  # MiniLM as transformers runs it
    texts = [history(i, args.chars) for i in range(args.batch)]
    tokens = [len(ids) for ids in trimmed.tokenizer(texts, truncation=True, max_length=512)["input_ids"]]
    gap = float(np.abs(trimmed._embed_unique(texts) - whole._embed_unique(texts)).max())  # also the warm-up
    times: dict[str, list[float]] = {"whole": [], "last_position": []}
    for _ in range(args.repeats):
        for name, emb in (("whole", whole), ("last_position", trimmed)):
            t = time.perf_counter()
            emb._embed_unique(texts)
            times[name].append((time.perf_counter() - t) * 1000 / len(texts))
    report = {
        "chars": args.chars,
        "tokens_per_text": statistics.mean(tokens),
        "batch": args.batch,
        "threads": args.threads,
        "repeats": args.repeats,
        "ms_per_text": {k: statistics.median(v) for k, v in times.items()},
        "max_abs_gap": gap,
    }
    ms = report["ms_per_text"]
    print(
        f"{report['tokens_per_text']:.0f} tokens per text, batch {args.batch}, {args.threads} thread(s): "
        f"whole model {ms['whole']:.1f} ms/text, last layer at the last position {ms['last_position']:.1f} ms/text "
        f"({ms['whole'] / ms['last_position']:.2f}x); vectors within {gap:.1e}"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
