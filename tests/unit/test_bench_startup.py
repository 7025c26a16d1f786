"""benchmarks/startup.py's medians against hand-computed values."""

from __future__ import annotations

from tests.helpers import benchmark_module


def test_medians_per_key_and_per_stage():
    bench = benchmark_module("startup")
    runs = [
        {"wall_s": w, "startup_total_s": t, "step_s": 1.0, "end_s": e, "startup_s": {"ray": r, "fleet": f}}
        for w, t, e, r, f in [(30.0, 25.0, 3.0, 4.0, 8.0), (40.0, 31.0, 5.0, 3.0, 12.0), (35.0, 28.0, 4.0, 5.0, 9.0)]
    ]
    assert bench.medians(runs) == {
        "wall_s": 35.0,
        "startup_total_s": 28.0,
        "step_s": 1.0,
        "end_s": 4.0,
        "startup_s": {"ray": 4.0, "fleet": 9.0},
    }
    # a commit from before the start-up timer: no stages, the rest as usual
    old = [dict(r, startup_s={}, startup_total_s=0.0) for r in runs]
    assert bench.medians(old)["startup_s"] == {} and bench.medians(old)["wall_s"] == 35.0
