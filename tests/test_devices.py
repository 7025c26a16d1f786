"""Devices, generators, precision and determinism (rapo_ray/devices.py), and the GPU acceptance check.

The GPU branches share this logic; on a machine without CUDA these tests pin it down on the CPU, and the
``gpu``-marked test runs the acceptance check itself where CUDA is present.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rapo_ray.devices import (
    DeviceError,
    machine_record,
    make_generator,
    mixed_precision_policy,
    parse_device,
    pick_device,
)

ROOT = Path(__file__).resolve().parents[1]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")


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


def run_python(code: str, timeout: int = 240) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_set_deterministic_switches_kernels_and_attention():
    out = run_python(
        """
        import torch
        from rapo_ray.devices import set_deterministic
        set_deterministic(False)
        print(torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.flash_sdp_enabled())
        set_deterministic(True)
        print(torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
              torch.backends.cudnn.deterministic)
        """
    )
    assert out.split("\n")[:2] == ["False True", "True False False True True"]


def test_fsdp_mixed_precision_keeps_fp32_master_weights(tiny_model_dir):
    """The learner's bf16 recipe, run on the CPU with the policy it uses on a GPU: bf16 compute, fp32 gradients,
    fp32 sharded parameters and AdamW state; at lr 1e-6 the fp32 master weights take nearly every update,
    where a pure-bf16 model (what the learner did before) rounds most of them away."""
    out = run_python(
        f"""
        import torch, torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from rapo_ray.devices import shard_model
        from rapo_ray.model import load_model
        from rapo_ray.net import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{free_port()}}", rank=0, world_size=1)

        def one_update(model):
            before = {{k: v.detach().clone() for k, v in model.state_dict().items()}}
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
            logits = model(input_ids=ids).logits
            logits.float().logsumexp(-1).mean().backward()
            grads = {{str(p.grad.dtype) for p in model.parameters()}}
            opt.step()
            after = model.state_dict()
            local = lambda t: t.to_local() if hasattr(t, "to_local") else t
            changed = sum(int((local(after[k]) != local(before[k])).sum()) for k in before)
            total = sum(local(v).numel() for v in before.values())
            adam = {{str(s["exp_avg"].dtype) for s in opt.state.values()}}
            return str(logits.dtype), grads, adam, changed / total

        mp = load_model("{tiny_model_dir}")
        shard_model(mp, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        compute, grads, adam, frac_mp = one_update(mp)
        master = {{str(p.dtype) for p in mp.parameters()}}
        pure = load_model("{tiny_model_dir}", dtype="bfloat16")
        frac_bf16 = one_update(pure)[3]
        print(compute, sorted(grads), sorted(master), sorted(adam), round(frac_mp, 3), round(frac_bf16, 3))
        dist.destroy_process_group()
        """
    )
    frac_mp, frac_bf16 = (float(x) for x in out.split()[-2:])
    assert out.startswith("torch.bfloat16 ['torch.float32'] ['torch.float32'] ['torch.float32']"), out
    assert frac_mp > 0.9 and frac_bf16 < 0.5, out


def test_embedder_device_option():
    from rapo_ray.retrieval.embedder import Embedder

    emb = Embedder(device="cpu")
    vec = emb.embed(["what is 2+3?", "the capital of France"])
    assert emb.device == torch.device("cpu") and vec.shape == (2, emb.dim)
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="'cuda'"):
            Embedder(device="cuda")


def test_gpu_check_runs_its_checks_on_the_cpu(tmp_path):
    """The acceptance command end to end where there is no GPU: every check but vLLM's runs and passes."""
    report = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_check.py",
            "--device",
            "cpu",
            "--quick",
            "--artifacts",
            str(tmp_path / "models"),
            "--out",
            str(report),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(report.read_text())["checks"]
    status = {name: c["status"] for name, c in checks.items()}
    assert status.pop("vllm: greedy and weight load") == "SKIP"
    assert set(status.values()) == {"PASS"}, status
    assert checks["engine: greedy, seeded sampling, logprobs"]["greedy_equals_generate"] == "3/3"
    assert checks["learner: one bf16 mixed-precision update"]["weights_changed_frac"] > 0.9
    assert "GPU check on" in proc.stdout and "report:" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_check_on_cuda(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--device", "cuda", "--size", "bundled", "--quick"]
        + ["--artifacts", str(tmp_path / "models"), "--out", str(tmp_path / "gpu.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
