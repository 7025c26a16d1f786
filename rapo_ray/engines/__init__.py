"""Inference engines behind one interface: vLLM (default where it imports) and torch (fallback, tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from rapo_ray.engines.base import GenerationResult, InferenceEngine, SamplingParams
from rapo_ray.engines.simulated import SimulatedEngine
from rapo_ray.engines.torch_engine import TorchEngine
from rapo_ray.engines.vllm_engine import VLLMEngine, vllm_available

__all__ = ["GenerationResult", "InferenceEngine", "SamplingParams", "make_engine", "resolve_engine_name"]


def resolve_engine_name(requested: str) -> str:
    """``auto`` -> ``vllm`` where vLLM imports, else ``torch``; an explicit ``vllm`` must import."""
    if requested == "auto":
        return "vllm" if vllm_available() else "torch"
    if requested == "vllm" and not vllm_available():
        raise RuntimeError(
            "rollout.engine=vllm but vLLM does not import here; install the cpu/gpu extra or use rollout.engine=torch"
        )
    if requested not in ("vllm", "torch", "simulated"):
        raise ValueError(f"rollout.engine={requested!r}; valid: auto, vllm, torch, simulated")
    return requested


def make_engine(
    rollout_cfg,
    model_dir: str | Path,
    loader: Callable[[str | Path, str], tuple],
    dtype: str = "float32",
    max_model_len: int = 1024,
    seed: int = 0,
    device: str = "cpu",
) -> InferenceEngine:
    """Build the configured engine on an HF model folder. ``loader(model_dir, dtype) -> (model, tokenizer)``
    loads it for the torch engine (vLLM loads the folder itself); rapo_ray.model.factory.load_model_and_tokenizer
    is the usual one. ``device`` places the torch engine (vLLM finds its GPU itself)."""
    name = resolve_engine_name(rollout_cfg.engine)
    if name == "vllm":
        return VLLMEngine(
            model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            kv_cache_gb=rollout_cfg.vllm_kv_cache_gb,
            block_size=rollout_cfg.vllm_block_size,
            enable_prefix_caching=rollout_cfg.vllm_enable_prefix_caching,
            gpu_memory_utilization=rollout_cfg.vllm_gpu_memory_utilization,
            logprobs_topk=rollout_cfg.vllm_logprobs_topk,
            seed=seed,
            threads=rollout_cfg.threads_per_worker,
            max_num_seqs=rollout_cfg.vllm_max_num_seqs,
        )

    if name == "simulated":
        _, tokenizer = loader(model_dir, dtype)
        return SimulatedEngine(
            tokenizer,
            rollout_cfg.simulated_token_ms,
            rollout_cfg.simulated_min_tokens,
            rollout_cfg.simulated_max_tokens,
            seed=seed,
        )
    return TorchEngine(*loader(model_dir, dtype), device=device, decode=rollout_cfg.torch_decode)
