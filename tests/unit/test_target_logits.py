"""``logits_at`` (rapo_ray/model/target_logits.py): the LM head applied only where a loss reads log-probs gives the
same logits and the same gradients as every position's logits selected afterwards."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rapo_ray.algos.loss import logprobs_of, target_logprobs
from rapo_ray.model.target_logits import logits_at

SHAPE = dict(
    vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0
)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2-tied":  # the bundled model's architecture
        return Qwen2ForCausalLM(Qwen2Config(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True))
    return LlamaForCausalLM(LlamaConfig(**SHAPE, num_key_value_heads=4, tie_word_embeddings=False))


def _batch():
    """Two right-padded rows (lengths 9 and 6 of T = 9), targets marked in a ragged pattern, as a response mask is."""
    torch.manual_seed(1)
    ids = torch.randint(1, 97, (2, 9))
    ids[1, 6:] = 0
    attn = (torch.arange(9)[None] < torch.tensor([[9], [6]])).long()
    at = torch.zeros(2, 8, dtype=torch.bool)
    at[0, 3:8] = True
    at[1, [2, 3, 4]] = True
    return ids, attn, at


@pytest.mark.parametrize("kind", ["qwen2-tied", "llama-untied"])
def test_logits_at_targets_equal_full_logits_and_their_gradients(kind):
    model = _model(kind)
    ids, attn, at = _batch()

    full = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
    (target_logprobs(full, ids)[at].sum()).backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    got = logits_at(model, ids, attn, at)
    assert got.shape == (int(at.sum()), 97)
    torch.testing.assert_close(got, full[at], rtol=1e-5, atol=1e-5)
    logprobs_of(got, ids[:, 1:][at]).sum().backward()
    for p, g in zip(model.parameters(), full_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
    # the hook is gone: the next plain call is every position's logits again
    assert model(input_ids=ids, attention_mask=attn).logits.shape == (2, 9, 97)


def test_logits_at_without_the_hook_selects_after_the_full_forward():
    model = _model("qwen2-tied")
    ids, attn, at = _batch()
    torch.testing.assert_close(
        logits_at(model, ids, attn, at, only_at=False), logits_at(model, ids, attn, at), rtol=1e-5, atol=1e-5
    )


def test_no_selected_position_gives_no_rows_and_still_backpropagates():
    """A padding micro-batch (all-zero mask) selects nothing, yet its backward must reach every layer: FSDP's
    collectives need every rank in every backward."""
    model = _model("qwen2-tied")
    ids, attn, _ = _batch()
    none = torch.zeros(2, 8, dtype=torch.bool)
    got = logits_at(model, ids, attn, none)
    assert got.shape == (0, 97)
    logprobs_of(got, ids[:, 1:][none]).sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_bad_mask_and_a_model_that_bypasses_its_head_are_refused_by_name():
    model = _model("qwen2-tied")
    ids, attn, at = _batch()
    with pytest.raises(ValueError, match=r"`at` must be a bool \[B, T-1\] = \[2, 8\]"):
        logits_at(model, ids, attn, at[:, :-1])
    with pytest.raises(ValueError, match="`at` must be a bool"):
        logits_at(model, ids, attn, at.long())

    class HeadNeverCalled(torch.nn.Module):  # computes logits with the embedding matrix directly
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_output_embeddings(self):
            return self.inner.lm_head

        def forward(self, input_ids, attention_mask, use_cache):
            h = self.inner.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return type("Out", (), {"logits": h @ self.inner.lm_head.weight.T})()

    with pytest.raises(RuntimeError, match="HeadNeverCalled.*learner.logits_only_at_targets=false"):
        logits_at(HeadNeverCalled(model), ids, attn, at)
    torch.testing.assert_close(
        logits_at(HeadNeverCalled(model), ids, attn, at, only_at=False), logits_at(model, ids, attn, at)
    )
