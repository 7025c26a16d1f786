"""The learner group: ``LearnerWorker`` actors (one per rank) in one torch.distributed group (gloo on CPU, NCCL
on GPU), the model sharded with FSDP2 ``fully_shard``; ``LearnerGroup`` is how the trainer talks to them.

Each step the group builds the step's ``LearnerBatch`` (padded tensors, rapo_ray/types/learner_batch.py) once and
sends every rank the same number of micro-batches of it, as tensors (padding rows with an all-zero mask keep ranks
in lockstep, since FSDP's collectives need every rank in every forward/backward):
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
import random
import time
from typing import Sequence

import numpy as np
import ray
import torch

from rapo_ray.algos.entropy import token_entropy_from_logits
from rapo_ray.algos.loss import PolicyLossConfig, aggregation_denominator, logprobs_of, policy_loss
from rapo_ray.algos.lr_schedule import lr_factor
from rapo_ray.algos.old_pass import one_update_reason
from rapo_ray.config import Config, from_dict, to_dict
from rapo_ray.core.devices import mixed_precision_policy, pick_device, set_deterministic, shard_model
from rapo_ray.core.errors import WORKER_DIED, LearnerLost, brief
from rapo_ray.core.metrics import actor_stats, merge_actor_stats
from rapo_ray.core.net import free_port
from rapo_ray.model.factory import (
    load_model,
    load_tokenizer,
    model_from_state_dict,
    pad_token_id,
    save_model,
    set_torch_threads,
)
from rapo_ray.model.target_logits import logits_at
from rapo_ray.types.batch import MICRO_BATCH_ORDERS, TrajectoryBatch, balanced_micro_batches, length_sorted_groups
from rapo_ray.types.learner_batch import LearnerBatch, from_numpy
from rapo_ray.workers.colocated import SegmentExporter
from rapo_ray.workers.sync import SyncMember, send_state
from rapo_ray.workers.weight_layout import shard_rows

# How the learner group combines one statistic across ranks (rapo_ray.core.metrics.merge_actor_stats): per-rank
# token-weighted means are averaged, loss sums and delivered rows are added.
# The loss's per-token statistics that a rank averages over its loss tokens.
TOKEN_MEAN_STATS = ("clip_frac", "approx_kl", "ratio_mean", "kl_ref", "behaviour_weight_mean", "behaviour_capped_frac")
RANK_REDUCE = {
    **{name: "mean" for name in TOKEN_MEAN_STATS},
    "grad_norm": "mean",
    "loss_tokens": "mean",
    "lr": "mean",
    "loss_sum": "sum",
    "rows": "sum",
    "padded_tokens": "sum",
    "slowest_rank_padded_tokens": "max",
    "cpu_s": "sum",  # the ranks' process CPU seconds in the call, all of their threads
}


def _spread(values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """[N] values (row-major order of ``at``) laid out as ``at``'s [B, T-1], 0 elsewhere; gradients flow to
    ``values``."""
    return torch.zeros(at.shape, dtype=values.dtype, device=values.device).masked_scatter(at, values)


class LearnerWorker(SyncMember):
    def __init__(
        self, rank: int, world_size: int, master_port: int, model_dir: str, cfg_dict: dict, backend: str = "auto"
    ):
        import torch.distributed as dist

        self.cfg = from_dict(cfg_dict)
        set_torch_threads(1)
        set_deterministic(self.cfg.run.deterministic)
        self.rank, self.world = rank, world_size
        self._sync_layout_cache: tuple = ()  # (key, entries, local rows): see _sync_layout
        self._exporter = SegmentExporter(rank)  # the colocated handoff's shared buffer (resources.colocate)
        self.device = pick_device(self.cfg.resources.gpus_per_learner, "resources.gpus_per_learner")
        use_cuda = self.device.type == "cuda"
        backend = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
        os.environ.update(
            MASTER_ADDR="127.0.0.1" if not use_cuda else os.environ.get("MASTER_ADDR", "127.0.0.1"),
            MASTER_PORT=str(master_port),
        )
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        lc = self.cfg.learner
        # fp32 master weights always; bf16 compute on GPU (FSDP's policy, or autocast without FSDP)
        mp_policy = mixed_precision_policy(lc.bf16, self.device) if lc.fsdp else None
        self.autocast = lc.bf16 and use_cuda and not lc.fsdp
        model = load_model(model_dir, dtype="float32", device=str(self.device))
        self.pad_id = model.config.pad_token_id or 0
        if lc.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if lc.fsdp:
            shard_model(model, mp_policy)
        self.model = model.train()
        # The KL penalty's reference is the policy the run started from (learners are always built from
        # the starting model; a resume loads the checkpoint into self.model only). Sharded like the policy.
        self.ref_model = None
        if self.cfg.algo.kl_coef > 0:
            ref = load_model(model_dir, dtype="float32", device=str(self.device)).eval().requires_grad_(False)
            if lc.fsdp:
                shard_model(ref, mp_policy)
            self.ref_model = ref
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=lc.lr, weight_decay=lc.weight_decay, betas=(0.9, 0.999), eps=1e-8
        )
        total = max(1, self.cfg.trainer.total_steps)

        def schedule(step: int) -> float:
            return lr_factor(step, total, lc.warmup_steps, lc.lr_schedule, lc.lr_min_ratio)

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        a = self.cfg.algo
        self.loss_cfg = PolicyLossConfig(
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            dual_clip=a.dual_clip or None,
            kl_coef=a.kl_coef,
            kl_type=a.kl_type,
            agg_mode=a.loss_agg_mode,
            behaviour_correction=a.behaviour_correction,
            behaviour_cap=a.behaviour_cap,
        )

    def ready(self) -> int:
        return self.rank

    # ------------------------------------------------------------ passes

    def _logprobs_at(self, ids, attn, at, model=None, entropy=False):
        """Log-probs of the targets at ``at`` ([B, T-1] bool), [B, T-1] float32 with 0 elsewhere; with ``entropy``
        also each of those positions' full-vocabulary entropy, laid out alike. The LM head runs only at ``at``
        (``learner.logits_only_at_targets``, rapo_ray/model/target_logits.py)."""
        model = self.model if model is None else model
        ids, at = ids.to(self.device), at.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = logits_at(model, ids, attn.to(self.device), at, self.cfg.learner.logits_only_at_targets)
        logits = logits.float()
        logp = _spread(logprobs_of(logits, ids[:, 1:][at]), at)
        if not entropy:
            return logp
        with torch.no_grad():  # a metric and the retrieval reward's input: never part of the loss's graph
            return logp, _spread(token_entropy_from_logits(logits.detach()), at)

    @torch.no_grad()
    def forward_old(self, micro_batches: list[LearnerBatch]) -> dict:
        """Per micro-batch: (log-probs, entropies) of its generated targets (``loss_mask``) under the current (= old)
        policy, each [b, T-1] float32 like the micro-batch's masks, 0 elsewhere (numpy: one buffer each on the way
        back), as ``passes``; and ``cpu_s``, this rank's process CPU seconds in the pass (every thread). Only
        generated tokens are read: the update's ratio and the step entropies (generated steps). Tool results and
        retrieved blocks are context, so the LM head skips them."""
        cpu0 = time.process_time()
        passes = []
        for mb in micro_batches:
            logp, ent = self._logprobs_at(mb.long_ids(), mb.attention_mask, mb.loss_mask > 0, entropy=True)
            passes.append((logp.cpu().numpy(), ent.cpu().numpy()))
        return {"passes": passes, "cpu_s": time.process_time() - cpu0}

    def update_from_stream(self, split, denominators: list[float], micro: int) -> dict:
        """PPO update on the rows a Ray Data ``streaming_split`` iterator hands this rank.

        Each row carries its mini-batch index ``mb``; the driver computed every mini-batch's global loss
        denominator (``denominators[mb]``) before the split, so no rank needs the others' rows. Rows reach
        ranks dynamically, so the ranks agree on each mini-batch's micro-batch count with one all-reduce
        (max) and pad with all-masked rows: FSDP's collectives need every rank in every forward/backward.
        """
        import pyarrow as pa
        import torch.distributed as dist

        blocks = list(split.iter_batches(batch_size=None, batch_format="pyarrow"))
        table = pa.concat_tables(blocks) if blocks else None
        mine = LearnerBatch.from_arrow(table) if table is not None else None
        mb_of = table.column("mb").to_numpy() if table is not None else []
        rows = [[i for i, k in enumerate(mb_of) if k == m] for m in range(len(denominators))]
        counts = torch.tensor([math.ceil(len(r) / micro) for r in rows], dtype=torch.long, device=self.device)
        if self.world > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        minis = []
        for k, denominator in enumerate(denominators):
            parts = [rows[k][i * micro : (i + 1) * micro] for i in range(int(counts[k]))]
            mbs = [mine.select(part) if part else LearnerBatch.padding(1, self.pad_id) for part in parts]
            minis.append((mbs, denominator))
        out = self._update(minis)
        out["rows"] = len(mb_of)
        return actor_stats(out, RANK_REDUCE)

    def update(self, mini_batches: list[tuple[list[LearnerBatch], float]], old_from_update: bool = False):
        """``mini_batches``: per PPO mini-batch, this rank's micro-batches and the global denominator. Returns
        this rank's statistics as RLlib stats (``merge_actor_stats`` combines the ranks by ``RANK_REDUCE``).

        ``old_from_update`` (the old-policy pass skipped, rapo_ray/algos/old_pass.py): one mini-batch whose
        micro-batches carry no ``old_logprobs``; the update's own log-probs, detached, are pi_old. Returns
        ``(stats, per micro-batch (log-probs, entropies))`` then, laid out as ``forward_old`` returns them."""
        if not old_from_update:
            return actor_stats(self._update(mini_batches), RANK_REDUCE)
        if len(mini_batches) != 1:
            raise ValueError(f"old_from_update needs one mini-batch per update, got {len(mini_batches)}")
        passes: list[tuple[np.ndarray, np.ndarray]] = []
        return actor_stats(self._update(mini_batches, passes), RANK_REDUCE), passes

    def _update(
        self, mini_batches: list[tuple[list[LearnerBatch], float]], passes: list | None = None
    ) -> dict[str, float]:
        """The optimizer steps; with ``passes`` (a list), pi_old is each micro-batch's own log-probs, and those and
        the entropies are appended to it."""
        cpu0 = time.process_time()
        stats: dict[str, float] = {}
        n = padded = 0
        for micro_batches, denominator in mini_batches:
            self.opt.zero_grad(set_to_none=True)
            for mb in micro_batches:
                ids, attn = mb.long_ids(), mb.attention_mask
                padded += ids.numel()
                at = mb.loss_mask > 0  # the loss reads log-probs only here
                ref_logp = None
                if self.ref_model is not None:  # the KL penalty's reference log-probs (no gradient)
                    with torch.no_grad():
                        ref_logp = self._logprobs_at(ids, attn, at, self.ref_model)
                if passes is None:
                    logp = self._logprobs_at(ids, attn, at)
                    old_logp = mb.old_logprobs.to(self.device)
                else:  # this forward runs at pi_old: its values are the old-policy pass's
                    logp, ent = self._logprobs_at(ids, attn, at, entropy=True)
                    old_logp = logp.detach()
                    passes.append((old_logp.cpu().numpy(), ent.cpu().numpy()))
                loss, m = policy_loss(
                    logp,
                    old_logp,
                    mb.signal["advantage"].to(self.device),  # [b] per row, or [b, T-1] per token
                    mb.loss_mask.to(self.device, torch.float32),
                    self.loss_cfg,
                    shaping=mb.signal["shaping"].to(self.device) if "shaping" in mb.signal else None,
                    ref_logp=ref_logp,
                    denominator=denominator,
                    behaviour_logp=None if mb.behaviour_logprobs is None else mb.behaviour_logprobs.to(self.device),
                )
                (loss * self.world).backward()
                w = m["loss_tokens"]
                for k in TOKEN_MEAN_STATS:
                    if k in m:
                        stats[k] = stats.get(k, 0.0) + m[k] * w
                stats["loss"] = stats.get("loss", 0.0) + loss.item()
                n += w
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.learner.grad_clip)
            gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
            stats["grad_norm"] = stats.get("grad_norm", 0.0) + float(gn)
            self.opt.step()
        lr = self.opt.param_groups[0]["lr"]  # the rate this update used (the scheduler then moves to the next step's)
        self.sched.step()
        out = {k: v / max(n, 1) for k, v in stats.items() if k in TOKEN_MEAN_STATS}
        out["loss_sum"] = stats.get("loss", 0.0)
        out["grad_norm"] = stats.get("grad_norm", 0.0) / max(len(mini_batches), 1)
        out["loss_tokens"] = n
        out["lr"] = lr
        # rows x longest row of every forward/backward: what the passes cost; ranks wait for the slowest at each step
        out["padded_tokens"] = out["slowest_rank_padded_tokens"] = padded
        out["cpu_s"] = time.process_time() - cpu0
        return out

    # ------------------------------------------------------------ weights and checkpoints

    def full_state_dict(self) -> dict | None:
        """Gathered full weights (HF names, CPU) on rank 0; None elsewhere. Every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().clone() for k, v in sd.items()} if self.rank == 0 else None

    def join_weight_sync(self, host: str, port: int, name: str, rank: int, world: int, timeout_s: float) -> bool:
        """Become sync rank ``rank`` (this learner rank) of the weight-sync group ``name`` (rapo_ray/workers/sync.py)."""
        if rank != self.rank:
            raise ValueError(f"learner rank {self.rank} asked to be weight-sync rank {rank}")
        return super().join_weight_sync(host, port, name, rank, world, timeout_s)

    def send_weights(self, version: int, bucket_bytes: int, dtype: str, senders: int) -> dict:
        """Every rank: send the rows of every parameter that this rank's FSDP shard holds, in ``dtype``, straight to
        the workers of the weight-sync group (``senders`` = the learner ranks)."""
        if self._sync_group is None:
            raise RuntimeError(f"learner rank {self.rank} is in no weight-sync group")
        t0 = time.perf_counter()
        entries, local = self._sync_layout(dtype, senders)
        prepare_s = time.perf_counter() - t0
        try:
            stats = send_state(self._sync_group, version, entries, local.__getitem__, senders, bucket_bytes)
            return {**stats, "prepare_s": prepare_s, "learner_s": time.perf_counter() - t0}
        except BaseException:
            self._sync_group = None  # aborted by send_state; the driver forms a new group
            raise

    def export_weights(self, version: int, dtype: str, senders: int, prefix: str) -> dict:
        """Every rank (colocated mode): put this rank's rows of every parameter, in ``dtype``, into its shared buffer
        for the engines on this machine to read (rapo_ray/workers/colocated.py). Returns the handle and seconds."""
        t0 = time.perf_counter()
        entries, local = self._sync_layout(dtype, senders)
        t1 = time.perf_counter()
        seg = self._exporter.export(version, entries, local.__getitem__, senders, prefix, self.device)
        t2 = time.perf_counter()
        return {"segment": seg, "prepare_s": t1 - t0, "pack_s": t2 - t1, "learner_s": t2 - t0}

    def _sync_layout(self, dtype: str, senders: int) -> tuple[list, dict]:
        """What ``send_weights`` sends: the (name, shape, dtype, rows per sender) entries, and this rank's rows of
        each tensor as views of its parameters (they follow the optimizer's in-place updates). Built once: walking
        the state dict cost 3.6-4.7 ms of a ~17 ms push on the bundled model; ``load_checkpoint`` drops it, since
        loading may replace parameters. A tied ``lm_head`` is not sent (the engines tie it to the embedding)."""
        from torch.distributed.tensor import DTensor

        if self._sync_layout_cache and self._sync_layout_cache[0] == (dtype, senders):
            return self._sync_layout_cache[1:]
        sd = self.model.state_dict()
        if getattr(self.model.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        local, entries = {}, []
        for k, v in sd.items():
            sharded = isinstance(v, DTensor) and senders > 1 and v.dim() > 0
            rows = shard_rows(v.shape[0], senders) if sharded else ()
            if sharded:
                local[k] = v.to_local()
                if local[k].shape[0] != rows[self.rank]:
                    raise RuntimeError(f"{k}: FSDP shard of {local[k].shape[0]} rows on rank {self.rank}, not {rows}")
            elif self.rank == 0:  # a plain (or one-rank) tensor: rank 0 sends it whole
                local[k] = v.to_local() if isinstance(v, DTensor) else v
            entries.append((k, tuple(v.shape), dtype, rows))
        self._sync_layout_cache = ((dtype, senders), entries, local)
        return entries, local

    def save_checkpoint(self, path: str, tokenizer_dir: str) -> bool:
        """Rank 0 writes the HF model (in ``model.dtype``, what engines and serving load) and the full optimizer
        state into ``path`` (which must not exist yet). When ``model.dtype`` is lower than the fp32 master
        weights, those go into optimizer.pt as well, so that a resume continues from them exactly."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        sd = self.full_state_dict()
        osd = get_optimizer_state_dict(
            self.model, self.opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            save_dtype = self.cfg.model.dtype
            save_model(model_from_state_dict(tokenizer_dir, sd, save_dtype), load_tokenizer(tokenizer_dir), path)
            master = {"master": sd} if save_dtype != "float32" else {}
            torch.save(
                {"optimizer": osd, "scheduler": self.sched.state_dict(), **master}, os.path.join(path, "optimizer.pt")
            )
        return True

    def load_checkpoint(self, path: str) -> bool:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # tensors and plain containers only: loading a checkpoint never runs code from it
        blob = torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)
        full = blob["master"] if "master" in blob else load_model(path).state_dict()
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_model_state_dict(self.model, full, options=opts)
        self._sync_layout_cache = ()  # the parameters may be new tensors now
        set_optimizer_state_dict(self.model, self.opt, blob["optimizer"], options=opts)
        self.sched.load_state_dict(blob["scheduler"])
        return True

    def shutdown(self) -> bool:
        import torch.distributed as dist

        self._exporter.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        return True


# ---------------------------------------------------------------- the group, as the trainer sees it


def _gather(refs: list) -> list:
    """ray.get for learner calls that fails fast: the surviving ranks of a group that lost one would wait in a
    collective, so the first dead rank ends the wait."""
    results, pending = {}, list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            results[ready[0]] = ray.get(ready[0])  # each result fetched once (a full state dict can be GBs)
        # ObjectLostError: the learner finished, but its node went away before its result was fetched
        except (*WORKER_DIED, ray.exceptions.ActorUnavailableError, ray.exceptions.ObjectLostError) as exc:
            raise LearnerLost(f"a learner died: {brief(exc)}") from None
    return [results[r] for r in refs]


# Length-sorted micro-batches may pad each to at most 10% over its real tokens.
MICRO_BATCH_PAD_SLACK = 0.1


def micro_batch_rows(lengths: Sequence[int], world: int, max_rows: int, order: str) -> list[list[list[int]]]:
    """[rank][micro-batch] -> row indices of a batch whose rows have these token lengths, by ``order``
    (``LearnerConfig.micro_batch_order``), with at most ``max_rows`` rows per micro-batch (0: no cap):

    - ``balanced``: ``batch.balanced_micro_batches``: rows of like length together, dealt so the ranks pad about the
      same number of tokens (uncapped: one micro-batch per rank, a rank of long rows getting fewer rows).
    - ``row-order``: row i goes to rank ``i % world``, whose rows are cut every ``max_rows`` rows (uncapped: one
      micro-batch of its whole share).
    - ``length-sorted``: as row-order, then each rank's rows sorted by length and cut where padding would pass
      ``MICRO_BATCH_PAD_SLACK`` (``batch.length_sorted_groups``).

    Every rank gets the same number of micro-batches (FSDP's collectives need every rank in every forward/backward):
    a rank with fewer gets empty ones, sent as padding rows."""
    if order not in MICRO_BATCH_ORDERS or max_rows < 0:
        raise ValueError(
            f"micro_batch_rows: order {order!r} must be one of {MICRO_BATCH_ORDERS}, and max_rows ({max_rows}) >= 0"
        )
    if order == "balanced":
        return balanced_micro_batches(lengths, world, max_rows)
    share = math.ceil(len(lengths) / world)
    micro = max(1, min(share, max_rows) if max_rows else share)
    per_rank = [list(range(r, len(lengths), world)) for r in range(world)]
    out = []
    for rows in per_rank:
        if order == "length-sorted":
            groups = length_sorted_groups([lengths[i] for i in rows], micro, MICRO_BATCH_PAD_SLACK)
            out.append([[rows[j] for j in g] for g in groups])
        else:
            out.append([rows[i : i + micro] for i in range(0, len(rows), micro)])
    n_micro = max(1, max(len(mbs) for mbs in out))
    return [mbs + [[] for _ in range(n_micro - len(mbs))] for mbs in out]


def split_for_ranks(
    batch: LearnerBatch, world: int, max_rows: int, pad_id: int, order: str = "row-order"
) -> tuple[list[list[LearnerBatch]], list[list[list[int]]]]:
    """``batch`` -> ([rank][micro-batch] batches, their row indices as ``micro_batch_rows`` gives them); an empty
    micro-batch is a one-row padding batch that weighs nothing in the loss."""
    rows = micro_batch_rows(batch.length.tolist(), world, max_rows, order)
    pad = LearnerBatch.padding(1, pad_id, like=batch)
    return [[batch.select(mb) if mb else pad for mb in mbs] for mbs in rows], rows


def put_back_pass(lb: LearnerBatch, per_rank: list[list[LearnerBatch]], results: list[list[tuple]]) -> None:
    """Fill ``lb.old_logprobs`` and ``lb.entropies`` ([B, T-1]) from the ranks' per micro-batch (log-probs,
    entropies) ``results`` for the micro-batches ``per_rank`` that were sent, each row by its ``row`` index (ranks
    see rows out of order; a padding row, ``row`` -1, is skipped)."""
    logp = torch.zeros_like(lb.response_mask)
    ent = torch.zeros_like(lb.response_mask)
    for mbs, res in zip(per_rank, results):
        for mb, (lp, en) in zip(mbs, res):
            real = [(i, r) for i, r in enumerate(mb.row.tolist()) if r >= 0]
            if real:
                src, dst = zip(*real)
                logp[list(dst), : lp.shape[1]] = from_numpy(lp)[list(src)]
                ent[list(dst), : en.shape[1]] = from_numpy(en)[list(src)]
    lb.old_logprobs, lb.entropies = logp, ent


def learner_bundles(cfg: Config) -> tuple[list[dict], str]:
    """The learner ranks' placement-group bundles (one per rank) and the group's strategy. Colocated
    (``resources.colocate``): bundles 0..rollout.num_workers-1 also hold that rank's rollout worker (its CPUs and
    custom resources, the pair's GPU), and every bundle is on one machine (STRICT_PACK), since the engines map the
    learners' shared memory."""
    rc, world = cfg.resources, cfg.learner.world_size
    alone = {"CPU": rc.cpus_per_learner} | ({"GPU": rc.gpus_per_learner} if rc.gpus_per_learner else {})
    alone |= dict(rc.learner_custom_resources)
    if rc.colocate is not True:
        return [alone] * world, "PACK"
    pair = dict(alone)
    for k, v in rc.rollout_custom_resources.items():
        pair[k] = pair.get(k, 0) + v
    pair["CPU"] = rc.cpus_per_learner + rc.cpus_per_rollout_worker
    if rc.colocated_gpus:
        pair["GPU"] = rc.colocated_gpus
    paired = cfg.colocated_pairs
    return [pair] * paired + [alone] * (world - paired), "STRICT_PACK"


class LearnerGroup:
    """The learner ranks as one object (after OpenRLHF's actor group): one ``LearnerWorker`` per rank in a
    placement group, one torch.distributed group among them. It splits a ``TrajectoryBatch`` over the ranks
    and puts the results back in row order, so its caller never sees ranks. A dead rank raises
    ``LearnerLost`` from any call."""

    def __init__(self, cfg: Config, model_dir, wait: bool = True):
        """``wait=False``: return once the ranks are placed and starting; ``wait_ready`` then waits for their models
        (the launcher starts the learners this way while the retrieval service deploys)."""
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.cfg = cfg
        self.pad_id = pad_token_id(model_dir)
        lc, rc = cfg.learner, cfg.resources
        bundles, strategy = learner_bundles(cfg)
        self.pg = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=rc.placement_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"the learner placement group ({bundles}) could not be scheduled within "
                f"{rc.placement_timeout_s:g} s (resources.placement_timeout_s)"
            )
        actor = ray.remote(
            num_cpus=rc.cpus_per_learner,
            num_gpus=rc.colocated_shares()[0] if rc.colocate is True else rc.gpus_per_learner,
            resources=dict(rc.learner_custom_resources) or None,
        )(LearnerWorker)
        port, cfg_dict = free_port(), to_dict(cfg)
        self.workers = [
            actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r)
            ).remote(r, lc.world_size, port, str(model_dir), cfg_dict, lc.backend)
            for r in range(lc.world_size)
        ]
        self._starting = [w.ready.remote() for w in self.workers]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until every rank has built its model, optimizer and process group (raises ``LearnerLost``)."""
        starting, self._starting = self._starting, []
        _gather(starting)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def forward_old(self, batch: TrajectoryBatch) -> dict[str, int]:
        """Build ``batch.learner`` from its trajectories and fill its ``old_logprobs`` and ``entropies`` ([B, T-1])
        under the current policy. Returns the pass's padded tokens (rows x longest row of every micro-batch, padding
        micro-batches included), over all ranks and on the slowest rank, as ``update`` reports its own, and the ranks'
        process CPU seconds in the pass (``cpu_s``)."""
        world, lc = self.world_size, self.cfg.learner
        # one pass over the whole batch, in micro-batches no bigger than a rank's share of a mini-batch (memory)
        max_rows = lc.micro_rows(lc.mini_batch_size // world)
        lb = self.learner_batch(batch)
        per_rank, _ = split_for_ranks(lb, world, max_rows, self.pad_id, lc.micro_batch_order())
        results = _gather([w.forward_old.remote(mbs) for w, mbs in zip(self.workers, per_rank)])
        put_back_pass(lb, per_rank, [r["passes"] for r in results])
        per_rank_tokens = [sum(mb.input_ids.numel() for mb in mbs) for mbs in per_rank]
        return {
            "padded_tokens": sum(per_rank_tokens),
            "slowest_rank_padded_tokens": max(per_rank_tokens),
            "cpu_s": sum(r["cpu_s"] for r in results),  # the ranks' process CPU seconds in the pass
        }

    def learner_batch(self, batch: TrajectoryBatch) -> LearnerBatch:
        """``batch.learner``: the step's trajectories as the learners' padded tensors (no pass run yet)."""
        behaviour = self.cfg.algo.behaviour_correction != "none"
        batch.learner = LearnerBatch.from_trajectories(batch.trajectories, self.pad_id, behaviour=behaviour)
        return batch.learner

    def update(self, batch: TrajectoryBatch, step: int, old_from_update: bool = False) -> dict:
        """PPO epochs over ``batch`` (old log-probs and advantages filled); returns the update's statistics.

        Each epoch shuffles the rows (seeded by ``trainer.seed``, ``step`` and the epoch) into mini-batches of
        ``learner.mini_batch_size``; each mini-batch's global loss denominator is fixed before any rank
        computes a loss, and each rank gets its share of it in micro-batches of ``learner.micro_batch_size`` rows
        (its whole share by default).

        ``old_from_update`` (the old-policy pass skipped, rapo_ray/algos/old_pass.py): one optimizer step whose
        own log-probs are pi_old; it fills ``batch.learner``'s ``old_logprobs`` and ``entropies`` from it."""
        batch.require("learner")
        lb = batch.learner
        lb.require("signal")
        lc, world = self.cfg.learner, self.world_size
        if old_from_update:
            return self._update_at_old_policy(batch, lb)
        lb.require("old_logprobs")
        agg = self.cfg.algo.loss_agg_mode
        dealing = lc.micro_batch_order()
        out: dict[str, float] = {}
        for epoch in range(lc.ppo_epochs):
            order = list(range(len(lb)))
            random.Random(self.cfg.trainer.seed * 31 + step * 7 + epoch).shuffle(order)
            minis = [lb.select(order[i : i + lc.mini_batch_size]) for i in range(0, len(order), lc.mini_batch_size)]
            denoms = [aggregation_denominator(mini.loss_mask.float(), agg) for mini in minis]
            if self.cfg.trainer.learner_feed == "streaming_split":
                stats = self._update_streaming(minis, denoms)
            else:
                per_rank: list[list] = [[] for _ in range(world)]
                for mini, denom in zip(minis, denoms):
                    split, _ = split_for_ranks(mini, world, lc.micro_batch_size, self.pad_id, dealing)
                    for rank in range(world):
                        per_rank[rank].append((split[rank], denom))
                stats = _gather([w.update.remote(per_rank[r]) for r, w in enumerate(self.workers)])
            out = merge_actor_stats(stats)  # the last epoch's numbers are reported
            out.pop("rows", None)  # streaming_split's delivery count, checked in _update_streaming
        return out

    def _update_at_old_policy(self, batch: TrajectoryBatch, lb: LearnerBatch) -> dict:
        """One optimizer step over all of ``lb``'s rows, in row order, whose forward stands in for the old-policy
        pass (its values go into ``batch.learner``)."""
        lc = self.cfg.learner
        if reason := one_update_reason(self.cfg, len(lb)):
            raise ValueError(f"the update stands in for the old-policy pass only as one optimizer step: {reason}")
        denominator = aggregation_denominator(lb.loss_mask.float(), self.cfg.algo.loss_agg_mode)
        split, _ = split_for_ranks(lb, self.world_size, lc.micro_batch_size, self.pad_id, lc.micro_batch_order())
        results = _gather([w.update.remote([(split[r], denominator)], True) for r, w in enumerate(self.workers)])
        put_back_pass(batch.learner, split, [passes for _, passes in results])
        return merge_actor_stats([stats for stats, _ in results])

    def _update_streaming(self, minis: list[LearnerBatch], denoms: list[float]) -> list[dict]:
        """One epoch's mini-batches as a Ray Data dataset (one block per micro-batch's worth of rows, all of the
        epoch's width), read by the ranks through ``streaming_split``; each row carries its mini-batch index."""
        world = self.world_size
        micro = self.cfg.learner.micro_rows(math.ceil(self.cfg.learner.mini_batch_size / world))
        flat = LearnerBatch.concat(minis, self.pad_id)
        mb_index = [k for k, mini in enumerate(minis) for _ in range(len(mini))]
        blocks = [
            flat.select(range(i, min(i + micro, len(flat))), trim=False).to_arrow({"mb": mb_index[i : i + micro]})
            for i in range(0, len(flat), micro)
        ]
        splits = ray.data.from_arrow(blocks).streaming_split(world, equal=False)  # equal=True would drop rows
        stats = _gather([w.update_from_stream.remote(splits[r], denoms, micro) for r, w in enumerate(self.workers)])
        delivered = merge_actor_stats(stats)["rows"]
        if delivered != len(flat):
            raise RuntimeError(
                f"streaming_split delivered {delivered:.0f} rows to the ranks; the epoch has {len(flat)}"
            )
        return stats

    def state_dict(self) -> dict:
        """The full weights (HF names, CPU tensors), gathered on rank 0: every rank takes part, only rank 0's
        copy comes back."""
        refs = [w.full_state_dict.remote() for w in self.workers]
        return _gather(refs)[0]

    def save(self, path, tokenizer_dir) -> None:
        """Rank 0 writes the HF model and the optimizer state into ``path`` (which must not exist yet)."""
        _gather([w.save_checkpoint.remote(str(path), str(tokenizer_dir)) for w in self.workers])

    def load(self, path) -> None:
        _gather([w.load_checkpoint.remote(str(path)) for w in self.workers])

    def shutdown(self, graceful: bool = True) -> None:
        """``graceful=False`` after a rank died: the survivors may be blocked in a collective, so they are
        killed without asking."""
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            if graceful:
                try:
                    ray.get(w.shutdown.remote(), timeout=30)
                except Exception:
                    pass
            ray.kill(w)
        remove_placement_group(self.pg)
