"""FSDP2 on real gloo process groups (child processes, no Ray): mixed precision keeps fp32 master weights, and
each rank holds the rows the weight sync expects."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from rapo_ray.workers.weight_layout import shard_rows

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, timeout: int = 240) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _fsdp_rank(rank, world, port, shapes, out_dir):
    """An FSDP2-sharded module on ``world`` gloo ranks: what each rank's ``to_local()`` holds."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = [torch.randn(*s) for s in shapes]
    local = [distribute_tensor(t, mesh, [Shard(0)]).to_local() for t in full]
    torch.save({"local": local, "full": full}, f"{out_dir}/rank{rank}.pt")
    # every rank past its last collective before any tears its group down: a rank closing its gloo pairs while a
    # peer was still in the scatter aborted that peer ("terminate called without an active exception", SIGABRT)
    # about once in 60 runs on a loaded 2-core box
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_mixed_precision_keeps_fp32_master_weights(tiny_model_dir):
    """The learner's bf16 recipe, run on the CPU with the policy it uses on a GPU: bf16 compute, fp32 gradients,
    fp32 sharded parameters and AdamW state; at lr 1e-6 the fp32 master weights take nearly every update,
    where a pure-bf16 model (what the learner did before) rounds most of them away."""
    out = run_python(
        f"""
        import torch, torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from rapo_ray.core.devices import shard_model
        from rapo_ray.model.factory import load_model
        from rapo_ray.core.net import free_port

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


def test_shard_rows_say_which_rows_each_fsdp_rank_holds(tmp_path):
    """Three ranks; dim 0 of 7 (chunks 3, 3, 1), of 2 (1, 1, none) and of 9: the rows that ``shard_rows`` assigns
    to each sender are the rows its FSDP shard holds, so the senders' pieces are each tensor's rows exactly once."""
    from rapo_ray.core.net import free_port

    shapes = [(7, 5), (2,), (9, 2, 3)]
    tmp.start_processes(_fsdp_rank, args=(3, free_port(), shapes, str(tmp_path)), nprocs=3, start_method="spawn")
    blobs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    for i, shape in enumerate(shapes):
        rows = shard_rows(shape[0], 3)
        for r in range(3):
            first = sum(rows[:r])
            assert torch.equal(blobs[r]["local"][i], blobs[0]["full"][i][first : first + rows[r]])
