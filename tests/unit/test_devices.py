"""Devices, generators, precision and determinism (rapo_ray/core/devices.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rapo_ray.core.devices import (
    DeviceError,
    machine_record,
    make_generator,
    mixed_precision_policy,
    parse_device,
    pick_device,
)

ROOT = Path(__file__).resolve().parents[2]


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")


def run_python(code: str, timeout: int = 240) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_pick_device_cpu_without_gpus_and_a_clear_error_when_gpus_are_missing():
    assert pick_device(0, "resources.gpus_per_learner") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match=r"resources.gpus_per_learner=1 asks for a GPU .* set resources"):
            pick_device(1, "resources.gpus_per_learner")


@no_cuda
def test_parse_device():
    assert parse_device("auto") == torch.device("cpu")
    assert parse_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="'gpu0' is not a torch device"):
        parse_device("gpu0")
    with pytest.raises(DeviceError, match="'cuda:1': torch sees no CUDA device"):
        parse_device("cuda:1")


def test_machine_record_names_the_cpu_its_numeric_extensions_and_the_libraries(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n"
    )
    record = machine_record(info)
    assert record["cpu"] == "AMD EPYC 9654"
    assert record["cpu_flags"] == ["avx2", "avx512f", "avx512_bf16", "amx_tile"]  # in NUMERIC_CPU_FLAGS' order
    assert record["torch"] == torch.__version__ and record["cpu_count"] >= 1
    assert record["transformers"] and record["ray"]  # installed with the package
    assert record["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    json.dumps(record)  # written as JSON beside warm starts and run summaries
    # no /proc/cpuinfo (not Linux): platform's processor name or architecture, never an empty field
    missing = machine_record(tmp_path / "absent")
    assert missing["cpu"] and missing["cpu_flags"] == []


def test_make_generator_follows_the_device_and_the_seed():
    a, b = make_generator("cpu", 5), make_generator(torch.device("cpu"), 5)
    assert a.device == torch.device("cpu")
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    torch.manual_seed(3)
    c = make_generator("cpu")
    torch.manual_seed(3)
    d = make_generator("cpu")  # unseeded: drawn from torch's global RNG, so torch.manual_seed fixes it
    assert torch.equal(torch.rand(4, generator=c), torch.rand(4, generator=d))


def test_mixed_precision_policy_only_on_gpu_with_bf16():
    assert mixed_precision_policy(True, torch.device("cpu")) is None
    assert mixed_precision_policy(False, torch.device("cuda", 0)) is None
    policy = mixed_precision_policy(True, torch.device("cuda", 0))
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32


def test_set_deterministic_switches_kernels_and_attention():
    out = run_python(
        """
        import torch
        from rapo_ray.core.devices import set_deterministic
        set_deterministic(False)
        print(torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.flash_sdp_enabled())
        set_deterministic(True)
        print(torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
              torch.backends.cudnn.deterministic)
        """
    )
    assert out.split("\n")[:2] == ["False True", "True False False True True"]


def test_embedder_device_option():
    from rapo_ray.retrieval.embedder import Embedder

    emb = Embedder(device="cpu")
    vec = emb.embed(["what is 2+3?", "the capital of France"])
    assert emb.device == torch.device("cpu") and vec.shape == (2, emb.dim)
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="'cuda'"):
            Embedder(device="cuda")
