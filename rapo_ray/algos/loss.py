"""The clipped policy objective of RAPO (Eq. 11), which is GRPO's when the shaping factor is 1.

Aggregation across data-parallel shards: every mode is a sum over shards of ``shard_sum / global_denominator``
(tokens for ``token-mean``, sequences for the ``seq-mean-*`` modes). A learner passes the global
denominator, so the sum of shard losses equals the full-batch loss and summing (all-reducing) gradients
gives the full-batch gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_TYPES = ("k1", "k3")
BEHAVIOUR_CORRECTIONS = ("none", "truncate", "mask")


@dataclass(frozen=True)
class PolicyLossConfig:
    """clip_low/clip_high: ratio clipped to [1 - clip_low, 1 + clip_high] (paper: 0.28 both).
    dual_clip: c > 1 bounds the loss of negative-advantage tokens at ``-A * c`` (verl's clip_ratio_c); None off.
    kl_coef / kl_type: penalty against a reference policy (paper: 0, so no reference model is needed).
    agg_mode: one of AGG_MODES.
    behaviour_correction / behaviour_cap: weight each token's surrogate by w = pi_old / pi_behaviour, the engine that
        sampled it being the behaviour policy and ``old_logp`` the proximal one (the decoupled objective; w corrects
        both a stale engine and engine/learner numerics). ``truncate``: min(w, cap) (truncated importance sampling);
        ``mask``: w, or 0 where w > cap; ``none``: no weight (today's objective, to the bit).
    """

    clip_low: float = 0.28
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_type: str = "k3"
    agg_mode: str = "token-mean"
    behaviour_correction: str = "none"
    behaviour_cap: float = 2.0

    def __post_init__(self):
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"agg_mode={self.agg_mode!r}; valid: {AGG_MODES}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type={self.kl_type!r}; valid: {KL_TYPES}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(
                f"clip range must satisfy 0 <= clip_low < 1, clip_high >= 0; got {self.clip_low}, {self.clip_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip}")
        if self.behaviour_correction not in BEHAVIOUR_CORRECTIONS:
            raise ValueError(f"behaviour_correction={self.behaviour_correction!r}; valid: {BEHAVIOUR_CORRECTIONS}")
        if self.behaviour_cap <= 1:
            raise ValueError(f"behaviour_cap must be > 1, got {self.behaviour_cap}")


def target_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log pi(ids[:, t+1] | ids[:, :t+1]) for every position (``logprobs_of`` on each position's logits).

    Args:
        logits: [B, L-1, V] float, the model's logits at positions 0..L-2.
        ids: [B, L] the sequence (targets are ``ids[:, 1:]``).

    Returns:
        [B, L-1] log-probs.
    """
    return logprobs_of(logits, ids[:, 1:].to(logits.device))


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per row of logits: the target's logit minus the row's logsumexp, which keeps no
    full-vocabulary log_softmax alive (at a 152k vocabulary, one more copy of the logits).

    Args:
        logits: [..., V] float.
        targets: [...] int64 token ids.

    Returns:
        [...] log-probs.
    """
    return logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, -1)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate of pi_theta from pi_ref: k1 = log(pi/pi_ref); k3 = e^{-k1} + k1 - 1 (>= 0)."""
    log_ratio = logp - ref_logp
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"kl_type={kl_type!r}; valid: {KL_TYPES}")


def aggregation_denominator(loss_mask: torch.Tensor, agg_mode: str) -> float:
    """The local denominator for ``agg_mode``: loss tokens, or sequences with at least one loss token.

    Sum it over shards to get the global denominator to pass to ``policy_loss``.
    """
    if agg_mode == "token-mean":
        return float(loss_mask.sum())
    if agg_mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return float((loss_mask.sum(dim=-1) > 0).sum())
    raise ValueError(f"agg_mode={agg_mode!r}; valid: {AGG_MODES}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig = PolicyLossConfig(),
    shaping: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    denominator: float | None = None,
    behaviour_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate of Eq. 11 with importance shaping (Eq. 8), as a loss to minimise.

    Per token:  r = exp(logp - old_logp);  r_hat = s_i * r  (s_i = 1 + m F_ret^i, or 1)
                L = max(-A r_hat, -A clip(r_hat, 1 - clip_low, 1 + clip_high))
                with dual clip for A < 0: L = min(L, -A c);
                with a behaviour correction: L = w L, w = exp(old_logp - behaviour_logp) truncated or masked at the
                cap (no gradient through w);   plus kl_coef * KL(pi || pi_ref).

    Args:
        logp: [B, T] log-prob of each response token under the current policy (requires grad).
        old_logp: [B, T] under the behaviour policy (pi_old), no grad.
        advantages: [B, T] token advantages, or [B] per-trajectory (broadcast).
        loss_mask: [B, T] 1 on tokens that carry gradient; tool results, retrieved tokens, padding are 0.
        cfg: clip/KL/aggregation settings.
        shaping: [B] per-trajectory factor (1 + m F_ret); None means 1.
        ref_logp: [B, T] reference log-probs; required when ``cfg.kl_coef > 0``.
        denominator: global token or sequence count across data-parallel shards (see module doc);
            None uses this batch's own.
        behaviour_logp: [B, T] log-probs under the policy that sampled the tokens (the engine's); required when
            ``cfg.behaviour_correction`` is not ``none``. A masked-out token still counts in the denominator.

    Returns:
        (scalar loss, metrics). Masked tokens contribute exactly zero to the loss and its gradient.
    """
    if logp.shape != old_logp.shape or logp.shape != loss_mask.shape:
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    mask = loss_mask.to(logp.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    advantages = advantages.to(logp.dtype)
    # Masked positions may hold garbage (padding); zero the log-ratio there so exp() cannot overflow.
    log_ratio = torch.where(mask > 0, logp - old_logp, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    shaped = ratio if shaping is None else shaping.to(logp.dtype)[:, None] * ratio
    per_token, clipped, dual_clipped = clipped_surrogate(shaped, advantages, cfg)

    weight = beyond = None
    if cfg.behaviour_correction != "none":
        if behaviour_logp is None or behaviour_logp.shape != logp.shape:
            raise ValueError(
                f"behaviour_correction={cfg.behaviour_correction} needs behaviour_logp shaped like logp "
                f"{tuple(logp.shape)}, got {None if behaviour_logp is None else tuple(behaviour_logp.shape)}"
            )
        weight, beyond = behaviour_weight(old_logp, behaviour_logp, mask, cfg)
        per_token = per_token * weight

    kl_value = None
    if cfg.kl_coef != 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        kl_value = kl_penalty(logp, ref_logp, cfg.kl_type)
        kl_value = torch.where(mask > 0, kl_value, torch.zeros_like(kl_value))
        per_token = per_token + cfg.kl_coef * kl_value

    per_token = per_token * mask
    if denominator is None:
        denominator = aggregation_denominator(loss_mask, cfg.agg_mode)
    loss = aggregate(per_token, mask, denominator, cfg.agg_mode)
    with torch.no_grad():
        metrics = surrogate_metrics(mask, ratio, log_ratio, shaped, clipped, dual_clipped)
        if kl_value is not None:
            metrics["kl_ref"] = float(kl_value.sum() / mask.sum().clamp(min=1.0))
        if weight is not None:
            metrics.update(behaviour_metrics(mask, weight, beyond))
    return loss, metrics


def clipped_surrogate(
    shaped: torch.Tensor, advantages: torch.Tensor, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped objective per token, with the dual clip for negative advantages.

    Args:
        shaped: [B, T] the (shaped) ratio r_hat.
        advantages: [B, T] token advantages.
        cfg: clip_low / clip_high / dual_clip.

    Returns:
        (per_token loss [B, T], where the clipped term won [B, T] bool, where the dual clip bound [B, T] bool).
    """
    unclipped = -advantages * shaped
    clipped = -advantages * torch.clamp(shaped, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(per_token, dtype=torch.bool)
    if cfg.dual_clip is not None:
        bound = -advantages * cfg.dual_clip
        dual_clipped = (advantages < 0) & (per_token > bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
    return per_token, clipped > unclipped, dual_clipped


def behaviour_weight(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoupled objective's weight w = pi_old / pi_behaviour per token, truncated or masked at the cap; no
    gradient flows through it.

    Args:
        old_logp, behaviour_logp: [B, T] log-probs under the proximal policy and under the engine that sampled.
        mask: [B, T] float loss mask (w = 1 off the mask).
        cfg: behaviour_correction (truncate | mask) and behaviour_cap.

    Returns:
        (w [B, T], where the raw weight exceeded the cap [B, T] bool).
    """
    with torch.no_grad():
        gap = torch.where(mask > 0, old_logp - behaviour_logp, torch.zeros_like(mask)).to(mask.dtype)
        raw = torch.exp(gap.clamp(max=20.0))  # exp(20) is far above any cap: no overflow, same outcome
        beyond = raw > cfg.behaviour_cap
        if cfg.behaviour_correction == "truncate":
            return raw.clamp(max=cfg.behaviour_cap), beyond
        return torch.where(beyond, torch.zeros_like(raw), raw), beyond


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, denominator: float, agg_mode: str) -> torch.Tensor:
    """The scalar loss of masked per-token losses [B, T] under ``agg_mode``, divided by the global ``denominator``
    (``aggregation_denominator`` summed over shards; at least 1)."""
    denominator = max(float(denominator), 1.0)
    if agg_mode == "token-mean":
        return per_token.sum() / denominator
    if agg_mode == "seq-mean-token-mean":
        return (per_token.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)).sum() / denominator
    return per_token.sum(dim=-1).sum() / denominator  # seq-mean-token-sum


def surrogate_metrics(
    mask: torch.Tensor,
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    shaped: torch.Tensor,
    clipped: torch.Tensor,
    dual_clipped: torch.Tensor,
) -> dict[str, float]:
    """The objective's per-token means over loss tokens (all tensors [B, T]): clip fractions, the k3 estimate of
    KL(pi_old || pi) (PPO logs' "approx_kl") and the shaped ratio's range."""
    n = mask.sum().clamp(min=1.0)
    on = mask > 0
    return {
        "clip_frac": float((clipped & on).sum() / n),
        "dual_clip_frac": float((dual_clipped & on).sum() / n),
        "approx_kl": float(((ratio - 1.0 - log_ratio) * mask).sum() / n),
        "ratio_mean": float((shaped * mask).sum() / n),
        "ratio_max": float(shaped[on].max()) if bool(on.any()) else 1.0,
        "ratio_min": float(shaped[on].min()) if bool(on.any()) else 1.0,
        "loss_tokens": float(mask.sum()),
    }


def behaviour_metrics(mask: torch.Tensor, weight: torch.Tensor, beyond: torch.Tensor) -> dict[str, float]:
    """The behaviour weight's mean and the fraction of loss tokens beyond its cap (tensors [B, T])."""
    n = mask.sum().clamp(min=1.0)
    return {
        "behaviour_weight_mean": float((weight * mask).sum() / n),
        "behaviour_capped_frac": float((beyond & (mask > 0)).sum() / n),
    }
