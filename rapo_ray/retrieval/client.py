"""The rollout worker's side of the retrieval service (``rapo_ray.retrieval.service``): calls through a Serve
deployment handle the caller obtained. Serve itself is not imported here, so a worker that retrieves nothing (GRPO,
ARPO, evaluation) does not load it."""

from __future__ import annotations

import logging
import random
import threading

from rapo_ray.agent.retriever import RetrievedStep, question_filter
from rapo_ray.core.errors import RetrievalFailed, brief

log = logging.getLogger("rapo_ray.retrieval")

# The options a caller's deployment handle is given (``handle.options(**HANDLE_OPTIONS)``): requests go to the
# replicas over Serve's gRPC data plane instead of as Ray actor calls, as Ray Serve's throughput-optimized mode does
# for every handle (``RAY_SERVE_USE_GRPC_BY_DEFAULT``); it costs the caller and the replica less CPU per request.
HANDLE_OPTIONS = {"_by_reference": False}


class _PendingCall:
    """One ``retrieve`` call waiting to be sent in a coalesced request."""

    __slots__ = ("queries", "filters", "done", "lead", "rows", "error")

    def __init__(self, queries: list[str], filters: list | None):
        self.queries, self.filters = queries, filters
        self.done = threading.Event()
        self.lead = False  # this call's thread sends the next request
        self.rows: list | None = None
        self.error: Exception | None = None


class HandleStepRetriever:
    """``StepRetriever`` over the Serve deployment handle (given ``HANDLE_OPTIONS`` by its caller), top-1 by score
    (spec §8.4), optional noise.

    Calls from several threads at once (the per-trajectory schedule retrieves for each trajectory in its own
    thread) are coalesced: while one request is in flight, the calls that arrive wait, and go out together as the
    next request. A Serve request costs the caller and the replica a fixed amount of CPU whatever its size, so one
    request for many queries is what keeps many concurrent callers fast; a lone call is sent at once, with no wait.
    ``coalesce=False`` sends one request per call.
    """

    def __init__(
        self,
        handle,
        noise_prob: float = 0.0,
        question_scope: str = "any",
        seed: int = 0,
        max_chars: int = 1300,
        timeout_s: float = 30.0,
        coalesce: bool = True,
    ):
        self.handle, self.noise_prob, self.question_scope = handle, noise_prob, question_scope
        self.rng = random.Random(seed)
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        self.failures = 0
        self._noise_pool: list[dict] = []
        self.coalesce = coalesce
        self.requests = 0  # retrieve requests sent (fewer than calls when calls were coalesced)
        self._lock = threading.Lock()
        self._waiting: list[_PendingCall] = []
        self._sending = False

    def _call(self, method: str, *args):
        """One call through the handle; whatever goes wrong there (a dead replica, a timeout, the controller
        restarting) is ``RetrievalFailed``: the slot degrades, Serve brings the replica back on its own."""
        try:
            return getattr(self.handle, method).remote(*args).result(timeout_s=self.timeout_s)
        except Exception as exc:
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning(
                    "retrieval failed (%d so far; those slots take a policy step instead): %s",
                    self.failures,
                    brief(exc),
                )
            raise RetrievalFailed(f"{type(exc).__name__}: {exc}") from None

    def _request(self, queries: list[str], filters: list | None) -> list:
        self.requests += 1
        return self._call("retrieve", queries, 1, filters)

    def _send_coalesced(self, queries: list[str], filters: list | None) -> list:
        call = _PendingCall(queries, filters)
        with self._lock:
            self._waiting.append(call)
            if not self._sending:
                self._sending = call.lead = True
        if not call.lead:
            call.done.wait()  # answered, or handed the lead for the next request
        if call.lead:
            self._send_waiting()
        if call.error is not None:
            raise call.error
        return call.rows

    def _send_waiting(self) -> None:
        """Send every waiting call as one request, answer each, and hand the lead to a call that arrived meanwhile."""
        with self._lock:
            batch, self._waiting = self._waiting, []
        queries = [q for c in batch for q in c.queries]
        filters = None
        if any(c.filters is not None for c in batch):
            filters = [f for c in batch for f in (c.filters if c.filters is not None else [None] * len(c.queries))]
        try:
            rows = self._request(queries, filters)
            if len(rows) != len(queries):
                raise RetrievalFailed(f"the retrieval service answered {len(rows)} rows for {len(queries)} queries")
            start = 0
            for c in batch:
                c.rows, start = rows[start : start + len(c.queries)], start + len(c.queries)
        except Exception as exc:  # RetrievalFailed, or a bug: every waiting caller gets it, none waits forever
            for c in batch:
                c.error = exc
        with self._lock:
            nxt = self._waiting[0] if self._waiting else None
            if nxt is None:
                self._sending = False
            else:
                nxt.lead = True
        for c in batch:
            c.lead = False
            c.done.set()
        if nxt is not None:
            nxt.done.set()

    def retrieve(self, queries, question_ids=None):
        if not queries:
            return []
        filters = question_filter(self.question_scope, question_ids, len(queries))
        queries = [q[-self.max_chars :] for q in queries]
        rows = self._send_coalesced(queries, filters) if self.coalesce else self._request(queries, filters)
        out = []
        for row in rows:
            if not row:
                out.append(None)
                continue
            hit = row[0]
            if self.noise_prob and self.rng.random() < self.noise_prob:
                if not self._noise_pool:
                    self._noise_pool = self._call("sample", 256, self.rng.randrange(2**31))
                if self._noise_pool:
                    hit = self.rng.choice(self._noise_pool) | {"score": 0.0, "meta": {"question_id": "", "noise": True}}
            out.append(
                RetrievedStep(
                    hit["value"],
                    list(hit["value_ids"]),
                    float(hit["score"]),
                    float(hit["reward"]),
                    hit["meta"].get("question_id", ""),
                    bool(hit["meta"].get("noise", False)),
                )
            )
        return out
