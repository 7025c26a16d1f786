"""The smallest held-out difference between two arms that a paired design detects with a given power.

    .venv/bin/python benchmarks/power.py --problems 422 --seeds 3 --discordant 0.04,0.08,0.12

Two arms (say RAPO and GRPO) answer the same held-out problems, once per seed; pooled over seeds that is
problems x seeds pairs. The test is the exact two-sided sign test on the discordant pairs (McNemar's exact test, the
one ``paired_change`` and compare_algorithms report): only pairs where one arm is right and the other wrong count.
With D discordant pairs, the arm ahead wins each with probability q; a difference of accuracy points
delta = D (2q - 1) / pairs. For each expected discordant share (``--discordant``: the fraction of pairs where the two
arms disagree; measure it from a run's before/after flips or two seeds of one arm), this finds the smallest delta
whose power reaches ``--power`` at level ``--alpha``.
"""

from __future__ import annotations

import argparse
import json
import sys
from math import comb


def sign_test_rejects(discordant: int, alpha: float) -> list[bool]:
    """For each count k of the discordant pairs won by one arm (0..D): whether the exact two-sided sign test at
    ``alpha`` rejects "no difference"."""
    d = discordant
    pmf = [comb(d, k) / 2**d for k in range(d + 1)]
    out = []
    for k in range(d + 1):
        low = min(k, d - k)
        p = min(1.0, 2 * sum(pmf[: low + 1]))
        out.append(p < alpha)
    return out


def power(discordant: int, q: float, alpha: float) -> float:
    """P(the test rejects) when each discordant pair goes to the better arm with probability ``q``."""
    rejects = sign_test_rejects(discordant, alpha)
    return sum(comb(discordant, k) * q**k * (1 - q) ** (discordant - k) for k in range(discordant + 1) if rejects[k])


def min_detectable_difference(pairs: int, discordant_share: float, alpha: float = 0.05, target: float = 0.8) -> float:
    """The smallest accuracy difference (a fraction of the pairs) detected with power ``target``; 1.0 if none is."""
    if pairs < 1 or not 0 < discordant_share <= 1:
        raise ValueError(f"need pairs >= 1 and a discordant share in (0, 1], got {pairs} and {discordant_share}")
    d = round(pairs * discordant_share)
    if d == 0:
        return 1.0
    for wins in range(d // 2, d + 1):  # the better arm's expected share of the discordant pairs, in steps of 1/d
        q = wins / d
        if power(d, q, alpha) >= target:
            return d * (2 * q - 1) / pairs
    return 1.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, required=True, help="held-out problems per seed")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--discordant", default="0.04,0.08,0.12", help="expected shares of pairs where the arms differ")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--power", type=float, default=0.8)
    args = ap.parse_args()
    pairs = args.problems * args.seeds
    rows = {}
    for share in (float(x) for x in args.discordant.split(",")):
        mdd = min_detectable_difference(pairs, share, args.alpha, args.power)
        rows[str(share)] = {"discordant_pairs": round(pairs * share), "min_detectable_points": round(100 * mdd, 2)}
        print(f"discordant {share:.0%} ({round(pairs * share)} of {pairs} pairs): {100 * mdd:.2f} points")
    print(json.dumps({"pairs": pairs, "alpha": args.alpha, "power": args.power, "by_discordant_share": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
