"""Closed-loop load helpers shared by the benchmarks that drive a service with concurrent clients."""

from __future__ import annotations

import threading
import time
from typing import Callable


def run_clients(client: Callable[[int], None], clients: int) -> float:
    """Run ``client(k)`` for k in 0..clients-1, each in its own thread; wall seconds until all return."""
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t0


def percentile_ms(sorted_latencies_s: list[float], q: float) -> float:
    """The q-quantile (nearest rank, 0 <= q < 1) of sorted latencies in seconds, in milliseconds; NaN if none."""
    if not sorted_latencies_s:
        return float("nan")
    return 1000 * sorted_latencies_s[min(len(sorted_latencies_s) - 1, int(q * len(sorted_latencies_s)))]
