"""The learner group: ``LearnerWorker`` actors in one torch.distributed group (gloo on CPU, NCCL on GPU),
the model sharded with FSDP2 ``fully_shard``.

Each step the driver sends every rank the same number of micro-batches (dummy rows with an all-zero mask
keep ranks in lockstep, since FSDP's collectives need every rank in every forward/backward):
1. ``forward_old``: log-probs and full-vocabulary entropies of the response tokens under pi_old (RAPO's
   step entropies come from here, spec ambiguity 1a);
2. ``update``: PPO mini-batches with the clipped RAPO/GRPO loss, gradient clipping, lr schedule; with
   ``algo.kl_coef > 0`` plus a KL penalty against the starting policy (a frozen copy on each rank).
The loss of each shard is divided by the global token (or sequence) count of its mini-batch, so the sum
over ranks is the full mini-batch loss; FSDP averages gradients over ranks, so the loss is multiplied by
the world size before backward to get the summed gradient.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from rapo_ray.algos import PolicyLossConfig, policy_loss, token_entropy_from_logits


@dataclass
class LearnerRow:
    """One trajectory as the learner sees it (response padded to the micro-batch)."""

    input_ids: list[int]  # prompt + response
    prompt_len: int
    loss_mask: list[int]  # over the response
    advantage: float = 0.0
    shaping: float = 1.0
    old_logprobs: list[float] | None = None  # over the response
    entropies: list[float] | None = None  # over the response, from forward_old (full vocabulary)


def dummy_like(row: LearnerRow) -> LearnerRow:
    return LearnerRow(row.input_ids, row.prompt_len, [0] * len(row.loss_mask), 0.0, 1.0,
                      [0.0] * len(row.loss_mask) if row.old_logprobs is not None else None)


def split_for_ranks(rows: list[LearnerRow], world: int, micro: int) -> list[list[list[LearnerRow]]]:
    """rows -> [rank][micro-batch] with the same number of micro-batches on every rank."""
    per_rank = [rows[r::world] for r in range(world)]
    n_micro = max(1, max(math.ceil(len(p) / micro) for p in per_rank))
    filler = dummy_like(rows[0])
    out = []
    for p in per_rank:
        mbs = [p[i * micro:(i + 1) * micro] for i in range(n_micro)]
        out.append([mb if mb else [filler] for mb in mbs])
    return out


def _collate(rows: list[LearnerRow], pad_id: int):
    """Right-padded [B, L] inputs and [B, L-1] response-aligned targets/masks."""
    L = max(len(r.input_ids) for r in rows)
    B = len(rows)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    resp = torch.zeros((B, L - 1), dtype=torch.float32)  # 1 where the target is a response token
    mask = torch.zeros((B, L - 1), dtype=torch.float32)
    old = torch.zeros((B, L - 1), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        attn[i, :n] = 1
        s, e = r.prompt_len - 1, n - 1
        resp[i, s:e] = 1
        mask[i, s:e] = torch.tensor(r.loss_mask, dtype=torch.float32)
        if r.old_logprobs is not None:
            old[i, s:e] = torch.tensor(r.old_logprobs, dtype=torch.float32)
    return ids, attn, resp, mask, old


class LearnerWorker:
    def __init__(self, rank: int, world_size: int, master_port: int, model_dir: str, cfg_dict: dict, backend: str = "auto"):
        import torch.distributed as dist

        from rapo_ray.config import from_dict
        from rapo_ray.model import load_model, set_torch_threads

        self.cfg = from_dict(cfg_dict)
        set_torch_threads(1)
        self.rank, self.world = rank, world_size
        use_cuda = torch.cuda.is_available() and self.cfg.resources.gpus_per_learner > 0
        self.device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        backend = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
        os.environ.update(MASTER_ADDR="127.0.0.1" if not use_cuda else os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(master_port))
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        lc = self.cfg.learner
        dtype = "bfloat16" if (lc.bf16 and use_cuda) else "float32"
        model = load_model(model_dir, dtype=dtype, device=str(self.device))
        self.pad_id = model.config.pad_token_id or 0
        if lc.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if lc.fsdp:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        self.model = model.train()
        # The KL penalty's reference is the policy the run started from (learners are always built from
        # the starting model; a resume loads the checkpoint into self.model only). Sharded like the policy.
        self.ref_model = None
        if self.cfg.algo.kl_coef > 0:
            ref = load_model(model_dir, dtype=dtype, device=str(self.device)).eval().requires_grad_(False)
            if lc.fsdp:
                for layer in ref.model.layers:
                    fully_shard(layer)
                fully_shard(ref)
            self.ref_model = ref
        self.opt = torch.optim.AdamW(model.parameters(), lr=lc.lr, weight_decay=lc.weight_decay, betas=(0.9, 0.999), eps=1e-8)
        total = max(1, self.cfg.trainer.total_steps)

        def schedule(step: int) -> float:
            warm = min(1.0, (step + 1) / lc.warmup_steps) if lc.warmup_steps else 1.0
            frac = min(step, total) / total
            if lc.lr_schedule == "cosine":
                return warm * 0.5 * (1 + math.cos(math.pi * frac))
            if lc.lr_schedule == "linear":
                return warm * (1 - frac)
            return warm

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        a = self.cfg.algo
        self.loss_cfg = PolicyLossConfig(clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip or None,
                                         kl_coef=a.kl_coef, kl_type=a.kl_type, agg_mode=a.loss_agg_mode)

    def ready(self) -> int:
        return self.rank

    # ------------------------------------------------------------ passes

    def _logits(self, ids, attn, model=None):
        model = self.model if model is None else model
        return model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits[:, :-1].float()

    def _target_logprobs(self, logits, ids):
        """[B, L-1] log-prob of each next token under ``logits``."""
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None].to(self.device))[..., 0]

    @torch.no_grad()
    def forward_old(self, micro_batches: list[list[LearnerRow]]) -> list[list[tuple[list[float], list[float]]]]:
        """Per row: (log-probs, entropies) of its response tokens under the current (= old) policy."""
        out = []
        for rows in micro_batches:
            ids, attn, resp, _, _ = _collate(rows, self.pad_id)
            logits = self._logits(ids, attn)
            logp = self._target_logprobs(logits, ids).cpu()
            ent = token_entropy_from_logits(logits).cpu()
            res = []
            for i, r in enumerate(rows):
                s, e = r.prompt_len - 1, len(r.input_ids) - 1
                res.append((logp[i, s:e].tolist(), ent[i, s:e].tolist()))
            out.append(res)
        return out

    def update_from_stream(self, split, denominators: list[float], micro: int) -> dict:
        """PPO update on the rows a Ray Data ``streaming_split`` iterator hands this rank.

        Each row carries its mini-batch index ``mb``; the driver computed every mini-batch's global loss
        denominator (``denominators[mb]``) before the split, so no rank needs the others' rows. Rows reach
        ranks dynamically, so the ranks agree on each mini-batch's micro-batch count with one all-reduce
        (max) and pad with all-masked rows: FSDP's collectives need every rank in every forward/backward.
        """
        import torch.distributed as dist

        mine: list[list[LearnerRow]] = [[] for _ in denominators]
        for batch in split.iter_batches(batch_size=None, batch_format="pyarrow"):
            for rec in batch.to_pylist():
                mine[rec["mb"]].append(LearnerRow(rec["input_ids"], rec["prompt_len"], rec["loss_mask"], rec["advantage"],
                                                  rec["shaping"], rec["old_logprobs"]))
        counts = torch.tensor([math.ceil(len(m) / micro) for m in mine], dtype=torch.long, device=self.device)
        if self.world > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        filler = LearnerRow([self.pad_id, self.pad_id], 1, [0], 0.0, 1.0, [0.0])
        minis = []
        for k, denominator in enumerate(denominators):
            mbs = [mine[k][i * micro:(i + 1) * micro] for i in range(int(counts[k]))]
            minis.append(([mb if mb else [filler] for mb in mbs], denominator))
        out = self.update(minis)
        out["rows"] = sum(len(m) for m in mine)
        return out

    def update(self, mini_batches: list[tuple[list[list[LearnerRow]], float]]) -> dict:
        """``mini_batches``: per PPO mini-batch, this rank's micro-batches and the global denominator."""
        stats: dict[str, float] = {}
        n = 0
        for micro_batches, denominator in mini_batches:
            self.opt.zero_grad(set_to_none=True)
            for rows in micro_batches:
                ids, attn, _, mask, old = _collate(rows, self.pad_id)
                ref_logp = None
                if self.ref_model is not None:  # the KL penalty's reference log-probs (no gradient)
                    with torch.no_grad():
                        ref_logp = self._target_logprobs(self._logits(ids, attn, self.ref_model), ids)
                logp = self._target_logprobs(self._logits(ids, attn), ids)
                adv = torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=self.device)
                shaping = torch.tensor([r.shaping for r in rows], dtype=torch.float32, device=self.device)
                loss, m = policy_loss(logp, old.to(self.device), adv, mask.to(self.device), self.loss_cfg,
                                      shaping=shaping, ref_logp=ref_logp, denominator=denominator)
                (loss * self.world).backward()
                w = m["loss_tokens"]
                for k in ("clip_frac", "approx_kl", "ratio_mean", "kl_ref"):
                    if k in m:
                        stats[k] = stats.get(k, 0.0) + m[k] * w
                stats["loss"] = stats.get("loss", 0.0) + loss.item()
                n += w
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.learner.grad_clip)
            gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
            stats["grad_norm"] = stats.get("grad_norm", 0.0) + float(gn)
            self.opt.step()
        self.sched.step()
        out = {k: v / max(n, 1) for k, v in stats.items() if k in ("clip_frac", "approx_kl", "ratio_mean", "kl_ref")}
        out["loss_sum"] = stats.get("loss", 0.0)
        out["grad_norm"] = stats.get("grad_norm", 0.0) / max(len(mini_batches), 1)
        out["loss_tokens"] = n
        out["lr"] = self.sched.get_last_lr()[0]
        return out

    # ------------------------------------------------------------ weights and checkpoints

    def full_state_dict(self) -> dict | None:
        """Gathered full weights (HF names, CPU) on rank 0; None elsewhere. Every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().clone() for k, v in sd.items()} if self.rank == 0 else None

    def save_checkpoint(self, path: str, tokenizer_dir: str) -> bool:
        """Rank 0 writes the HF model and the full optimizer state into ``path`` (which must not exist yet)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        sd = self.full_state_dict()
        osd = get_optimizer_state_dict(self.model, self.opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            from rapo_ray.model import load_model, load_tokenizer, save_model

            hf = load_model(tokenizer_dir)
            hf.load_state_dict(sd, strict=False)
            save_model(hf, load_tokenizer(tokenizer_dir), path)
            torch.save({"optimizer": osd, "scheduler": self.sched.state_dict()}, os.path.join(path, "optimizer.pt"))
        return True

    def load_checkpoint(self, path: str) -> bool:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        from rapo_ray.model import load_model

        full = load_model(path).state_dict()
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_model_state_dict(self.model, full, options=opts)
        blob = torch.load(os.path.join(path, "optimizer.pt"), weights_only=False)
        set_optimizer_state_dict(self.model, self.opt, blob["optimizer"], options=opts)
        self.sched.load_state_dict(blob["scheduler"])
        return True

    def shutdown(self) -> bool:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return True
