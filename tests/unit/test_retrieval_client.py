"""The rollout worker's retrieval client over a stand-in deployment handle (no Ray, no Serve)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from rapo_ray.core.errors import RetrievalFailed, brief
from rapo_ray.retrieval.client import HandleStepRetriever


class _Response:
    def __init__(self, value):
        self.value = value

    def result(self, timeout_s=None):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


class _Method:
    def __init__(self, handle, name):
        self.handle, self.name = handle, name

    def remote(self, *args):
        self.handle.calls.append((self.name, args))
        return _Response(self.handle.answers[self.name])


class _Handle:
    """Answers ``handle.<method>.remote(...).result()`` from a dict, recording the calls."""

    def __init__(self, **answers):
        self.answers, self.calls = answers, []

    def __getattr__(self, name):
        return _Method(self, name)


HIT = {"value": "<think>a</think>", "value_ids": [5, 6], "score": 2.5, "reward": 1.0, "meta": {"question_id": "q7"}}


def test_brief_keeps_the_type_and_the_first_line_only():
    assert brief(RuntimeError("replica died\n  Traceback ...\n  more")) == "RuntimeError: replica died"
    assert brief(TimeoutError()) == "TimeoutError: "


def test_retrieve_sends_clipped_queries_and_returns_top_1_steps_or_none():
    handle = _Handle(retrieve=[[HIT], []])
    client = HandleStepRetriever(handle, max_chars=4)
    first, second = client.retrieve(["abcdefgh", "xy"], ["q1", "q2"])
    assert handle.calls == [("retrieve", (["efgh", "xy"], 1, None))]
    assert (first.value, first.value_ids, first.score, first.reward, first.question_id) == (
        "<think>a</think>",
        [5, 6],
        2.5,
        1.0,
        "q7",
    )
    assert second is None


def test_a_failed_call_is_retrieval_failed_counted_and_logged_on_one_line(caplog):
    client = HandleStepRetriever(_Handle(retrieve=RuntimeError("replica died\nTraceback (most recent call last)")))
    with caplog.at_level(logging.WARNING, logger="rapo_ray.retrieval"):
        for _ in range(2):
            with pytest.raises(RetrievalFailed, match="RuntimeError: replica died"):
                client.retrieve(["q"], ["q1"])
    assert client.failures == 2
    assert [r.getMessage() for r in caplog.records] == [
        "retrieval failed (1 so far; those slots take a policy step instead): RuntimeError: replica died"
    ]


class _GatedHandle(_Handle):
    """The first request blocks until ``gate`` is set; every request answers one row per query (its text)."""

    def __init__(self):
        super().__init__()
        self.gate, self.first_sent = threading.Event(), threading.Event()

    def __getattr__(self, name):
        handle = self

        class _M:
            def remote(self, queries, k, filters):
                handle.calls.append((name, list(queries), filters))
                if len(handle.calls) == 1:
                    handle.first_sent.set()
                    handle.gate.wait(5)
                if any(q == "boom" for q in queries):
                    return _Response(RuntimeError("replica died"))
                return _Response([[dict(HIT, value=q)] for q in queries])

        return _M()


def _wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _retrieve_in_threads(client, calls):
    results = [None] * len(calls)

    def run(i, queries, ids):
        try:
            results[i] = [s.value for s in client.retrieve(queries, ids)]
        except RetrievalFailed as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, *c)) for i, c in enumerate(calls)]
    for th in threads:
        th.start()
    return threads, results


def test_calls_that_arrive_while_a_request_is_in_flight_go_out_together_and_each_gets_its_own_rows():
    handle = _GatedHandle()
    client = HandleStepRetriever(handle, question_scope="other")
    first, _ = _retrieve_in_threads(client, [(["a"], ["q1"])])
    assert handle.first_sent.wait(5)
    waiting, results = _retrieve_in_threads(client, [(["b", "c"], ["q2", "q3"]), (["d"], ["q4"]), (["e"], ["q5"])])
    _wait_until(lambda: len(client._waiting) == 3)  # all three queued behind the request in flight
    handle.gate.set()
    for th in first + waiting:
        th.join(5)
    assert results == [["b", "c"], ["d"], ["e"]]
    assert [c[1] for c in handle.calls] == [["a"], ["b", "c", "d", "e"]]
    assert handle.calls[1][2] == [("other", "q2"), ("other", "q3"), ("other", "q4"), ("other", "q5")]
    assert client.requests == 2 and not client._sending and not client._waiting
    assert client.retrieve(["f"])[0].value == "f" and client.requests == 3  # alone: sent at once


def test_a_failed_coalesced_request_fails_every_call_in_it_and_the_next_call_is_sent_again():
    handle = _GatedHandle()
    client = HandleStepRetriever(handle)
    first, first_result = _retrieve_in_threads(client, [(["a"], None)])
    assert handle.first_sent.wait(5)
    waiting, results = _retrieve_in_threads(client, [(["boom"], None), (["b"], None)])
    _wait_until(lambda: len(client._waiting) == 2)
    handle.gate.set()
    for th in first + waiting:
        th.join(5)
    assert first_result == [["a"]]
    assert all(isinstance(r, RetrievalFailed) and "replica died" in str(r) for r in results)
    assert client.failures == 1 and client.retrieve(["c"])[0].value == "c"


def test_without_coalescing_every_call_is_its_own_request():
    handle = _GatedHandle()
    handle.gate.set()
    client = HandleStepRetriever(handle, coalesce=False)
    threads, results = _retrieve_in_threads(client, [([q], None) for q in "abcd"])
    for th in threads:
        th.join(5)
    assert results == [["a"], ["b"], ["c"], ["d"]] and client.requests == len(handle.calls) == 4
