"""Cross-request batching: many conversations' ``generate`` calls become one call of the real engine.

Every conversation in a serving replica runs its own agent loop in its own thread. Each turn, the loop
calls ``generate`` for one prompt; ``BatchingEngine`` queues that call, and one batcher thread takes every
call that arrives within ``wait_ms`` of the first (up to ``max_batch_size`` prompts) and runs them through
the wrapped engine together. The wrapped engine is only ever used by the batcher thread, so engines that
need not be thread-safe are fine.

An engine that batches continuously itself (``continuous_batching`` is true: the torch engine on
Qwen2/Llama-shaped models) is called directly from each conversation's thread instead: it admits a new
turn into the running batch at the next decode step, where the batcher would hold it until the whole
current engine call finished.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

from rapo_ray.engines.base import GenerationResult, InferenceEngine, SamplingParams


class BatchingEngine(InferenceEngine):
    name = "batching"

    def __init__(self, engine: InferenceEngine, max_batch_size: int = 64, wait_ms: float = 2.0):
        super().__init__()
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.inner = engine
        self.max_batch_size, self.wait_s = max_batch_size, wait_ms / 1000.0
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # held around every use of the wrapped engine
        self._closed = False
        self.engine_calls = 0  # statistics: engine calls and prompts they carried
        self.prompts_served = 0
        self.passthrough = bool(getattr(engine, "continuous_batching", False))
        self._thread = threading.Thread(target=self._loop, name="engine-batcher", daemon=True)
        if not self.passthrough:
            self._thread.start()

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:  # InferenceEngine.__init__ sets it
        pass

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        if self._closed:
            raise RuntimeError("BatchingEngine is closed")
        if not prompts:
            return []
        if self.passthrough:
            results = self.inner.generate(prompts, params)
            with self._lock:
                self.engine_calls += 1
                self.prompts_served += len(prompts)
            return results
        fut: Future = Future()
        self._queue.put((list(prompts), self._per_prompt(params, len(prompts)), fut))
        return fut.result()

    @property
    def alive(self) -> bool:
        """The batcher thread is running (a replica's health check)."""
        return not self._closed if self.passthrough else self._thread.is_alive()

    def stats(self) -> dict:
        """Engine calls and prompts; for a continuous engine also its decode steps and their mean batch."""
        out = {"engine_calls": self.engine_calls, "prompts": self.prompts_served}
        if self.passthrough:
            out["decode_steps"], out["decode_rows"] = self.inner.decode_steps, self.inner.decode_rows
        return out

    def load_weights(self, state_dict: dict, version: int) -> None:
        if self.passthrough:  # the engine's own step lock keeps the update between decode steps
            self.inner.load_weights(state_dict, version)
            return
        with self._lock:
            self.inner.load_weights(state_dict, version)

    def close(self) -> None:
        self._closed = True
        if not self.passthrough:
            self._queue.put(None)
            self._thread.join(timeout=30)
        self.inner.close()

    def _collect(self, first) -> list:
        items, n = [first], len(first[0])
        deadline = time.monotonic() + self.wait_s
        while n < self.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # close(): finish this batch, then stop
                self._queue.put(None)
                break
            items.append(item)
            n += len(item[0])
        return items

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                break
            items = self._collect(first)
            prompts = [p for ps, _, _ in items for p in ps]
            params = [sp for _, sps, _ in items for sp in sps]
            try:
                with self._lock:
                    results = self.inner.generate(prompts, params)
                self.engine_calls += 1
                self.prompts_served += len(prompts)
            except BaseException as exc:  # every waiting conversation gets the error, the batcher lives on
                for _, _, fut in items:
                    fut.set_exception(exc)
                continue
            start = 0
            for ps, _, fut in items:
                fut.set_result(results[start : start + len(ps)])
                start += len(ps)
