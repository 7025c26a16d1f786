"""Outcome advantages (GRPO) and their broadcast to tokens.

Conventions follow verl's ``compute_grpo_outcome_advantage`` (unbiased std, eps added to the std), with
one deliberate difference requested by the project: a group of size 1 has no baseline to compare against,
so its advantage is 0 (verl leaves the raw score there).
"""

from __future__ import annotations

import torch

EPS = 1e-6


def _group_index(group_ids: torch.Tensor | list) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids [B] to dense indices 0..G-1 in order of first appearance."""
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    dense: dict = {}
    index = [dense.setdefault(g, len(dense)) for g in ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


def group_zscore(
    values: torch.Tensor,
    group_ids: torch.Tensor | list,
    divide_by_std: bool = True,
    eps: float = EPS,
) -> torch.Tensor:
    """Per-group standardisation ``(x - mean_g) / (std_g + eps)``.

    Args:
        values: [B] float, one value per trajectory.
        group_ids: [B] group id of each trajectory (any hashable values, or an int tensor).
        divide_by_std: False gives ``x - mean_g`` (Dr. GRPO).
        eps: added to the unbiased std.

    Returns:
        [B] float. Groups of size 1 and groups whose values are all equal get exactly 0.
    """
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D [B], got shape {tuple(values.shape)}")
    index, num_groups = _group_index(group_ids)
    if index.numel() != values.numel():
        raise ValueError(f"group_ids has {index.numel()} entries but values has {values.numel()}")
    values = values.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, torch.ones_like(values))
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, values)
    mean = total / count
    centred = values - mean[index]
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, centred**2)
    # Unbiased std (torch.std default, as verl); a size-1 group has none.
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    out = centred / (std[index] + eps) if divide_by_std else centred
    singleton = count[index] < 2
    constant = std[index] == 0
    out = torch.where(singleton | constant, torch.zeros_like(out), out)
    return out.to(torch.float32)


def grpo_outcome_advantage(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | list,
    norm_by_std: bool = True,
    eps: float = EPS,
) -> torch.Tensor:
    """GRPO outcome advantage ``A_acc^i = (R_i - mean R) / (std R + eps)`` within each group (spec §3, Eq. 10's A_acc).

    Args:
        rewards: [B] outcome reward per trajectory.
        group_ids: [B] group (prompt) id per trajectory.
        norm_by_std: divide by the group std (GRPO) or not (Dr. GRPO).

    Returns:
        [B] advantage per trajectory.
    """
    return group_zscore(rewards, group_ids, divide_by_std=norm_by_std, eps=eps)
