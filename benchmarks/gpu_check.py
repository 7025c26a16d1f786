"""GPU acceptance check (issue #18): one command that says whether this machine's GPU path works, and how fast.

    python benchmarks/gpu_check.py                   # on a CUDA machine: the Qwen2.5-0.5B shape, full sizes
    python benchmarks/gpu_check.py --preset smollm2-135m-instruct   # the real model (its package installed)
    python benchmarks/gpu_check.py --model-dir DIR   # any HF folder; one with config and tokenizer but no weights
                                                     # is initialised at random from its config (timings only)
    python benchmarks/gpu_check.py --device cpu --quick   # the same checks on the CPU, small (the suite runs it)

Needs only torch and transformers (a bare GPU box may have nothing else): the vLLM part runs where vLLM imports
and is skipped, saying so, where it does not. Ray and Milvus are never needed: the retrieval check runs the
replica's batch path (embed a batch of histories, exact search over an in-memory copy of stored steps), which is
what a Serve retrieval replica does per batch.

Checks (each PASS / FAIL / SKIP with its numbers):
- engine greedy == ``generate`` token for token in fp32, logprobs equal a teacher-forced pass;
- seeded sampling (temperature 1, top-p 0.9) repeats exactly, and its logprobs equal a teacher-forced pass;
- one learner update (world size 1, NCCL on CUDA, gloo on CPU, FSDP2) in bf16 mixed precision at the paper's
  lr 1e-6: finite loss and gradient norm, fp32 master weights that moved;
- the updated weights loaded into the engine: the engine's logprobs equal the updated model's;
- the colocated handoff (``resources.colocate``): the updated weights exported as a learner rank does and read by
  another process, bit for bit (CUDA IPC on a GPU, /dev/shm on the CPU);
- vLLM (where it imports, CUDA only): greedy == ``generate`` and the same weight load;
- throughput: torch engine vs ``generate`` tokens/s at batch 16/64/256 (the model's dtype: bf16 on CUDA), the engine's
  decode step as CUDA graphs (the default on CUDA) and dynamic;
- the learner's compute at a recipe's shape (``--learner-shape``, default 8 rows x 640 tokens, micro-batches of 2):
  the old-log-prob pass and one PPO update through the calls ``LearnerWorker`` makes (FSDP2, world size 1, bf16
  mixed precision), seconds, tokens/s and peak GPU memory;
- embedder texts/s and latency p50/p99 at batch 1 and 32 (1,300-character histories), and the retrieval batch
  path (embed 32 queries + exact top-3 over 50k stored steps) with its recall@1 against brute force.

Writes a JSON report (``--out``) and prints a table; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The lent GPU machine has the working tree but no install of rapo_ray (and no Ray, vLLM or Milvus): import it from
# the tree, so `python benchmarks/gpu_check.py` runs there as it does here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rapo_ray.core.devices import make_generator, mixed_precision_policy, parse_device, shard_model  # noqa: E402
from rapo_ray.engines import SamplingParams  # noqa: E402
from rapo_ray.engines.torch_engine import TorchEngine  # noqa: E402
from rapo_ray.envs import tasks  # noqa: E402
from rapo_ray.types import protocol  # noqa: E402


class Skip(Exception):
    pass


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model_dir(size: str, artifacts: str) -> Path:
    """The bundled tokenizer with a randomly initialised model of the named shape (built once under artifacts)."""
    from rapo_ray.config import load_config
    from rapo_ray.model.factory import ensure_bundled_model

    cfg = load_config(overrides=[f"run.artifacts_dir={artifacts}", f"model.size={size}"])
    return ensure_bundled_model(cfg)


def random_init_dir(source: Path, artifacts: str) -> Path:
    """An HF folder with ``source``'s config and tokenizer and seeded random weights: for a folder whose weights
    cannot travel (a GPU box that only gets the config and tokenizer). Built once under ``artifacts``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rapo_ray.model.factory import load_tokenizer, save_model

    out = Path(artifacts) / f"{source.name}-random-init"
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(source)), dtype=torch.float32)
        save_model(model, load_tokenizer(source), out)
    return out


def resolve_model(args, device_type: str) -> tuple[Path, str, str]:
    """(HF folder, its name in the report, where its weights come from) for ``--preset``, ``--model-dir`` or
    ``--size`` (default: the 0.5B shape on CUDA, the bundled model elsewhere)."""
    from rapo_ray.model.factory import has_weights

    if args.preset:
        from rapo_ray.model.gguf import ensure_converted, packaged_gguf

        return ensure_converted(packaged_gguf(args.preset), args.artifacts, args.preset), args.preset, "trained"
    if args.model_dir:
        source = Path(args.model_dir).expanduser()
        if not (source / "config.json").is_file() or not (source / "tokenizer.json").is_file():
            raise SystemExit(f"--model-dir {source}: needs config.json and tokenizer.json (an HF model folder)")
        if has_weights(source):
            return source, source.name, "trained"
        print(f"--model-dir {source} has no weights: initialising them at random from its config (timings only)")
        return random_init_dir(source, args.artifacts), source.name, "random init from config"
    size = args.size or ("qwen2.5-0.5b" if device_type == "cuda" else "bundled")
    return build_model_dir(size, args.artifacts), size, "random init"


def load(model_dir: Path, device: torch.device, dtype=torch.float32, scale: float = 8.0):
    """The model with its embedding scaled (8x by default): random init gives near-uniform logits, and greedy
    comparisons between two correct implementations would then be decided by float noise."""
    from rapo_ray.model.factory import load_model

    model = load_model(model_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(scale)
    return model.to(device=device, dtype=dtype).eval()


def prompts_for(tok, n: int) -> list[list[int]]:
    probs = tasks.generate("arith", "test", n, 0)
    return [tok(protocol.render_prompt(p.question), add_special_tokens=False)["input_ids"] for p in probs]


def teacher_forced(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + generated], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(generated, device=device)[:, None])[:, 0].cpu()


def max_logprob_gap(model, prompts, results) -> float:
    gaps = [
        (torch.tensor(r.logprobs) - teacher_forced(model, p, r.token_ids)).abs().max().item()
        for p, r in zip(prompts, results)
    ]
    return max(gaps)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


# ---------------------------------------------------------------- checks


def check_engine(model_dir, tok, device, n_prompts: int, new_tokens: int) -> dict:
    model = load(model_dir, device)
    engine = TorchEngine(load(model_dir, device), tok, max_batch_size=n_prompts)
    prompts = prompts_for(tok, n_prompts)
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    same = sum(r.token_ids == hf_greedy(model, p, new_tokens) for p, r in zip(prompts, greedy))
    greedy_gap = max_logprob_gap(model, prompts, greedy)
    # sampling on the unscaled model, whose flat distributions make samples differ from greedy
    model = load(model_dir, device, scale=1.0)
    engine = TorchEngine(load(model_dir, device, scale=1.0), tok, max_batch_size=n_prompts)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=new_tokens, ignore_eos=True, seed=7)
    a = engine.generate(prompts, sp)
    b = engine.generate(prompts, sp)
    plain = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    out = {
        "greedy_equals_generate": f"{same}/{len(prompts)}",
        "greedy_logprob_gap": greedy_gap,
        "seeded_sampling_repeats": all(x.token_ids == y.token_ids for x, y in zip(a, b)),
        "sampled_logprob_gap": max_logprob_gap(model, prompts, a),
        "samples_unlike_greedy": f"{sum(x.token_ids != g.token_ids for x, g in zip(a, plain))}/{len(prompts)}",
    }
    out["ok"] = (
        same == len(prompts)
        and out["greedy_logprob_gap"] < 1e-3
        and out["seeded_sampling_repeats"]
        and out["sampled_logprob_gap"] < 1e-3
    )
    return out


@contextlib.contextmanager
def one_rank_learner(model_dir, device):
    """(model, AdamW at lr 1e-6) as a learner rank holds them: a process group of one (NCCL on CUDA, gloo on CPU),
    fp32 master weights sharded by FSDP2 with bf16 mixed precision on CUDA. The group is destroyed on exit."""
    import torch.distributed as dist

    from rapo_ray.core.net import free_port
    from rapo_ray.model.factory import load_model

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = load_model(model_dir).to(device).train()  # fp32 master weights
        shard_model(model, mixed_precision_policy(True, device))
        yield model, torch.optim.AdamW(model.parameters(), lr=1e-6)
    finally:
        dist.destroy_process_group()


def check_learner_update(model_dir, tok, device, state: dict) -> dict:
    """One RAPO/GRPO policy-loss update on FSDP2 (world size 1) in bf16 mixed precision at lr 1e-6."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rapo_ray.algos.loss import PolicyLossConfig, policy_loss

    with one_rank_learner(model_dir, device) as (model, opt):
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        gen = make_generator("cpu", 0)
        ids = torch.randint(0, len(tok), (4, 64), generator=gen, device="cpu").to(device)
        logits = model(input_ids=ids).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5], device=device)[:, None].expand_as(logp)
        loss, stats = policy_loss(logp, logp.detach(), adv, torch.ones_like(logp), PolicyLossConfig())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        opt.step()
        after = model.state_dict()
        changed = sum(int((after[k].to_local() != before[k].to_local()).sum()) for k in before)
        total = sum(before[k].to_local().numel() for k in before)
        master = {str(p.dtype) for p in model.parameters()}
        adam = {str(s["exp_avg"].dtype) for s in opt.state.values()}
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        state.update({k: v.detach().clone() for k, v in full.items()})
        out = {
            "backend": torch.distributed.get_backend(),
            "compute_dtype": str(logits.dtype),
            "master_dtype": ",".join(sorted(master)),
            "adam_state_dtype": ",".join(sorted(adam)),
            "loss": float(loss.detach()),
            "grad_norm": grad_norm,
            "weights_changed_frac": changed / total,
        }
        want_compute = "torch.bfloat16" if device.type == "cuda" else "torch.float32"  # fp32 throughout on CPU
        out["ok"] = (
            torch.isfinite(torch.tensor([out["loss"], grad_norm])).all().item()
            and out["compute_dtype"] == want_compute
            and out["master_dtype"] == "torch.float32"
            and out["adam_state_dtype"] == "torch.float32"
            and changed > 0
        )
        return out


def bench_learner(model_dir, tok, device, rows: int, seq_len: int, micro: int, reps: int) -> dict:
    """The learner's compute on one step's rows at a recipe's shape: the old-log-prob pass (no gradient) and one PPO
    update (forward, backward, clip, AdamW) over micro-batches of ``micro`` rows, through the calls
    ``LearnerWorker.forward_old`` and ``_update`` make: FSDP2 at world size 1, bf16 mixed precision on CUDA (fp32 on
    CPU), fp32 master weights. Medians over ``reps`` after one warm-up; random token ids (the cost does not depend
    on them), every response position in the loss."""
    from rapo_ray.algos.loss import PolicyLossConfig, logprobs_of, policy_loss
    from rapo_ray.model.target_logits import logits_at

    with one_rank_learner(model_dir, device) as (model, opt):
        gen = make_generator("cpu", 0)
        ids = torch.randint(0, len(tok), (rows, seq_len), generator=gen).to(device)
        attn = torch.ones_like(ids)
        adv = torch.linspace(-1.0, 1.0, rows, device=device)[:, None].expand(rows, seq_len - 1)
        mask = torch.ones(rows, seq_len - 1, device=device)
        chunks = [slice(i, i + micro) for i in range(0, rows, micro)]
        denominator = float(mask.sum())

        def logprobs(part):  # the learner's path (logits_at), here at every position: its largest
            at = mask[part] > 0
            logits = logits_at(model, ids[part], attn[part], at).float()
            return logprobs_of(logits, ids[part][:, 1:][at]).view(at.shape)

        def old_pass() -> torch.Tensor:
            with torch.no_grad():
                return torch.cat([logprobs(c) for c in chunks])

        def update(old: torch.Tensor) -> float:
            opt.zero_grad(set_to_none=True)
            for c in chunks:
                loss, _ = policy_loss(logprobs(c), old[c], adv[c], mask[c], PolicyLossConfig(), denominator=denominator)
                loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)

        def timed(fn, *a):
            sync(device)
            t0 = time.perf_counter()
            out = fn(*a)
            sync(device)
            return out, time.perf_counter() - t0

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        old = old_pass()
        update(old)  # warm-up: allocator, kernels, AdamW's state
        old_s, update_s = [], []
        for _ in range(reps):
            old, s = timed(old_pass)
            old_s.append(s)
            grad_norm, s = timed(update, old)
            update_s.append(s)
        tokens = rows * seq_len
        out = {
            "rows": rows,
            "seq_len": seq_len,
            "micro_batch": micro,
            "parameters": sum(p.numel() for p in model.parameters()),
            "old_logprob_s": statistics.median(old_s),
            "update_s": statistics.median(update_s),
            "update_tokens_s": tokens / statistics.median(update_s),
            "grad_norm": grad_norm,
        }
        if device.type == "cuda":
            out["peak_gpu_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["ok"] = math.isfinite(grad_norm)
        return out


def check_weight_load(model_dir, tok, device, state: dict, n_prompts: int, new_tokens: int) -> dict:
    """The learner's updated weights into the engine (tied lm_head left out, as the sync sends them)."""
    if not state:
        raise Skip("the learner update did not run")
    from rapo_ray.model.factory import load_model

    updated = load_model(model_dir).to(device).eval()
    updated.load_state_dict(state)
    engine = TorchEngine(load_model(model_dir), tok, device=device, max_batch_size=n_prompts)
    sent = {k: v for k, v in state.items() if not (k == "lm_head.weight" and updated.config.tie_word_embeddings)}
    engine.load_weights(sent, version=1)
    prompts = prompts_for(tok, n_prompts)
    res = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    gap = max_logprob_gap(updated, prompts, res)
    return {"engine_version": engine.version, "logprob_gap_vs_updated_model": gap, "ok": gap < 1e-3}


def _digests(state: dict) -> dict[str, str]:
    """sha256 of each tensor's bytes (bf16 included: hashed as raw bytes)."""
    import hashlib

    return {
        k: hashlib.sha256(v.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
        for k, v in state.items()
    }


def _import_in_child(segments, answer) -> None:
    """The engine's side of the colocated handoff, in a process of its own (as a rollout worker is): open the
    learner's segment (a CUDA IPC handle on CUDA, a /dev/shm file on the CPU), read the state dict, hash it."""
    from rapo_ray.workers.colocated import SegmentImporter

    t0 = time.perf_counter()
    version, got = SegmentImporter().state_dict(segments)
    if got and next(iter(got.values())).is_cuda:
        torch.cuda.synchronize()
    answer.put({"version": version, "import_ms": (time.perf_counter() - t0) * 1000, "digests": _digests(got)})


def check_colocated(device, state: dict, wire_dtype: str) -> dict:
    """The colocated weight handoff (``resources.colocate``, rapo_ray/workers/colocated.py): this process exports the
    updated weights as a learner rank of one does; a child process imports them and must read every tensor bit for
    bit in the wire dtype. On CUDA the bytes stay on the GPU (IPC), on the CPU they go through /dev/shm."""
    if not state:
        raise Skip("the learner update did not run")
    import multiprocessing as mp

    from rapo_ray.workers.colocated import SegmentExporter

    weights = {k: v.to(device) for k, v in state.items()}
    entries = [(k, tuple(v.shape), wire_dtype, ()) for k, v in weights.items()]
    exporter, prefix = SegmentExporter(0), f"rapo_gpu_check_{os.getpid()}"
    try:
        t0 = time.perf_counter()
        seg = exporter.export(1, entries, weights.__getitem__, 1, prefix, device)
        export_ms = (time.perf_counter() - t0) * 1000
        ctx = mp.get_context("spawn")
        answer = ctx.Queue()
        child = ctx.Process(target=_import_in_child, args=([seg], answer))
        child.start()
        got = answer.get(timeout=300)
        child.join(60)
    finally:
        exporter.close()
    want = _digests({k: v.to(getattr(torch, wire_dtype)) for k, v in weights.items()})
    same = sum(got["digests"].get(k) == d for k, d in want.items())
    return {
        "kind": seg.kind,
        "wire_dtype": wire_dtype,
        "mb": round(seg.nbytes / 1e6, 1),
        "export_ms": round(export_ms, 1),
        "import_ms_in_child": round(got["import_ms"], 1),
        "tensors_equal": f"{same}/{len(want)}",
        "ok": got["version"] == 1 and same == len(want) and seg.kind == ("cuda" if device.type == "cuda" else "shm"),
    }


def check_vllm(model_dir, tok, device, state: dict, n_prompts: int, new_tokens: int) -> dict:
    if device.type != "cuda":
        raise Skip("vLLM is checked on CUDA only (its CPU build is covered by the test suite)")
    from rapo_ray.engines.vllm_engine import VLLMEngine, vllm_available

    if not vllm_available():
        raise Skip("vLLM does not import here")
    from rapo_ray.model.factory import load_model

    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3)
    try:
        model = load_model(model_dir).to(device).eval()
        prompts = prompts_for(tok, n_prompts)
        res = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
        same = sum(r.token_ids == hf_greedy(model, p, new_tokens) for p, r in zip(prompts, res))
        out = {
            "greedy_equals_generate": f"{same}/{len(prompts)}",
            "greedy_logprob_gap": max_logprob_gap(model, prompts, res),
        }
        if state:
            model.load_state_dict(state)
            engine.load_weights(state, version=1)
            res = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
            out["logprob_gap_after_load"] = max_logprob_gap(model, prompts, res)
        out["ok"] = out["greedy_logprob_gap"] < 5e-3 and out.get("logprob_gap_after_load", 0.0) < 5e-3
        return out
    finally:
        engine.close()


def bench_engine(model_dir, tok, device, batches: list[int], new_tokens: int) -> dict:
    """Torch engine vs ``generate``, same prompts, greedy, ``new_tokens`` each (bf16 on CUDA, fp32 on CPU), for each
    form of the engine's decode step (``rollout.torch_decode``): on CUDA the CUDA graphs (the default there) and the
    dynamic step, on the CPU the dynamic step (the default there) and the static one. Each engine is timed on its
    second run at a batch (the first captures its graphs and grows its cache)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load(model_dir, device, dtype)
    forms = ("graphs", "dynamic") if device.type == "cuda" else ("dynamic", "static")
    engines = {
        f: TorchEngine(load(model_dir, device, dtype), tok, max_batch_size=max(batches), decode=f) for f in forms
    }
    base = prompts_for(tok, 16)
    rows = {}
    for b in batches:
        prompts = [base[i % len(base)] for i in range(b)]
        sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        row, tokens = {}, {}
        for form, engine in engines.items():
            engine.generate(prompts, sp)  # warm-up: graphs captured, the cache at its size
            sync(device)
            t0 = time.perf_counter()
            tokens[form] = [r.token_ids for r in engine.generate(prompts, sp)]
            sync(device)
            row[form] = time.perf_counter() - t0
        width = max(len(p) for p in prompts)
        ids = torch.full((b, width), 0, dtype=torch.long, device="cpu")
        attn = torch.zeros((b, width), dtype=torch.long, device="cpu")
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        ids, attn = ids.to(device), attn.to(device)
        kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        model.generate(ids[:2], attention_mask=attn[:2], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=attn, **kw)
        sync(device)
        hf_s = time.perf_counter() - t0
        n = b * new_tokens
        default = forms[0]
        rows[f"batch_{b}"] = {
            "engine_tok_s": n / row[default],
            "generate_tok_s": n / hf_s,
            "engine_over_generate": hf_s / row[default],
            "engine_ms_per_decode_step": 1000 * row[default] / new_tokens,
            **{f"{f}_over_generate": hf_s / row[f] for f in forms[1:]},
            f"{forms[1]}_ms_per_decode_step": 1000 * row[forms[1]] / new_tokens,
            "forms_same_tokens": tokens[forms[0]] == tokens[forms[1]],
        }
    return {"dtype": str(dtype), "new_tokens": new_tokens, "default_form": forms[0], **rows, "ok": True}


def history_texts(n: int) -> list[str]:
    """1,300-character agent histories (what a retrieval query embeds), all different."""
    texts = []
    for i, p in enumerate(tasks.generate("multihop", "test", n, 1)):
        body = f"{p.question}\n<think>step {i}: look up the first fact, then compute.</think>"
        texts.append((body * (1300 // len(body) + 1))[-1300:])
    return texts


def bench_embedder(device, batches: list[int], reps: int, stored: int) -> dict:
    import numpy as np

    try:
        from rapo_ray.retrieval.embedder import Embedder
        from rapo_ray.retrieval.replica_index import ReplicaIndex
    except ImportError as exc:  # a bare GPU box may lack the retrieval layer's packages
        raise Skip(f"the retrieval layer does not import here: {exc}") from exc
    try:
        emb = Embedder(device=device)
    except RuntimeError as exc:
        raise Skip(str(exc)) from exc
    out = {}
    texts = history_texts(max(batches) * 2)
    for b in batches:
        emb.embed(texts[:b])  # warm-up
        lat = []
        for r in range(reps):
            chunk = texts[(r * b) % len(texts) :][:b] or texts[:b]
            t0 = time.perf_counter()
            emb.embed(chunk)  # returns numpy: the device work has finished
            lat.append(time.perf_counter() - t0)
        lat.sort()
        p50, p99 = statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        out[f"batch_{b}"] = {"texts_s": b / p50, "p50_ms": 1000 * p50, "p99_ms": 1000 * p99}
    # the retrieval replica's batch path: embed the batch's queries, exact top-3 over the stored steps
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((stored, emb.dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    queries = emb.embed(texts[:32])
    vectors[: len(queries)] = queries  # each query's own vector is stored: its exact top-1 is known
    index = ReplicaIndex(emb.dim)
    index.add([f"s{i}" for i in range(stored)], vectors, [("v", "[]", 1.0, f"q{i}") for i in range(stored)])
    lat = []
    for _ in range(reps):
        t0 = time.perf_counter()
        hits = index.search(emb.embed(texts[:32]), 3)
        lat.append(time.perf_counter() - t0)
    lat.sort()
    exact = np.argmax(queries @ vectors.T, axis=1)
    recall = float(np.mean([h[0].question_id == f"q{e}" for h, e in zip(hits, exact)]))
    out["retrieval_batch_32"] = {
        "stored": stored,
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "recall_at_1": recall,
    }
    out["device"] = str(emb.device)
    out["ok"] = recall >= 0.99
    return out


# ---------------------------------------------------------------- driver


def run_check(name: str, fn, report: dict) -> None:
    t0 = time.perf_counter()
    try:
        result = fn()
        status = "PASS" if result.pop("ok") else "FAIL"
    except Skip as exc:
        result, status = {"reason": str(exc)}, "SKIP"
    except Exception as exc:  # a check that crashes is a failed check; the others still run
        result, status = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}, "FAIL"
    report["checks"][name] = {"status": status, "seconds": round(time.perf_counter() - t0, 1), **result}
    print(f"{status:4}  {name}", flush=True)


def table(report: dict) -> str:
    m = report["machine"]
    lines = [f"GPU check on {m['device_name']} ({m['device']}), model {report['size']} ({report['weights']})"]
    for name, r in report["checks"].items():
        lines.append(f"  {r['status']:4}  {name}  ({r['seconds']} s)")
        for k, v in r.items():
            if k in ("status", "seconds", "traceback"):
                continue
            if isinstance(v, dict):
                v = ", ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in v.items())
            elif isinstance(v, float):
                v = f"{v:.4g}"
            lines.append(f"        {k}: {v}")
    return "\n".join(lines)


def parse_learner_shape(spec: str) -> tuple[int, int, int]:
    """``ROWSxTOKENS/MICRO`` -> (rows, tokens per row, rows per micro-batch); a clear error otherwise."""
    try:
        shape, micro = spec.split("/")
        rows, tokens = (int(x) for x in shape.split("x"))
        micro = int(micro)
    except ValueError:
        raise SystemExit(f"--learner-shape {spec!r}: expected ROWSxTOKENS/MICRO, e.g. 8x640/2") from None
    if min(rows, tokens, micro) < 1 or tokens < 2:
        raise SystemExit(f"--learner-shape {spec!r}: rows and micro must be >= 1 and tokens >= 2")
    return rows, tokens, micro


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto (CUDA where visible, else CPU), cuda, cuda:N, cpu")
    ap.add_argument("--size", default="", help="model.size to build; default: qwen2.5-0.5b on CUDA, bundled on CPU")
    ap.add_argument("--preset", default="", help="a packaged model (model.preset), converted once, instead of --size")
    ap.add_argument("--model-dir", default="", help="an HF model folder instead of --size (no weights: random init)")
    ap.add_argument(
        "--learner-shape",
        default="",
        help="ROWSxTOKENS/MICRO[,...] for the learner's compute check: rows, tokens per row, rows per micro-batch; "
        "default 8x640/2 (a real model's step on this project's CPU recipe), 4x64/2 with --quick",
    )
    ap.add_argument("--quick", action="store_true", help="small batches and few tokens (the CPU smoke run)")
    ap.add_argument("--artifacts", default="/tmp/rapo_gpu_check", help="where the model is built")
    ap.add_argument("--out", default="benchmarks/results/gpu_check.json", help="JSON report")
    args = ap.parse_args(argv)
    device = parse_device(args.device)
    if device.type != "cuda":
        print("no CUDA device in use: running the checks on the CPU (the GPU path itself is not exercised)")
    quick = args.quick
    learner_shapes = [
        parse_learner_shape(x) for x in (args.learner_shape or ("4x64/2" if quick else "8x640/2")).split(",")
    ]
    n_prompts, new_tokens = (3, 8) if quick else (8, 32)
    batches = [2, 4] if quick else [16, 64, 256]
    bench_tokens = 8 if quick else 128

    from rapo_ray.model.factory import load_tokenizer

    model_dir, size, weights = resolve_model(args, device.type)
    tok = load_tokenizer(model_dir)
    report = {
        "machine": {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor() or "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "size": size,
        "weights": weights,
        "quick": quick,
        "checks": {},
    }
    state: dict = {}
    run_check(
        "engine: greedy, seeded sampling, logprobs",
        lambda: check_engine(model_dir, tok, device, n_prompts, new_tokens),
        report,
    )
    run_check(
        "learner: one bf16 mixed-precision update", lambda: check_learner_update(model_dir, tok, device, state), report
    )
    run_check(
        "weights: learner -> torch engine",
        lambda: check_weight_load(model_dir, tok, device, state, n_prompts, new_tokens),
        report,
    )
    run_check(
        "colocated: learner -> engine by shared memory",
        lambda: check_colocated(device, state, "bfloat16" if device.type == "cuda" else "float32"),
        report,
    )
    run_check(
        "vllm: greedy and weight load", lambda: check_vllm(model_dir, tok, device, state, n_prompts, new_tokens), report
    )
    run_check(
        "throughput: torch engine vs generate",
        lambda: bench_engine(model_dir, tok, device, batches, bench_tokens),
        report,
    )
    for rows, seq_len, micro in learner_shapes:
        run_check(
            f"learner: compute at {rows}x{seq_len}/{micro}",
            lambda: bench_learner(model_dir, tok, device, rows, seq_len, micro, 2 if quick else 3),
            report,
        )
    run_check(
        "embedder and retrieval batch path",
        lambda: bench_embedder(
            device, [1, 32] if not quick else [1, 4], 30 if not quick else 3, 50000 if not quick else 500
        ),
        report,
    )
    print(table(report))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"report: {args.out}")
    return 1 if any(r["status"] == "FAIL" for r in report["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
