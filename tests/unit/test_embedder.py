"""The MiniLM embedder: pooling, truncation, sub-batches and the query cache leave every vector as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def test_embedder_pooling_and_truncation():
    from rapo_ray.retrieval.embedder import Embedder
    from rapo_ray.retrieval.key_text import preprocess

    emb = Embedder(pooling="last")
    v = emb.embed(["The mentor of Kaloka is Zoneka.", "mentor of Kaloka", "print(3 + 4)"])
    assert v.shape == (3, 384) and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert preprocess("x" * 5000, 1300) == "x" * 1300
    assert preprocess("system stuff\nuser\nquestion here") == "question here"
    mean = Embedder(pooling="mean").embed(["mentor of Kaloka"])
    assert not np.allclose(mean[0], v[1])
    with pytest.raises(ValueError, match="pooling"):
        Embedder(pooling="max")


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embedder_vectors_are_minilm_s_own(pooling):
    """Against MiniLM run whole by transformers (each text alone, so no padding): the embedder's vectors, one text
    at a time and in a padded batch, are the pooled last hidden states, also with last-token pooling where the
    embedder runs the last layer for the last position only."""
    from transformers import AutoModel, AutoTokenizer

    from rapo_ray.retrieval.embedder import Embedder, minilm_path

    texts = [
        "Who is the rival of Pamiga? <search>rival of Pamiga</search><result>The rival of Pamiga is Zo.</result>",
        "print(3 + 4)",
        "Fay has 150 beads. " * 30,
    ]
    model, tok = AutoModel.from_pretrained(str(minilm_path())).eval(), AutoTokenizer.from_pretrained(str(minilm_path()))
    with torch.inference_mode():
        hidden = [model(**tok(t, return_tensors="pt")).last_hidden_state[0] for t in texts]
    want = [h[-1] if pooling == "last" else h.mean(0) for h in hidden]
    want = torch.nn.functional.normalize(torch.stack(want), dim=-1).numpy()
    emb = Embedder(pooling=pooling)
    alone = np.concatenate([emb.embed([t]) for t in texts])
    assert np.abs(alone - want).max() < 1e-5
    assert np.abs(emb.embed(texts) - want).max() < 1e-5
    if pooling == "last":  # MiniLM run whole (the benchmark's baseline) gives them too
        assert np.abs(Embedder(pooling="last", last_position_only=False).embed(texts) - want).max() < 1e-5


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embedding_does_not_depend_on_batch_mates(pooling):
    """Left padding must not shift a text's positions: a query embeds the same alone and batched with a long
    text (it did not: cosine 0.61 with last-token pooling before positions were counted per text)."""
    from rapo_ray.retrieval.embedder import Embedder

    emb = Embedder(pooling=pooling)
    query = "Kai has 135 shells. Kai finds 415 more shells. <think>compute 135 + 415</think>"
    alone = emb.embed([query])[0]
    for mate in ("Fay has 150 beads. " * 60, "short"):
        batched = emb.embed([query, mate])[0]
        assert float(alone @ batched) > 0.9999 and np.abs(alone - batched).max() < 1e-4


def test_embedder_sub_batches_sorted_by_length_within_the_padding_slack():
    from rapo_ray.retrieval.embedder import Embedder

    emb = Embedder(pad_slack=0.1)
    # sorted 10, 11, 12 | 50, 52: a fourth row of 50 would pad 4 x 50 = 200 tokens for 83 real ones
    assert emb.sub_batches([10, 50, 11, 52, 12]) == [[0, 2, 4], [1, 3]]
    emb.batch_size = 2
    assert emb.sub_batches([10, 50, 11, 52, 12]) == [[0, 2], [4], [1, 3]]
    assert Embedder(pad_slack=float("inf")).sub_batches([10, 50, 11]) == [[0, 2, 1]]


def test_embedder_cache_and_sub_batches_give_the_vectors_of_one_text_at_a_time():
    from rapo_ray.retrieval.embedder import Embedder

    texts = [
        "Kai has 135 shells. <think>compute 135 + 415</think>",
        "Fay has 150 beads. " * 40,
        "short",
        "Kai has 135 shells. <think>compute 135 + 415</think>",  # a repeat, embedded once
        "mentor of Kaloka",
    ]
    plain = Embedder(cache_size=0, pad_slack=0.0)
    alone = np.stack([plain.embed([t])[0] for t in texts])
    cached = Embedder(cache_size=3)
    first = cached.embed(texts)
    assert np.abs(first - alone).max() < 1e-4
    assert (cached.cache_hits, cached.cache_misses) == (0, 4) and len(cached._cache) == 3  # oldest evicted
    again = cached.embed([texts[4], texts[0]])  # texts[4] is cached; texts[0] was evicted
    assert (cached.cache_hits, cached.cache_misses) == (1, 5)
    assert np.array_equal(again[0], first[4]) and np.abs(again[1] - alone[0]).max() < 1e-4
    with pytest.raises(ValueError, match="cache_size"):
        Embedder(cache_size=-1)
