"""Token and step entropies (spec Eq. 2).

The segment table of a trajectory lists ``(kind, start, end)`` in response-token coordinates, ``end``
exclusive. Only ``generated`` segments are steps of the policy; ``tool_result`` and ``retrieved`` segments
are never part of a step entropy.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rapo_ray.types.trajectory import GENERATED, SEGMENT_KINDS, Segment


def token_entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary entropy ``H_i = -sum_j p_ij log p_ij`` with ``p_i = softmax(z_i)`` (Eq. 2).

    Args:
        logits: [..., V].

    Returns:
        [...] entropy in nats, computed in float32 (or the input dtype if wider).
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def validate_segments(segments: Sequence[Segment], length: int) -> None:
    """Check that segments are known kinds, ordered, non-overlapping and inside ``[0, length)``."""
    prev_end = 0
    for kind, start, end in segments:
        if kind not in SEGMENT_KINDS:
            raise ValueError(f"unknown segment kind {kind!r}; valid kinds: {SEGMENT_KINDS}")
        if not (prev_end <= start <= end <= length):
            raise ValueError(f"segment ({kind}, {start}, {end}) is out of order or outside [0, {length})")
        prev_end = end


def step_entropies(token_entropy: torch.Tensor, segments: Sequence[Segment]) -> list[float]:
    """Mean token entropy of each generated step of one trajectory: ``H_{s_t} = mean_i H_{s_t,i}``.

    Args:
        token_entropy: [T] per-token entropy over the response tokens.
        segments: the trajectory's segment table.

    Returns:
        One float per ``generated`` segment, in order (the index into this list is the step index used by
        retrieval records). An empty generated segment gets 0.0.
    """
    validate_segments(segments, token_entropy.shape[-1])
    out = []
    for kind, start, end in segments:
        if kind == GENERATED:
            out.append(float(token_entropy[start:end].mean()) if end > start else 0.0)
    return out
