"""The rollout worker's side of the retrieval service (``rapo_ray.retrieval.service``): calls through a Serve
deployment handle the caller obtained. Serve itself is not imported here, so a worker that retrieves nothing (GRPO,
ARPO, evaluation) does not load it."""

from __future__ import annotations

import logging
import random

from rapo_ray.agent.retriever import RetrievedStep, question_filter
from rapo_ray.core.errors import RetrievalFailed

log = logging.getLogger("rapo_ray.retrieval")

# The options a caller's deployment handle is given (``handle.options(**HANDLE_OPTIONS)``): requests go to the
# replicas over Serve's gRPC data plane instead of as Ray actor calls, as Ray Serve's throughput-optimized mode does
# for every handle (``RAY_SERVE_USE_GRPC_BY_DEFAULT``); it costs the caller and the replica less CPU per request.
HANDLE_OPTIONS = {"_by_reference": False}


class HandleStepRetriever:
    """``StepRetriever`` over the Serve deployment handle (given ``HANDLE_OPTIONS`` by its caller), top-1 by score
    (spec §8.4), optional noise."""

    def __init__(
        self,
        handle,
        noise_prob: float = 0.0,
        question_scope: str = "any",
        seed: int = 0,
        max_chars: int = 1300,
        timeout_s: float = 30.0,
    ):
        self.handle, self.noise_prob, self.question_scope = handle, noise_prob, question_scope
        self.rng = random.Random(seed)
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        self.failures = 0
        self._noise_pool: list[dict] = []

    def _call(self, method: str, *args):
        """One call through the handle; whatever goes wrong there (a dead replica, a timeout, the controller
        restarting) is ``RetrievalFailed``: the slot degrades, Serve brings the replica back on its own."""
        try:
            return getattr(self.handle, method).remote(*args).result(timeout_s=self.timeout_s)
        except Exception as exc:
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning(
                    "retrieval failed (%d so far; those slots take a policy step instead): %s: %s",
                    self.failures,
                    type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "",
                )
            raise RetrievalFailed(f"{type(exc).__name__}: {exc}") from None

    def retrieve(self, queries, question_ids=None):
        if not queries:
            return []
        filters = question_filter(self.question_scope, question_ids, len(queries))
        rows = self._call("retrieve", [q[-self.max_chars :] for q in queries], 1, filters)
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
