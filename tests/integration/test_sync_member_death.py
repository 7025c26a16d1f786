"""A weight-sync group of four processes whose member dies between two pushes: every survivor returns from the
second push at once, failing it, and none hangs dropping the group.

With gloo's lazy connect this hung (pytorch/gloo#520): in 3 of 12 trials of exactly this case, a sender and the
other receiver stayed in the group's destructor, their device loops spinning; 0 of 12 with every pair connected
as the group formed, which is what groups under ``LAZY_CONNECT_MIN_MEMBERS`` now do."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch
import torch.distributed as dist

from rapo_ray.workers.sync import LAZY_CONNECT_MIN_MEMBERS, SyncGroup, receive_state, send_state
from rapo_ray.workers.weight_layout import TensorSlot, shard_rows

WORLD, SENDERS = 4, 2


def _member(rank: int, port: int, results, pushed_once) -> None:
    """Senders 0-1, receivers 2-3, the group's default connect mode; the last receiver dies after push 1."""
    group = SyncGroup("127.0.0.1", port, "t/", rank, WORLD, timeout_s=60.0)
    weights = {"a": torch.ones(64, 64), "b": torch.full((64, 64), 2.0)}
    rows = {k: shard_rows(64, SENDERS) for k in weights}
    entries = [(k, (64, 64), "float32", rows[k]) for k in weights]

    def local(name):
        first, n = TensorSlot(name, (64, 64), "", 0, 0, rows[name]).rows_of(rank)
        return weights[name][first : first + n]

    def push(version):
        if rank < SENDERS:
            return send_state(group, version, entries, local, SENDERS, 8192)
        return receive_state(group)

    first = push(1)
    if rank >= SENDERS:
        assert first[0] == 1 and torch.equal(first[1]["b"], weights["b"])
    pushed_once.wait()
    if rank == WORLD - 1:
        os._exit(0)  # dies without leaving the group
    time.sleep(0.5)  # (its sockets are closed by then)
    t0 = time.perf_counter()
    try:
        push(2)
        outcome = "pushed"
    except Exception as exc:  # noqa: BLE001 - the outcome is reported to the test
        outcome = type(exc).__name__
    results.put((rank, outcome, time.perf_counter() - t0))
    results.close()
    results.join_thread()
    os._exit(0)


def test_a_member_dying_between_pushes_frees_every_survivor_at_once():
    assert WORLD < LAZY_CONNECT_MIN_MEMBERS  # the group connects every pair as it forms
    ctx = mp.get_context("spawn")
    for trial in range(3):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        results, pushed_once = ctx.Queue(), ctx.Barrier(WORLD)
        procs = [ctx.Process(target=_member, args=(r, store.port, results, pushed_once)) for r in range(WORLD)]
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + 120
        try:
            while len(got) < WORLD - 1 and time.monotonic() < deadline:
                try:
                    rank, outcome, seconds = results.get(timeout=1)
                    got[rank] = (outcome, seconds)
                except Exception:  # noqa: BLE001 - queue.Empty: keep waiting until the deadline
                    pass
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        assert sorted(got) == [0, 1, 2], f"trial {trial}: members {sorted({0, 1, 2} - set(got))} hung; {got}"
        # every survivor failed the push (nothing loaded), and in well under the group's 60 s timeout
        assert all(outcome != "pushed" and seconds < 20 for outcome, seconds in got.values()), got
