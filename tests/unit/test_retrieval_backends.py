"""Step-retrieval backends (retrieval.embedder): BM25 against hand-computed values and bm25s, the lexical replica
index, the hashed term vectors, the int8 ONNX MiniLM against torch's, the registry and its config checks."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from rapo_ray.config import load_config
from rapo_ray.core.errors import ConfigError
from rapo_ray.retrieval.backends import BACKENDS, backend_fingerprint, is_lexical, make_encoder, prepare_backend
from rapo_ray.retrieval.embedder import Embedder
from rapo_ray.retrieval.key_text import DIM, preprocess
from rapo_ray.retrieval.lexical import Bm25Index, HashedTermEncoder, terms
from rapo_ray.retrieval.replica_index import LexicalReplicaIndex
from rapo_ray.retrieval.service import replica_actor_options

HISTORIES = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "<python>print(48 / 2)</python><result>24.0</result> Natalia sold 24 clips in May.",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs.",
    "<python>print(12 / 60 * 50)</python><result>10.0</result> Weng earned 10 dollars.",
]


def test_terms_keep_single_digits_and_drop_punctuation():
    assert terms("Print(48 / 2) = 24.0; x_1") == ["print", "48", "2", "24", "0", "x", "1"]


def test_bm25_scores_equal_hand_computed_values():
    """Two documents of length 2 (avg 2, so the length norm is k1): "cat dog" and "dog dog".
    idf(cat) = ln(1 + (2 - 1 + .5) / (1 + .5)) = ln 2; idf(dog) = ln(1 + .5 / 2.5) = ln 1.2.
    tf part: 1 / (1 + 1.5) = 0.4 for one occurrence, 2 / (2 + 1.5) = 4/7 for two."""
    index = Bm25Index(k1=1.5, b=0.75)
    index.set(0, "cat dog")
    index.set(1, "dog dog")
    got = index.scores(["cat", "dog", "dog cat", "cat cat", "zebra"])
    want = [
        [math.log(2) * 0.4, 0.0],
        [math.log(1.2) * 0.4, math.log(1.2) * 4 / 7],
        [math.log(2) * 0.4 + math.log(1.2) * 0.4, math.log(1.2) * 4 / 7],
        [2 * math.log(2) * 0.4, 0.0],  # a repeated query term counts again (as bm25s and Lucene)
        [0.0, 0.0],
    ]
    assert np.allclose(got, want, atol=1e-6)
    index.set(1, "cat")  # replace a document: statistics follow (df(cat) = 2, lengths 2 and 1)
    avg = 1.5
    tf0, tf1 = 1 / (1 + 1.5 * (0.25 + 0.75 * 2 / avg)), 1 / (1 + 1.5 * (0.25 + 0.75 * 1 / avg))
    assert np.allclose(index.scores(["cat"]), [[math.log(1.2) * tf0, math.log(1.2) * tf1]], atol=1e-6)
    with pytest.raises(IndexError, match="row 5"):
        index.set(5, "gap")
    with pytest.raises(ValueError, match="k1"):
        Bm25Index(k1=-1)


def _bm25s_without_numba():
    """The oracle (dev extra), imported with numba hidden: bm25s loads numba and llvmlite when it can, and llvmlite's
    objects in ``sys.modules`` break vLLM 0.32's kernel-override scan (``vllm/triton_utils/dispatcher.py``:
    AttributeError on llvmlite's ``_lib_fn_wrapper``) for a vLLM engine started later in the same pytest process."""
    saved = sys.modules.get("numba", _MISSING)
    sys.modules["numba"] = None  # "import numba" raises ImportError: bm25s falls back to numpy
    try:
        import bm25s
    finally:
        if saved is _MISSING:
            del sys.modules["numba"]
        else:
            sys.modules["numba"] = saved
    return bm25s


_MISSING = object()


def test_bm25_scores_equal_bm25s_on_agent_histories():
    bm25s = _bm25s_without_numba()
    assert "llvmlite" not in sys.modules or "numba" in sys.modules  # numba (and llvmlite) kept out where absent

    index = Bm25Index()
    for row, text in enumerate(HISTORIES):
        index.set(row, text)
    oracle = bm25s.BM25(k1=1.5, b=0.75, method="lucene")
    oracle.index([terms(t) for t in HISTORIES], show_progress=False)
    queries = ["Natalia clips 48 half", "<python>print(12 / 60 * 50)</python>", "wallet $100 half"]
    for query, row in zip(queries, index.scores(queries)):
        assert np.allclose(row, oracle.get_scores(terms(query)), atol=1e-5)


def _payload(i):
    return (f"<think>v{i}</think>", "[]", 1.0, f"q{i % 2}")


def test_lexical_replica_index_ranks_by_bm25_and_upserts_by_id():
    index = LexicalReplicaIndex(DIM, key_text=lambda t: preprocess(t, 1300))
    vec = np.zeros((len(HISTORIES), DIM), dtype=np.float32)
    index.add([f"s{i}" for i in range(len(HISTORIES))], vec, [_payload(i) for i in range(5)], HISTORIES)
    (hits,) = index.search_texts(["how many clips did Natalia sell in May? 48"], top_k=2)
    assert [h.value for h in hits] == ["<think>v0</think>", "<think>v2</think>"] and hits[0].score > hits[1].score
    (own,) = index.search_texts(["Natalia clips"], top_k=3, question_filter=[("own", "q1")])
    assert {h.question_id for h in own} == {"q1"}
    index.add(["s0"], vec[:1], [("<think>moved</think>", "[]", 0.0, "q0")], ["Betty wallet wallet wallet"])
    (hits,) = index.search_texts(["wallet"], top_k=1)
    assert len(index) == 5 and hits[0].value == "<think>moved</think>"
    with pytest.raises(ValueError, match="needs its key"):
        index.add(["s9"], vec[:1], [_payload(9)])
    assert LexicalReplicaIndex(DIM, key_text=str).search_texts(["x"]) == [[]]


def test_lexical_replica_index_answers_the_same_whatever_order_rows_arrive_in():
    """A restarted replica reads Milvus's rows in another order; after ``_order_rows_by_id`` it ranks the same."""
    results = []
    for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1]):
        index = LexicalReplicaIndex(DIM, key_text=str)
        index.add(
            [f"s{i}" for i in order],
            np.zeros((5, DIM), dtype=np.float32),
            [_payload(i) for i in order],
            [HISTORIES[i] for i in order],
        )
        index._order_rows_by_id()
        rows = index.search_texts(["Weng babysitting 50 minutes", "half", "nothing shared"], top_k=5)
        results.append([[(h.value, round(h.score, 6)) for h in row] for row in rows])
    assert results[0] == results[1]


def test_hashed_term_vectors_are_unit_deterministic_and_follow_shared_terms():
    enc = HashedTermEncoder(max_chars=1300)
    v = enc.embed(HISTORIES + [""])
    assert v.shape == (6, DIM) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v[:5], axis=1), 1.0) and not v[5].any()  # no terms: the zero vector
    assert np.array_equal(v, HashedTermEncoder().embed(HISTORIES + [""]))
    sims = v[:5] @ v[:5].T
    assert sims[0, 2] > sims[0, 1] and sims[1, 4] > sims[1, 3]  # Natalia with Natalia, Weng with Weng


def test_registry_names_each_backend_and_refuses_unknown_ones(tmp_path):
    assert backend_fingerprint("minilm") == {}  # buffers built before backends existed keep their names
    assert backend_fingerprint("bm25") == {"retrieval.embedder": "bm25/v1"}
    assert backend_fingerprint("minilm-onnx-int8")["retrieval.embedder"].startswith("minilm-onnx-int8/v")
    assert is_lexical("bm25") and not is_lexical("minilm")
    assert prepare_backend("bm25", tmp_path, "last") == "" and not list(tmp_path.iterdir())
    assert isinstance(make_encoder("bm25", "", "last", 1300), HashedTermEncoder)
    with pytest.raises(ConfigError, match="retrieval.embedder='faiss'"):
        backend_fingerprint("faiss")
    with pytest.raises(ConfigError, match="needs its model file"):
        make_encoder("minilm-onnx-int8", "", "last", 1300)
    with pytest.raises(ConfigError, match="with retrieval.search_on=milvus, set retrieval.embedder=minilm"):
        load_config(overrides=["retrieval.embedder=bm25", "retrieval.search_on=milvus"])
    with pytest.raises(ConfigError, match="retrieval.embedder"):
        load_config(overrides=["retrieval.embedder=all-MiniLM-L12-v2"])
    # runs saved before the backends existed name the embedder by its model: read as minilm
    assert load_config(overrides=["retrieval.embedder=all-MiniLM-L6-v2"]).retrieval.embedder == "minilm"


def test_onnx_int8_minilm_is_built_once_and_agrees_with_torch(tmp_path):
    from rapo_ray.retrieval.onnx_embedder import OnnxEmbedder

    path = prepare_backend("minilm-onnx-int8", tmp_path, "last")
    assert prepare_backend("minilm-onnx-int8", tmp_path, "last") == path  # cached, not exported again
    assert [p.name for p in (tmp_path / "embedders").iterdir()] == [path.split("/")[-2]]  # no temporary folder left
    onnx = make_encoder("minilm-onnx-int8", path, "last", 1300, cache_size=0)
    torch_vectors, onnx_vectors = Embedder(pooling="last").embed(HISTORIES), onnx.embed(HISTORIES)
    assert onnx_vectors.shape == torch_vectors.shape and np.allclose(np.linalg.norm(onnx_vectors, axis=1), 1.0)
    assert (onnx_vectors * torch_vectors).sum(1).min() > 0.95  # int8 weights: close, not equal
    assert np.array_equal((onnx_vectors @ torch_vectors.T).argmax(1), np.arange(len(HISTORIES)))
    # a text's vector does not depend on what it is batched with (positions from each text's first token)
    assert np.allclose(onnx.embed(HISTORIES[:1])[0], onnx_vectors[0], atol=1e-5)
    with pytest.raises(ValueError, match="exported for pooling 'last'"):
        OnnxEmbedder(path, pooling="mean")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        OnnxEmbedder(tmp_path / "missing.onnx")


def test_each_backend_other_than_minilm_gets_its_own_buffer(tmp_path):
    from rapo_ray.pipelines.buffer import buffer_collection, buffer_fingerprint

    names = {b: buffer_collection(load_config(overrides=[f"retrieval.embedder={b}"]), str(tmp_path)) for b in BACKENDS}
    assert len(set(names.values())) == 3
    # minilm buffers keep the names they had before the backends existed; the default, bm25, names its backend
    minilm = load_config(overrides=["retrieval.embedder=minilm"])
    assert "retrieval.embedder" not in buffer_fingerprint(minilm, str(tmp_path))
    assert buffer_fingerprint(load_config(), str(tmp_path))["retrieval.embedder"].startswith("bm25/v")


def test_the_buffer_builders_embed_step_keys_rows_with_each_backend(tmp_path):
    """The buffer's Ray Data stage (``EmbedStep``), built as ``build_buffer`` builds it, writes each backend's key
    vectors: what the replica of that backend reads back."""
    from rapo_ray.pipelines.embed_step import EmbedStep

    keys = np.array(HISTORIES[:3], dtype=object)
    for backend in BACKENDS:
        step = EmbedStep(backend, prepare_backend(backend, tmp_path, "last"), "last", 1300)
        vectors = step({"key": keys})["vector"]
        want = make_encoder(backend, prepare_backend(backend, tmp_path, "last"), "last", 1300).embed(list(keys))
        assert vectors.shape == (3, DIM) and np.allclose(vectors, want, atol=1e-6), backend


def test_a_lexical_replica_runs_its_searches_on_its_own_event_loop_and_an_embedder_keeps_serve_s_thread():
    lexical = replica_actor_options(load_config(overrides=["retrieval.embedder=bm25"]).retrieval)
    assert lexical == {
        "num_cpus": 0,
        "num_gpus": 0.0,
        "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}},
    }
    for embedder in ("minilm", "minilm-onnx-int8"):
        options = replica_actor_options(load_config(overrides=[f"retrieval.embedder={embedder}"]).retrieval)
        assert options == {"num_cpus": 0, "num_gpus": 0.0}, embedder


def test_a_bm25_replica_ranks_without_importing_torch():
    """What a ``bm25`` retrieval replica runs (the service module, its encoder, its BM25 copy of the collection)
    imports no torch nor transformers: about half the replica's start-up CPU and ~200 MB of its memory."""
    import subprocess

    probe = (
        "import sys, numpy as np; import rapo_ray.retrieval.service; "
        "from rapo_ray.retrieval.backends import make_encoder; "
        "from rapo_ray.retrieval.replica_index import LexicalReplicaIndex; "
        "enc = make_encoder('bm25', '', 'last', 1300); "
        "index = LexicalReplicaIndex(enc.dim, key_text=enc.embedded_text); "
        "index.add(['s0'], enc.embed(['Ava has 12 coins']), [('<python>print(12)</python>', '[]', 1.0, 'q0')], "
        "['Ava has 12 coins']); "
        "(hit,), = index.search_texts(['coins of Ava'], top_k=1); "
        "print(hit.value, sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "<python>print(12)</python> []"
