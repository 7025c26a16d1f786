"""``RolloutRelay``: one actor per node that makes the fleet's calls to that node's rollout workers.

The driver's cost of a rollout round grows with the number of calls it makes, not with their size: each Ray call
costs the caller its submission and its reply, about a millisecond of CPU, so a 1,000-worker fleet spent about a
second of driver CPU per step on calls alone. Through relays the driver makes one call per node per round. The
relay, placed on the workers' node, calls each of its workers at once and answers when every call has ended, with
each worker's outcome apart (its value, that it died, or the error it raised), so the fleet keeps its exactly-once
accounting per worker.

The module imports only Ray and the error types: a relay process starts without torch or transformers.
"""

from __future__ import annotations

import asyncio

from rapo_ray.core.errors import WORKER_DIED


class RolloutRelay:
    """An async Ray actor (``ray.remote(num_cpus=0)``, placed on its workers' node) holding the handles of that
    node's workers. ``fan_out`` answers::

        {"values": {worker_id: value}, "died": {worker_id: error type name}, "errors": {worker_id: exception}}
    """

    def __init__(self, node_id: str | None = None):
        self.node_id = node_id
        self.workers: dict[int, object] = {}

    def attach(self, handles: dict[int, object]) -> int:
        """Add (or replace) worker handles by worker id; returns how many the relay holds."""
        self.workers.update(handles)
        return len(self.workers)

    def detach(self, worker_ids: list[int]) -> int:
        """Forget workers that left the fleet; returns how many the relay holds."""
        for wid in worker_ids:
            self.workers.pop(wid, None)
        return len(self.workers)

    async def fan_out(self, method: str, calls: dict[int, tuple]) -> dict:
        """Call ``method(*args)`` on every worker of ``calls`` (worker id -> its arguments) at once and wait for all
        of them. A worker the relay does not hold is reported as an error naming it."""
        unknown = sorted(set(calls) - set(self.workers))
        errors: dict[int, BaseException] = {
            wid: KeyError(f"relay on node {self.node_id}: rollout worker {wid} was never attached") for wid in unknown
        }
        ids = [wid for wid in calls if wid not in errors]
        outcomes = await asyncio.gather(
            *(getattr(self.workers[wid], method).remote(*calls[wid]) for wid in ids), return_exceptions=True
        )
        values, died = {}, {}
        for wid, outcome in zip(ids, outcomes):
            if isinstance(outcome, WORKER_DIED):
                died[wid] = type(outcome).__name__
            elif isinstance(outcome, BaseException):
                errors[wid] = outcome
            else:
                values[wid] = outcome
        return {"values": values, "died": died, "errors": errors}
