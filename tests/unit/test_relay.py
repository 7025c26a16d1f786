"""``RolloutRelay.fan_out`` without a Ray cluster: stand-in worker handles whose calls are coroutines."""

from __future__ import annotations

import asyncio

import pytest
import ray.exceptions

from rapo_ray.workers.relay import RolloutRelay


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)  # a coroutine: awaited as the relay awaits an ObjectRef


class _Worker:
    """Answers ``rollout(x)`` with ``(wid, x)`` after ``delay`` s, or fails as told."""

    def __init__(self, wid: int, delay: float = 0.0, fail: BaseException | None = None):
        async def rollout(x):
            await asyncio.sleep(delay)
            if fail is not None:
                raise fail
            return (wid, x)

        self.rollout = _Method(rollout)


def test_fan_out_reports_each_worker_apart_and_calls_them_at_once():
    relay = RolloutRelay("node-a")
    assert relay.attach({0: _Worker(0, 0.2), 1: _Worker(1, 0.2), 2: _Worker(2, 0.2)}) == 3
    relay.attach({3: _Worker(3, fail=ray.exceptions.ActorDiedError()), 4: _Worker(4, fail=ValueError("bad prompt"))})
    loop = asyncio.new_event_loop()
    try:
        t0 = loop.time()
        out = loop.run_until_complete(relay.fan_out("rollout", {0: ("a",), 1: ("b",), 2: ("c",), 3: ("d",), 4: ("e",)}))
        took = loop.time() - t0
        assert out["values"] == {0: (0, "a"), 1: (1, "b"), 2: (2, "c")}
        assert out["died"] == {3: "ActorDiedError"}
        assert list(out["errors"]) == [4] and str(out["errors"][4]) == "bad prompt"
        assert took < 0.55  # three 0.2 s calls overlapped, not run one after another (0.6 s)
        # a worker that left the fleet is no longer called; one never attached is an error naming it
        assert relay.detach([0, 1]) == 3
        out = loop.run_until_complete(relay.fan_out("rollout", {0: ("a",), 2: ("c",)}))
        assert out["values"] == {2: (2, "c")} and out["died"] == {}
        with pytest.raises(KeyError, match="node-a: rollout worker 0 was never attached"):
            raise out["errors"][0]
    finally:
        loop.close()
