"""``logits_at``: a causal LM's logits at the positions a loss reads, and nowhere else.

A causal LM's forward applies its output embedding (the LM head) at every position of a padded batch, and a
log-prob then needs a log-sum-exp over the vocabulary at each; the learner reads them only at generated targets (the
old-policy pass and the update). Handing the output embedding just those positions' hidden states makes the head,
its softmax and their gradients cost N rows instead of B x T, and keeps a large vocabulary's logits (SmolLM2's 49k,
Qwen2.5's 152k) from being most of a pass's memory.

The swap is a forward pre-hook on the output embedding for the length of one call, so it happens inside the model's
own forward: FSDP2's hooks on the root module (which holds a tied head) see an ordinary call.
"""

from __future__ import annotations

import torch


def logits_at(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention_mask: torch.Tensor,
    at: torch.Tensor,
    only_at: bool = True,
) -> torch.Tensor:
    """Logits that predict the targets marked in ``at``.

    Args:
        model: a Hugging Face causal LM (plain or FSDP2-sharded) whose forward applies
            ``get_output_embeddings()`` to its final hidden states.
        ids: [B, T] int64 input ids.
        attention_mask: [B, T], 1 on real tokens.
        at: [B, T-1] bool; ``at[b, t]`` marks target ``ids[b, t + 1]``, predicted from position ``t``.
        only_at: apply the head only at ``at`` (a pre-hook hands it the selected hidden states, [N, H]); False
            computes every position's logits and selects afterwards: the same values to float rounding, for a model
            whose forward does not route its last hidden states through its output embedding.

    Returns:
        [N, V] logits in the model's compute dtype, N = ``at.sum()``, in row-major order of ``at`` (row 0's targets
        first, as ``tensor[at]`` orders them).
    """
    B, T = ids.shape
    if at.shape != (B, T - 1) or at.dtype != torch.bool:
        raise ValueError(
            f"logits_at: `at` must be a bool [B, T-1] = [{B}, {T - 1}] mask, got {at.dtype} {tuple(at.shape)}"
        )
    at = at.to(ids.device)
    if not only_at:
        logits = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits
        return logits[:, :-1][at]

    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(
            f"{type(model).__name__} has no output embedding to compute logits at selected positions; "
            "set learner.logits_only_at_targets=false"
        )
    calls = []

    def select(_module, args):
        calls.append(tuple(args[0].shape))
        return (args[0][:, :-1][at],)

    hook = head.register_forward_pre_hook(select)
    try:
        # no KV cache: nothing here decodes, and a cache would hold every layer's keys and values to the end
        logits = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits
    finally:
        hook.remove()
    n = int(at.sum())
    if len(calls) != 1 or calls[0][:2] != (B, T) or logits.dim() != 2 or logits.shape[0] != n:
        raise RuntimeError(
            f"{type(model).__name__}'s forward did not apply its output embedding once to [B, T, H] = [{B}, {T}, H] "
            f"hidden states (it saw {calls}, logits {tuple(logits.shape)}), so logits at selected positions cannot "
            "be taken from it; set learner.logits_only_at_targets=false"
        )
    return logits
